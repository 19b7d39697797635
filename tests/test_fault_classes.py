"""Whose fault: the exceptions real parts raise, and the host-network breaker's judgement.

The errors are produced for real (a full tmpfs, a second SQLite connection holding the
write lock, psycopg connecting to a closed port); the breaker is fed fetch outcomes of
the shapes the fetcher returns and probes real sockets.
"""
from __future__ import annotations

import errno
import socket
import sqlite3
import subprocess
from pathlib import Path

import pytest
from harness import free_port

from crawld.fetch import FetchResult, Kind, Reason
from crawld.pipeline.breaker import NetworkBreaker, unreachable_site
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
