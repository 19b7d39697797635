"""Drive the real `crawld` CLI as subprocesses, and read its store and JSON logs."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

from harness import wait_until

from crawld.config import load_config
from crawld.devtools.procs import children_of, read_proc
from crawld.store import Store, open_store

CRAWLD = [sys.executable, "-m", "crawld"]
TESTS_DIR = str(Path(__file__).resolve().parent)


class Crawld:
    """One config file = one crawld installation under test."""

    def __init__(self, config_path: Path, env: dict[str, str] | None = None) -> None:
        self.config_path = Path(config_path)
        self.dir = self.config_path.parent
        self.env = with_fault_middleware({**os.environ, "CRAWLD_LOG_FORMAT": "json", **(env or {})})
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "crawld-run.log"
        self._store: Store | None = None

    # -- one-shot commands ---------------------------------------------------------------
    def cli(self, *args: str, input: str | None = None, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        cmd = [*CRAWLD, *args, "-c", str(self.config_path)]
        return subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout,
                              env=with_fault_middleware({**self.env, **(env or {})}))

    def publish(self, urls: Iterable[str], round_: str = "0") -> subprocess.CompletedProcess:
        return self.cli("publish", "--round", round_, str(self._url_file(urls)))

    def start_publish(self, urls: Iterable[str], log_path: Path) -> subprocess.Popen[str]:
        """``publish`` in the background: the summary on its stdout, its log in ``log_path``."""
        with open(log_path, "w") as log:
            return subprocess.Popen([*CRAWLD, "publish", "--round", "0", str(self._url_file(urls)),
                                     "-c", str(self.config_path)],
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=self.env)

    def _url_file(self, urls: Iterable[str]) -> Path:
        path = self.dir / f"urls-{time.monotonic_ns()}.txt"
        path.write_text("".join(u + "\n" for u in urls))
        return path

    def reconcile(self, grace: float = 0.0) -> tuple[int, dict[str, Any]]:
        done = self.cli("reconcile", "--json", "--grace", str(grace))
        return done.returncode, json.loads(done.stdout)

    # -- the supervisor ------------------------------------------------------------------
    def start(self, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([*CRAWLD, "run", "-c", str(self.config_path), *extra],
                                     stdout=log, stderr=subprocess.STDOUT,
                                     env=with_fault_middleware({**self.env, **(env or {})}))
        log.close()
        return self.proc

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def worker_pids(self) -> list[int]:
        assert self.proc is not None
        if self.proc.poll() is not None:
            return []
        return self._ours(children_of(self.proc.pid))

    def tree(self) -> list[int]:
        """The running supervisor and its descendants, each checked to be a process of this
        config: after the supervisor is reaped its pid number can belong to any new process
        (pid_max wraps within a long run), and walking "its" children once killed a RabbitMQ
        node. Empty once the supervisor has exited."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        return self._ours([self.proc.pid, *all_descendants(self.proc.pid)])

    def _ours(self, pids: list[int]) -> list[int]:
        needle = str(self.config_path)
        return [pid for pid in pids if (found := read_proc(pid)) and needle in found[0].cmdline]

    def wait_workers(self, count: int, timeout: float = 30) -> list[int]:
        wait_until(lambda: len(self.worker_pids()) == count and all(
            self._state_of(p) == "running" for p in self.worker_pids()), timeout,
            what=f"{count} running workers")
        return self.worker_pids()

    def busiest_worker(self, timeout: float = 10) -> int:
        """The pid of the worker with the most deliveries in flight (partitioned, only the
        owners of the busy shards have any)."""
        def inflight() -> dict[int, int]:
            return {w["pid"]: w.get("inflight", 0) for w in self.supervisor_state().get("workers", [])}
        wait_until(lambda: any(inflight().values()), timeout, what="a worker with work in flight")
        counts = inflight()
        return max(counts, key=counts.__getitem__)

    def work_queue_of(self, url: str) -> str:
        """The AMQP queue a task for ``url`` is published to (its shard, or the work queue)."""
        from crawld.transports.amqp.topology import route_for
        return route_for(load_config(str(self.config_path)), url)

    def _state_of(self, pid: int) -> str:
        for w in self.supervisor_state().get("workers", []):
            if w["pid"] == pid:
                return w["state"]
        return ""

    def supervisor_state(self) -> dict[str, Any]:
        from crawld.process.files import state_file
        try:
            return json.loads(state_file(load_config(str(self.config_path))).read_text())
        except (OSError, ValueError):
            return {}

    # -- store and logs ------------------------------------------------------------------
    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(load_config(str(self.config_path)).store)
        return self._store

    def count(self, table: str, where: str = "1=1") -> int:
        return int(self.store.query(f"SELECT COUNT(*) FROM {table} WHERE {where}")[0][0])

    def finished(self) -> int:
        return self.count("results") + self.count("dead")

    def wait_finished(self, n: int, timeout: float = 120) -> None:
        wait_until(lambda: self.finished() >= n, timeout, interval=0.2,
                   what=f"{n} tasks finished (have {self.finished()})")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        return parse_events(self.log_path.read_text(errors="replace"), name)

    def dead_explained(self, limit: int = 5) -> str:
        """For a failed "nothing dead" assertion: each dead row and its task's log events."""
        lines = []
        events = self.events()
        for row in self.store.list_dead(limit=limit):
            lines.append(f"dead {row.url} reason={row.reason} attempts={row.attempts} error={row.error}")
            lines += [f"  {e}" for e in events if e.get("task_id") == row.task_id]
        return "\n".join(lines)

    def log_digest(self, last: int = 50) -> str:
        """For a failed test's report: how often each event came, which shards each worker
        claimed, and the last ``last`` other events (time, pid, event, their fields)."""
        events = self.events()
        counts = Counter(e.get("event") for e in events)
        claimed: dict[str, list[Any]] = {}
        for e in events:
            if e.get("event") == "shard_claimed":
                claimed.setdefault(str(e.get("worker")), []).append(e.get("shard"))
        lines = [f"log {self.log_path}: " + ", ".join(f"{name} {n}" for name, n in counts.most_common())]
        lines += [f"shards claimed by {worker}: {shards}" for worker, shards in claimed.items()]
        flood = {"shard_claimed", "shard_released", "jetstream_consumer_created"}
        for e in [e for e in events if e.get("event") not in flood][-last:]:
            extra = {k: v for k, v in e.items() if k not in ("event", "timestamp", "level", "pid", "logger")}
            lines.append(f"{str(e.get('timestamp', ''))[11:23]} {e.get('pid')} {e.get('level')} "
                         f"{e.get('event')} {json.dumps(extra, default=str)[:300]}")
        return "\n".join(lines)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            tree = self.tree()          # the whole tree while the supervisor's pid is ours
            self.proc.kill()
            for pid in tree:
                _kill(pid)
            self.proc.wait()
        if self._store is not None:
            self._store.close()


