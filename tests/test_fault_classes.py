"""Whose fault: the exceptions real parts raise, and the host-network breaker's judgement.

The errors are produced for real (a full tmpfs, a second SQLite connection holding the
write lock, psycopg connecting to a closed port); the breaker is fed fetch outcomes of
the shapes the fetcher returns and probes real sockets.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from harness import free_port

from crawld.fetch import FetchResult, Kind, Reason
from crawld.pipeline.breaker import HostEvidence, NetworkBreaker, unreachable_site
from crawld.pipeline.faults import Fault, local_fault


def test_a_full_disk_is_a_disk_fault(tmp_path: Path) -> None:
    mount = tmp_path / "tiny"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        with pytest.raises(OSError) as caught:
            (mount / "big").write_bytes(b"\0" * 1024 * 1024)
        assert caught.value.errno == errno.ENOSPC
        assert local_fault(caught.value) is Fault.DISK
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_locked_sqlite_database_is_a_store_fault_other_errors_are_not(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    other = sqlite3.connect(db, timeout=0.1, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError) as locked:
        other.execute("BEGIN IMMEDIATE")
    assert local_fault(locked.value) is Fault.STORE
    with pytest.raises(sqlite3.OperationalError) as bug:
        other.execute("SELECT nosuchcolumn FROM t")
    assert local_fault(bug.value) is None, "a bad statement is our bug, not an outage"
    holder.execute("ROLLBACK")


def test_postgres_unreachable_is_a_store_fault_even_wrapped() -> None:
    import psycopg
    with pytest.raises(psycopg.OperationalError) as caught:
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{free_port()}/x", connect_timeout=2)
    assert local_fault(caught.value) is Fault.STORE
    try:
        raise RuntimeError("store write failed") from caught.value
    except RuntimeError as wrapped:
        assert local_fault(wrapped) is Fault.STORE
    assert local_fault(ValueError("bad value")) is None


def unreachable(url: str, reason: str = Reason.CONNECTION, error: str = "refused") -> FetchResult:
    return FetchResult(Kind.ERROR, url, reason=reason, error=error)


def ok(url: str) -> FetchResult:
    return FetchResult(Kind.RESPONSE, url, http_status=200)


def test_one_site_down_never_opens_the_breaker() -> None:
    breaker = NetworkBreaker(window=20, ratio=0.8, min_sites=3)
    assert not any(breaker.record(unreachable("http://down.example/a")) for _ in range(100))


def test_many_sites_unreachable_open_it_a_fifth_answering_keeps_it_shut() -> None:
    breaker = NetworkBreaker(window=20, ratio=0.8, min_sites=3)
    sites = [f"http://s{i}.example/p" for i in range(6)]
    for i in range(15):
        assert not breaker.record(unreachable(sites[i % 6]))
    for i in range(5):
        assert not breaker.record(ok(sites[i]))           # 15 of 20 failed: 0.75 < 0.8
    opened = [breaker.record(unreachable(sites[i % 6], Reason.TIMEOUT)) for i in range(20)]
    # the successes leave the window one by one: open from 16 failures of 20 (0.8) on
    assert opened.index(True) == 15 and all(opened[15:])
    assert not breaker.record(ok(sites[0])), "a success is never deferred"
    breaker.reset()
    assert not breaker.record(unreachable(sites[0])), "judged on fresh outcomes after a reset"


def test_the_host_counts_sites_over_all_its_workers_each_judges_its_own_ratio(tmp_path) -> None:
    """Partitioned, a worker sees a few sites: it trips when its own fetches mostly fail
    and the host's workers together cannot reach three sites; one site down stays the
    site's problem however many workers see it."""
    one = NetworkBreaker(window=4, ratio=1.0, min_sites=3, evidence=HostEvidence(tmp_path, "one"))
    two = NetworkBreaker(window=4, ratio=1.0, min_sites=3, evidence=HostEvidence(tmp_path, "two"))
    alone = NetworkBreaker(window=4, ratio=1.0, min_sites=3)
    for i in range(3):
        assert not two.record(unreachable(f"http://s{i % 2}.example/"))
    assert not any(alone.note(("s2.example", 80)) or alone.note(("s3.example", 80)) for _ in range(4))
    assert not any(one.note(("s2.example", 80)) for _ in range(4)), "two sites on the host"
    two.record(unreachable("http://s1.example/"))
    two.evidence.publish(two._failed, paused=False, force=True)
    one.evidence._read_at = 0.0                             # its once-a-second read, now
    assert one.note(("s2.example", 80)), "s0, s1 from its sibling and s2 of its own"
    assert not one.note(None), "an answer is never deferred"
    old = time.time() - 60
    os.utime(two.evidence.own, (old, old))                  # a dead sibling's list expires
    one.evidence._read_at = 0.0
    assert not any(one.note(("s2.example", 80)) for _ in range(4)), "s2 alone"
    two.evidence.close()
    assert not two.evidence.own.exists()
    one.reset()
    assert json.loads(one.evidence.own.read_text()) == {"unreachable": [], "paused": False}, \
        "a reset clears what it told the host"
    gone = _pid_of_finished_process()
    killed = tmp_path / f"{gone}.json"                      # a SIGKILLed worker's fresh list
    killed.write_text(json.dumps({"unreachable": ["s0.example:80", "s1.example:80"], "paused": True}))
    one.evidence._read_at = 0.0
    assert not any(one.note(("s2.example", 80)) for _ in range(4)), "its writer is gone"
    assert not killed.exists()


