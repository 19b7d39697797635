"""Local faults are not the task's fault (issue 14), on real servers.

A full disk (a real tmpfs), the SQLite write lock held by another process, PostgreSQL
down when `crawld run` starts, and every site unreachable: no task is dead-lettered, no
attempt is used, the worker pauses (visible in `crawld status` and ``crawld_paused``),
probes, and resumes by itself. One site down for good still ends in the dead letters.
Each test prints how long the worker took to notice the fault and to resume after it
cleared (the figures in the closing note of the issue).
"""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import pytest
from crawld_proc import Crawld
from harness import PostgresServer, free_port, wait_until

from crawld.devtools.testsite import TestSite

PAGE_BYTES = 100 * 1024


def _key() -> str:
    return uuid.uuid4().hex[:8]


def event_time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def first_event(daemon: Crawld, name: str, **match: Any) -> dict[str, Any] | None:
    for event in daemon.events(name):
        if all(event.get(k) == v for k, v in match.items()):
            return event
    return None


def paused_workers(daemon: Crawld, via_cli: bool = False) -> list[dict[str, Any]]:
    """The paused rows `crawld status --json` shows (``via_cli``), or the supervisor's
    state file it reads them from (when the store is what is down, status cannot open it)."""
    if via_cli:
        done = daemon.cli("status", "--json")
        assert done.returncode == 0, done.stderr
        sup = json.loads(done.stdout)["supervisor"] or {}
    else:
        sup = daemon.supervisor_state()
    return [w for w in sup.get("workers", []) if w.get("paused_reason")]


def paused_gauge(port: int, reason: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == "crawld_paused" and s.labels.get("reason") == reason)


def report(what: str, noticed_s: float, resumed_s: float) -> None:
    print(f"\n[issue14] {what}: noticed in {noticed_s:.2f}s, resumed {resumed_s:.2f}s after it cleared")


def assert_all_stored_none_dead(daemon: Crawld, n: int) -> None:
    assert daemon.count("dead") == 0, daemon.store.list_dead()
    assert daemon.count("results") == n
    assert daemon.count("attempts") == 0, "no attempt used: the fault was the worker's"
    assert daemon.count("results", "attempts != 1") == 0, "a deferred delivery used no attempt"
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == []


# -- a full body disk -----------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    """A filler file taking all but ``leave_bytes`` of the disk."""
    filler = disk / "filler"
    stat = os.statvfs(disk)
    size = stat.f_bavail * stat.f_frsize - leave_bytes
    with open(filler, "wb") as fh:
        fh.write(b"\0" * size)
    return filler


@pytest.mark.parametrize("transport", ["amqp", "jetstream"])
def test_body_disk_full_then_space_back_nothing_dead_every_body_there(make_crawld, sites, small_disk,
                                                                      transport):
    port = free_port()
    bodies = small_disk / "bodies"
    daemon = make_crawld(transport, workers={"count": 2, "threads": 4, "probe_max_s": 1},
                         queue={"prefetch": 4, "retry_delays_s": [1, 2], "max_deliver": 3},
                         store={"body_dir": str(bodies), "bodies": "files"}, metrics={"port": port})
    filler = fill(small_disk, leave_bytes=5 * PAGE_BYTES)
    key = _key()
    # Ten sites: partitioned, a site is one worker's, and both workers must have work.
    urls = [sites[i % len(sites)].url(f"/unique/{PAGE_BYTES}/{key}-{i}") for i in range(100)]
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    wait_until(lambda: len(paused_workers(daemon)) == 2, 60, what="both workers paused on the disk")
    assert {w["paused_reason"] for w in paused_workers(daemon, via_cli=True)} == {"disk"}
    assert "paused: disk" in daemon.cli("status").stdout
    wait_until(lambda: paused_gauge(port, "disk") == 2, 15, what="crawld_paused{reason=disk} == 2")
    stored_while_full = daemon.count("results")
    assert stored_while_full < 100
    time.sleep(15)                                   # the disk stays full for 15 s
    assert daemon.count("dead") == 0 and daemon.count("results") == stored_while_full
    filler.unlink()
    freed_at = time.time()
    wait_until(lambda: not paused_workers(daemon), 30, what="both workers resumed by themselves")
    daemon.wait_finished(100, timeout=120)
    assert daemon.stop() == 0
    assert_all_stored_none_dead(daemon, 100)
    for sha, size in daemon.store.query("SELECT body_sha256, bytes FROM results"):
        path = daemon.store.body_path(sha)
        assert path.exists() and path.stat().st_size == size == PAGE_BYTES, "a row whose body is missing"
    assert daemon.events("worker_died") == []
    faults = daemon.events("worker_fault")
    paused = daemon.events("worker_paused")
    resumed = daemon.events("worker_resumed")
    assert {e["pid"] for e in paused} == {e["pid"] for e in resumed} and len(paused) == len(resumed)
    assert len(paused) <= 2 * 3, "one event per state change, not per task"
    noticed = max(event_time(p) - event_time(f) for f, p in zip(faults[:1], paused[:1]))
    report(f"disk full ({transport})", noticed, max(event_time(e) for e in resumed) - freed_at)