def with_fault_middleware(env: dict[str, str]) -> dict[str, str]:
    """A test that sets CRAWLD_TEST_FAULT gets tests/faults.py loaded into its workers
    (the supervisor passes both the env and the config on to them)."""
    from faults import FAULT_ENV, MIDDLEWARE_SPEC
    if not env.get(FAULT_ENV):
        return env
    path = [TESTS_DIR, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "CRAWLD_PIPELINE_MIDDLEWARE": json.dumps([MIDDLEWARE_SPEC]),
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}


def run_always_500_against_300_good(daemon: "Crawld", site: Any, key: str) -> tuple[Any, list[dict]]:
    """One always-500 page among 300 good ones, retry tiers [1, 2, 3] s, max_deliver 4:
    the bad one walks every tier and ends dead; the good ones finish first.
    Returns the dead row and its attempt rows for transport-specific checks."""
    bad = site.url(f"/500/{key}")
    assert daemon.publish([bad] + [site.url(f"/fast/{key}-{i}") for i in range(300)]).returncode == 0
    daemon.start()
    daemon.wait_finished(301, timeout=60)
    assert daemon.stop() == 0
    dead = daemon.store.list_dead()
    assert [(d.url, d.attempts, d.reason) for d in dead] == [(bad, 4, "retries_exhausted")]
    good_done = daemon.store.query("SELECT MAX(fetched_at) FROM results")[0][0]
    assert good_done < dead[0].dead_at, "the main queue finished before the retries ran out"
    attempts = daemon.store.attempts_for(dead[0].task_id)
    assert [a["attempt"] for a in attempts] == [1, 2, 3, 4]
    assert [a["delay_s"] for a in attempts[:3]] == [1, 2, 3]
    gaps = [b["at"] - a["at"] for a, b in zip(attempts, attempts[1:])]
    assert all(g >= d * 0.9 for g, d in zip(gaps, [1, 2, 3])), gaps
    assert site.hits(f"/500/{key}") == 4
    return dead[0], attempts


def parse_events(text: str, name: str | None = None) -> list[dict[str, Any]]:
    """The JSON log events in ``text`` (other lines skipped), optionally of one name."""
    out = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if name is None or event.get("event") == name:
            out.append(event)
    return out


def all_descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in children_of(p)]
        found += kids
        frontier = kids
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sqlite_rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    wait_until(check, timeout, interval=0.1, what=what)