def test_a_tripping_worker_tells_the_host_every_site_at_once(tmp_path) -> None:
    """The list is written at most once a second, but the trip is written at once: the
    worker pauses then and notes nothing more, and a sibling that owns fewer sites needs
    the full list to judge its own failures."""
    breaker = NetworkBreaker(window=6, ratio=1.0, min_sites=3, evidence=HostEvidence(tmp_path, "w"))
    sites = [(f"s{i}.example", 80) for i in range(6)]
    assert not any(breaker.note(site) for site in sites[:5])
    assert _told(breaker) == {"unreachable": ["s0.example:80"], "paused": False}, "rate-limited"
    assert breaker.note(sites[5])
    assert _told(breaker) == {"unreachable": sorted(f"{h}:{p}" for h, p in sites), "paused": True}


def test_once_a_sibling_paused_few_failures_pause_a_worker_and_it_probes_the_hosts_sites(tmp_path) -> None:
    """A worker owning one site with a few tasks left would spend their attempts waiting
    for a full window: once a sibling has paused on the network, its own failures are
    enough (never its successes). Paused, it probes the sites that made the case, so its
    own site being down for good does not keep it paused when the others answer."""
    answering = socket.create_server(("127.0.0.1", 0))
    back = ("127.0.0.1", answering.getsockname()[1])
    dead = [(f"127.0.0.{i}", free_port()) for i in (2, 3, 4)]       # nothing listens there
    sibling = NetworkBreaker(window=3, ratio=1.0, min_sites=3, evidence=HostEvidence(tmp_path, "sibling"))
    small = NetworkBreaker(window=20, ratio=0.8, min_sites=3, connect_timeout_s=1,
                           evidence=HostEvidence(tmp_path, "small"))
    healthy = NetworkBreaker(window=20, ratio=0.8, min_sites=3, evidence=HostEvidence(tmp_path, "healthy"))
    assert not small.note(dead[0]), "nobody paused yet: judged on a full window"
    assert [sibling.note(site) for site in (dead[1], dead[2], back)] == [False, False, True]
    small.evidence._read_at = healthy.evidence._read_at = 0.0
    assert small.note(dead[0]), "a sibling paused on the network and its own fetches fail"
    assert not any(healthy.note(None) for _ in range(4))
    assert not healthy.note(dead[0]), "its own fetches get through: the network works"
    small.probe()                                   # its own site is still down; `back` answers
    answering.close()
    with pytest.raises(ConnectionError, match="no site reachable"):
        small.probe()
    sibling.reset()
    small.evidence._read_at = 0.0
    assert not small.evidence.sibling_paused()


def _told(breaker: NetworkBreaker) -> dict:
    return json.loads(breaker.evidence.own.read_text())


def _pid_of_finished_process() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_nxdomain_and_http_answers_are_the_sites_not_the_host() -> None:
    assert unreachable_site(unreachable("http://nosuch.example/", Reason.DNS,
                                        "no such name nosuch.example (NXDOMAIN)")) is None
    assert unreachable_site(unreachable("http://a.example/", Reason.DNS, "The DNS operation timed out")) \
        == ("a.example", 80)
    assert unreachable_site(FetchResult(Kind.RESPONSE, "http://a.example/", http_status=503)) is None
    assert unreachable_site(unreachable("https://a.example:8443/")) == ("a.example", 8443)


def test_probe_passes_when_a_failing_site_accepts_a_connection_again() -> None:
    port = free_port()
    breaker = NetworkBreaker(window=2, ratio=1.0, min_sites=2, connect_timeout_s=1)
    breaker.record(unreachable(f"http://127.0.0.1:{port}/"))
    breaker.record(unreachable(f"http://localhost:{port}/"))
    with pytest.raises(ConnectionError):
        breaker.probe()
    listener = socket.create_server(("127.0.0.1", port))
    try:
        breaker.probe()
    finally:
        listener.close()