# -- the SQLite write lock held by another process --------------------------------------------
def test_sqlite_write_lock_held_20s_midrun_nothing_dead(make_crawld, site, tmp_store):
    daemon = make_crawld("amqp", workers={"count": 2, "threads": 4, "probe_max_s": 1},
                         queue={"prefetch": 4, "retry_delays_s": [1, 2], "max_deliver": 3},
                         store={"lock_wait_s": 2})
    key = _key()
    assert daemon.publish([site.url(f"/slow/0.05/{key}-{i}") for i in range(400)]).returncode == 0
    daemon.start()
    wait_until(lambda: daemon.finished() >= 50, 60, what="the run under way")
    holder = sqlite3.connect(tmp_store.path, timeout=30, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    locked_at = time.time()
    wait_until(lambda: len(paused_workers(daemon)) >= 1, 30, what="a worker paused on the store")
    time.sleep(max(0.0, locked_at + 20 - time.time()))
    holder.execute("ROLLBACK")
    released_at = time.time()
    holder.close()
    daemon.wait_finished(400, timeout=120)
    assert daemon.stop() == 0
    assert_all_stored_none_dead(daemon, 400)
    paused = daemon.events("worker_paused")
    assert paused and {e["reason"] for e in paused} == {"store"}
    resumed = [e for e in daemon.events("worker_resumed") if event_time(e) >= released_at - 3]
    assert resumed
    report("sqlite write lock (lock_wait_s 2)", min(event_time(e) for e in paused) - locked_at,
           max(event_time(e) for e in resumed) - released_at)


# -- PostgreSQL not up when `crawld run` starts --------------------------------------------------
def test_postgres_down_at_start_up_20s_later_service_stays_up(make_crawld, site):
    pg = PostgresServer()
    pg.start()
    try:
        daemon = make_crawld("amqp", workers={"count": 2, "threads": 4, "probe_max_s": 2},
                             store={"url": pg.url})
        key = _key()
        assert daemon.publish([site.url(f"/fast/{key}-{i}") for i in range(200)]).returncode == 0
        pg.stop(cleanup=False)
        down_at = time.time()
        daemon.start()
        wait_until(lambda: len(paused_workers(daemon)) == 2, 30, what="both workers waiting for the store")
        assert {w["paused_reason"] for w in paused_workers(daemon)} == {"store"}
        time.sleep(max(0.0, down_at + 20 - time.time()))
        assert daemon.proc.poll() is None, "the supervisor is still up"
        pg.start()
        up_at = time.time()
        daemon.wait_finished(200, timeout=120)
        assert daemon.stop() == 0
        assert daemon.events("worker_died") == [] and daemon.events("crash_loop") == []
        assert_all_stored_none_dead(daemon, 200)
        resumed = daemon.events("worker_resumed")
        assert len(resumed) == 2 and all(e.get("at") == "boot" for e in resumed)
        paused = daemon.events("worker_paused")
        report("postgres down at boot", min(event_time(e) for e in paused) - down_at,
               max(event_time(e) for e in resumed) - up_at)
    finally:
        pg.stop()


def test_postgres_wrong_database_is_still_a_boot_error(make_crawld, postgres):
    daemon = make_crawld("amqp", workers={"count": 1},
                         store={"url": postgres.url_for(f"nosuch{_key()}")})
    daemon.start()
    assert daemon.proc.wait(60) == 2, "a permanent store error stops the service at once"
    assert "store.url: cannot open" in daemon.log_path.read_text()
    assert daemon.events("worker_paused") == [] and daemon.events("worker_spawned") == []


# -- the crawler's own network down ----------------------------------------------------------------
class Sites:
    """Independent sites on their own hosts (so their own shards when partitioned) that
    can all be stopped and restarted in place."""

    def __init__(self, n: int) -> None:
        self.sites = [TestSite(host=f"127.0.0.{21 + i}").start() for i in range(n)]

    def urls(self, per_site: int, key: str, path: str = "slow/0.05") -> list[str]:
        return [s.url(f"/{path}/{key}-{j}") for j in range(per_site) for s in self.sites]

    def stop(self, which: list[TestSite] | None = None) -> None:
        """All of them unreachable at the same moment, like a host whose network fails."""
        for s in which or self.sites:
            s.refuse()
        for s in which or self.sites:
            s.stop()

    def start(self) -> None:
        for s in self.sites:
            s.start()

    def close(self) -> None:
        self.stop()


@pytest.fixture
def six_sites() -> Iterator[Sites]:
    sites = Sites(6)
    yield sites
    sites.close()


@pytest.fixture
def ten_sites() -> Iterator[Sites]:
    """Enough hosts that, partitioned, each of two workers owns some of them."""
    sites = Sites(10)
    yield sites
    sites.close()


@pytest.mark.parametrize("transport", ["amqp", "jetstream"])
def test_every_site_unreachable_30s_nothing_dead_all_stored(make_crawld, ten_sites, transport):
    daemon = make_crawld(transport, workers={"count": 2, "threads": 8, "probe_max_s": 2},
                         queue={"prefetch": 8, "retry_delays_s": [1, 2], "max_deliver": 3},
                         fetch={"connect_timeout_s": 1, "timeout_s": 3})
    key = _key()
    urls = ten_sites.urls(30, key)
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    wait_until(lambda: daemon.finished() >= 40, 60, what="the run under way")
    down_at = time.time()
    ten_sites.stop()
    wait_until(lambda: len(paused_workers(daemon)) == 2, 30, what="both workers paused on the network")
    assert {w["paused_reason"] for w in paused_workers(daemon, via_cli=True)} == {"network"}
    time.sleep(max(0.0, down_at + 30 - time.time()))
    assert daemon.count("dead") == 0, daemon.dead_explained()
    ten_sites.start()
    up_at = time.time()
    daemon.wait_finished(len(urls), timeout=120)
    assert daemon.stop() == 0
    assert daemon.count("dead") == 0, daemon.dead_explained()
    assert daemon.count("results") == len(urls)
    assert daemon.reconcile()[0] == 0
    paused = [e for e in daemon.events("worker_paused") if e["reason"] == "network"]
    resumed = daemon.events("worker_resumed")
    report(f"every site unreachable ({transport})", min(event_time(e) for e in paused) - down_at,
           max(event_time(e) for e in resumed) - up_at)


def test_one_site_down_for_good_goes_to_the_dead_letters_others_stored(make_crawld, six_sites):
    daemon = make_crawld("amqp", workers={"count": 2, "threads": 8},
                         queue={"prefetch": 8, "retry_delays_s": [1, 2], "max_deliver": 3},
                         fetch={"connect_timeout_s": 1, "timeout_s": 3})
    down = six_sites.sites[0]
    key = _key()
    urls = six_sites.urls(30, key, path="fast")
    down_urls = {u for u in urls if u.startswith(down.base_url)}
    down.stop()
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    daemon.wait_finished(len(urls), timeout=120)
    assert daemon.stop() == 0
    dead = daemon.store.list_dead(limit=1000)
    assert {d.url for d in dead} == down_urls
    assert {(d.reason, d.attempts) for d in dead} == {("retries_exhausted", 3)}
    assert daemon.count("results") == len(urls) - len(down_urls)
    assert daemon.events("worker_paused") == [], "one site down is the site's fault"
