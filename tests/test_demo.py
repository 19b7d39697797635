"""`crawld demo` as a newcomer runs it: a subprocess, no broker installed beforehand."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from crawld_proc import sqlite_rows
from harness import leftover_processes


def _ids(db: Path, sql: str) -> set[str]:
    return {row[0] for row in sqlite_rows(db, sql)}


def test_demo_200_tasks_end_to_end(tmp_path):
    workdir = tmp_path / "demo"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "crawld", "demo", "--tasks", "200", "--dir", str(workdir)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if not k.startswith("CRAWLD_")})
    print(done.stdout[-3000:])
    print(f"demo took {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert re.search(r"LOST\s+0\b", out)
    always_500 = 200 // 25
    assert re.search(rf"dead\s+{always_500}\b", out), "dead count equals the always-500 pages"
    assert "killed worker pid" in out
    for kind in ("always-500", "slow", "404", "500-then-ok", "redirect", "robots-disallowed", "fast"):
        assert kind in out
    assert "skipped robots" in out and "dead retries_exhausted" in out
    assert (workdir / "crawld.db").exists() and (workdir / "crawld.log").exists()
    # The demo's own LOST line is its reconcile; check the database ourselves as well.
    db = workdir / "crawld.db"
    outbox = _ids(db, "SELECT task_id FROM outbox")
    confirmed = _ids(db, "SELECT task_id FROM outbox WHERE state = 'confirmed'")
    results, dead = _ids(db, "SELECT task_id FROM results"), _ids(db, "SELECT task_id FROM dead")
    assert len(outbox) == 200 and confirmed == outbox, "every task published and confirmed"
    assert results | dead == outbox and not results & dead, "each task stored once, or dead"
    assert len(dead) == always_500
    assert _ids(db, "SELECT reason FROM dead") == {"retries_exhausted"}
    assert _ids(db, "SELECT url FROM dead") == _ids(db, "SELECT url FROM outbox WHERE url LIKE '%/500/%'")
    # The demo crawls: one seed, the rest found through links within depth 2.
    assert "pages per depth" in out and "off-site and nofollow links followed: 0" in out
    depths = dict(sqlite_rows(db, "SELECT depth, COUNT(*) FROM outbox GROUP BY depth"))
    assert depths[0] == 1 and depths[1] >= 1 and sum(depths.values()) == 200 and max(depths) == 2
    assert not _ids(db, "SELECT url FROM outbox WHERE url LIKE '%localhost%' OR url LIKE '%nofollow%' "
                        "OR url LIKE '%example.invalid%'")
    assert "Traceback" not in done.stderr
    time.sleep(0.5)
    assert leftover_processes(str(workdir)) == [], "nothing the demo started is left running"


def test_demo_amqp_without_rabbitmq_is_a_clear_message(tmp_path, monkeypatch):
    from crawld.devtools import demo
    monkeypatch.setattr(demo, "RABBITMQ_SERVER", str(tmp_path / "no-such-rabbitmq-server"))
    import argparse
    code = demo.run_demo(argparse.Namespace(dir=str(tmp_path / "d"), transport="amqp", tasks=10, workers=1))
    assert code == 2
