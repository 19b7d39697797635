"""The store, on SQLite and on a real PostgreSQL: the same assertions on both."""
from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import stat
import threading
import time
import uuid
from typing import Any, Callable

import pytest
from harness import older_database

from crawld.config import StoreConfig
from crawld.store import DeadRow, ResultRow, open_store
from crawld.task import new_task


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/s.db"
    else:
        pg = request.getfixturevalue("postgres")
        url = pg.create_database(f"s{uuid.uuid4().hex[:10]}")
    s = open_store(StoreConfig(url=url, body_dir=str(tmp_path / "bodies")))
    s.url = url
    yield s
    s.close()


def _result(task_id: str, status: str = "fetched", worker: str = "w1") -> ResultRow:
    return ResultRow(task_id=task_id, url=f"http://h/{task_id}", final_url="", status=status,
                     http_status=200, reason="", content_type="text/html", bytes=3, body_sha256="",
                     attempts=1, fetched_at=time.time(), worker=worker)


def test_outbox_is_idempotent_and_tracks_confirms(store):
    tasks = [new_task(f"http://h/{i}") for i in range(10)]
    assert store.outbox_add(tasks) == 10
    assert store.outbox_add(tasks) == 0
    assert len(store.outbox_unconfirmed()) == 10
    store.outbox_mark_confirmed([t.task_id for t in tasks[:7]])
    store.outbox_mark_failed({tasks[7].task_id: "unroutable"})
    assert {t.task_id for t in store.outbox_unconfirmed()} == {t.task_id for t in tasks[7:]}
    counts = store.counts()
    assert counts["confirmed"] == 7 and counts["unconfirmed"] == 3


def test_outbox_pages_through_new_rows_in_the_order_they_were_added(store):
    """A frontier's order (round-robin over sites) survives the outbox: task id order
    would scatter it. Pages follow on from each other; confirmed rows drop out."""
    first = [new_task(f"http://site{i % 3}/{i // 3}") for i in range(9)]
    later = [new_task(f"http://site{i % 3}/late{i}") for i in range(4)]
    assert [t.task_id for t in first] != sorted(t.task_id for t in first)
    store.outbox_add(first)
    store.outbox_insert(later)
    store.outbox_add(first[:2])                      # already there: keeps its place
    store.outbox_mark_confirmed([first[4].task_id])
    pages = list(store.outbox_unconfirmed_pages(3))
    assert [len(p) for p in pages] == [3, 3, 3, 3]
    expected = [t.task_id for t in first + later if t is not first[4]]
    assert [t.task_id for p in pages for t in p] == expected
    if store.url.startswith("sqlite"):
        plan = " ".join(str(r) for r in store.query(
            "EXPLAIN QUERY PLAN SELECT task_id FROM outbox WHERE state = 'new' AND "
            "(created_at, task_id) > (0, '') ORDER BY created_at, task_id LIMIT 3"))
        assert "outbox_state_order" in plan and "TEMP B-TREE" not in plan, plan   # no sort per page


def test_result_upsert_one_row_per_task(store):
    store.put_result(_result("a"))
    store.put_result(_result("a", status="http_error", worker="w2"))
    row = store.get_result("a")
    assert row["status"] == "http_error" and row["worker"] == "w2" and row["writes"] == 2
    assert store.query("SELECT COUNT(*) FROM results")[0][0] == 1
    assert store.has_result("a") and not store.has_result("b")


def test_reconcile_finds_lost(store):
    tasks = [new_task(f"http://h/{i}") for i in range(4)]
    store.outbox_add(tasks)
    store.outbox_mark_confirmed([t.task_id for t in tasks])
    store.put_result(_result(tasks[0].task_id))
    store.put_dead(DeadRow(task_id=tasks[1].task_id, url=tasks[1].url, reason="r", error="e",
                           attempts=5, origin="crawl", dead_at=time.time()))
    assert store.lost(grace_s=0) == sorted([tasks[2].task_id, tasks[3].task_id])
    assert store.lost(grace_s=3600) == []
    store.remove_dead([tasks[1].task_id])
    assert tasks[1].task_id in store.lost(0)


def test_dead_rows_and_redelivery_counter(store):
    for i in range(3):
        store.put_dead(DeadRow(task_id=f"d{i}", url=f"http://h/{i}", reason="retries_exhausted",
                               error="HTTP 500", attempts=5, origin="crawl", dead_at=time.time() - i * 100))
    assert [r.task_id for r in store.list_dead(limit=2)] == ["d0", "d1"]
    assert store.dead_since(time.time() - 50) == 1
    assert [store.bump_redelivery("x") for _ in range(3)] == [1, 2, 3]


def test_bodies_content_addressed(store):
    digest = store.save_body(b"hello")
    assert store.save_body(b"hello") == digest
    assert store.body_path(digest).read_bytes() == b"hello"


def test_bodies_leave_no_temporary_file_and_stay_private(store):
    body = b"x" * 5000
    digest = hashlib.sha256(body).hexdigest()
    many = _in_threads(lambda i: store.save_body(body if i % 2 else b"%d" % i), 16)
    assert set(many[1::2]) == {digest}
    assert store.body_path(digest).read_bytes() == body
    assert stat.S_IMODE(store.body_path(digest).stat().st_mode) == 0o600   # bodies stay private
    assert not [p for p in store.body_dir.rglob(".tmp-*")]


def test_a_body_makes_its_directory_only_when_missing(store, monkeypatch):
    """A store past its first bodies has its ab/cd/ directories, made by other processes
    and earlier runs: a body written there asks for no mkdir (each was a mkdir and a stat,
    for nearly every body of a process's first hours); a missing directory is still made."""
    body, other = b"in a directory made earlier", b"in a new one"
    here = store.body_path(hashlib.sha256(body).hexdigest())
    there = store.body_path(hashlib.sha256(other).hexdigest())
    assert here.parent.parent != there.parent.parent      # different ab/
    os.makedirs(here.parent)
    made = []
    real_makedirs = os.makedirs
    monkeypatch.setattr(os, "makedirs", lambda *a, **kw: made.append(a[0]) or real_makedirs(*a, **kw))
    store.save_body(body)
    assert made == [] and here.read_bytes() == body
    store.save_body(other)
    assert made[0] == str(there.parent) and there.read_bytes() == other


BODIES_PER_WORKER = 100


def _write_bodies(store: Any, worker: int, done: Any) -> None:
    # in the main thread: its id is the parent's in every forked child
    for n in range(BODIES_PER_WORKER):
        store.save_body(b"%d-%d-" % (worker, n) * 8000)
    done.put(store._process_tag())


def test_forked_writers_sharing_a_store_never_swap_bodies(tmp_path):
    """Workers forked from one process with the store already open, as the supervisor's
    are, write different bodies at once into one directory from their main threads (the
    same thread id in each): each has a temporary name of its own, and every file holds
    the bytes its name is the digest of (two writers sharing a name can swap bodies, when
    two of them write into one ab/cd/ directory at once: too rare to provoke here)."""
    s = open_store(StoreConfig(url=f"sqlite:///{tmp_path}/s.db", body_dir=str(tmp_path / "bodies")))
    s.save_body(b"the parent wrote first")      # its temporary-name tag is drawn here
    fork = multiprocessing.get_context("fork")
    done = fork.Queue()
    workers = [fork.Process(target=_write_bodies, args=(s, w, done)) for w in range(4)]
    for proc in workers:
        proc.start()
    for proc in workers:
        proc.join(60)
    tags = {done.get(timeout=5) for _ in workers}
    assert len(tags | {s._process_tag()}) == 1 + len(workers), tags
    files = [p for p in s.body_dir.rglob("*") if p.is_file()]
    assert len(files) == 1 + 4 * BODIES_PER_WORKER and not [p for p in files if p.name.startswith(".tmp-")]
    assert all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name for p in files)
    s.close()


def _in_threads(target: Callable[[int], Any], n: int,
                while_running: Callable[[], None] = lambda: None) -> list[Any]:
    """Run ``target(i)`` for i < n at once; each outcome is its return value or the
    exception it raised, checked by the caller in the main thread (an assert failing
    inside a thread would not fail the test)."""
    outcomes: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            outcomes[i] = target(i)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        while_running()
    finally:
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a writer hung"
    return outcomes


def test_many_threads_write_at_once(store):
    def writer(n: int) -> None:
        for i in range(50):
            store.put_result(_result(f"t{i}", worker=f"w{n}"))
            store.put_attempt(f"t{i}", n, "u", "e", 500, 1.0, f"w{n}")

    assert _in_threads(writer, 8) == [None] * 8
    assert store.query("SELECT COUNT(*) FROM results")[0][0] == 50
    assert store.query("SELECT SUM(writes) FROM results")[0][0] == 400


def _process_writer(url: str, body_dir: str, n: int) -> None:
    s = open_store(StoreConfig(url=url, body_dir=body_dir))
    for i in range(100):
        s.put_result(_result(f"p{i}", worker=f"proc{n}"))
    s.close()


def test_several_processes_write_at_once(store, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_process_writer, args=(store.url, str(tmp_path / "b"), n)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert store.query("SELECT COUNT(*) FROM results")[0][0] == 100
    assert store.query("SELECT SUM(writes) FROM results")[0][0] == 400


@pytest.fixture
def fresh_reader(store, tmp_path):
    """A second store on the same database: its connections never wrote, so a row it sees
    is committed, not merely visible inside the writer's own transaction."""
    reader = open_store(StoreConfig(url=store.url, body_dir=str(tmp_path / "reader")))
    yield reader
    reader.close()


def _hold_first_batch(store) -> tuple[threading.Event, threading.Event, list[list[str]]]:
    """Make the committer stop inside its first batch until ``release`` is set, so the
    writes submitted meanwhile are all committed together in the next batch.
    Returns (held, release, the task ids of each committed batch)."""
    group = store._group
    held, release = threading.Event(), threading.Event()
    batches: list[list[str]] = []
    real_commit = group._commit

    def commit(batch):
        if not held.is_set():
            held.set()
            release.wait(30)
        batches.append([item.params[0] for item in batch])   # task_id is the first column
        real_commit(batch)

    group._commit = commit
    return held, release, batches


def _wait_queued(store, n: int) -> None:
    deadline = time.monotonic() + 30
    while store._group.queue.qsize() < n:
        assert time.monotonic() < deadline, "writers never queued"
        time.sleep(0.01)


def test_group_commit_is_durable_per_caller_and_isolates_errors(store, fresh_reader):
    store.enable_group_commit(max_batch=64)

    def writer(n: int) -> list[str]:
        unseen = []
        for i in range(40):
            store.put_result(_result(f"g{n}-{i}"))
            # Committed when put_result returns: a fresh connection sees it at once.
            if not fresh_reader.has_result(f"g{n}-{i}"):
                unseen.append(f"g{n}-{i}")
        return unseen

    assert _in_threads(writer, 8) == [[]] * 8
    assert store.query("SELECT COUNT(*) FROM results")[0][0] == 320

    # One failing statement inside a shared batch: only its caller sees the error.
    callers, bad_caller = 6, 3

    def caller(n: int) -> bool:
        row = _result(f"c{n}")
        if n == bad_caller:
            row.url = None                 # NOT NULL violation
        store.put_result(row)
        return fresh_reader.has_result(f"c{n}")

    held, release, batches = _hold_first_batch(store)

    def release_when_queued() -> None:
        try:
            _wait_queued(store, callers)
        finally:
            release.set()

    gate = threading.Thread(target=store.put_result, args=(_result("gate"),))
    gate.start()
    try:
        assert held.wait(30)
        outcomes = _in_threads(caller, callers, while_running=release_when_queued)
    finally:
        release.set()
        gate.join(60)
    assert batches[0] == ["gate"] and fresh_reader.has_result("gate")
    assert sorted(batches[1]) == [f"c{n}" for n in range(callers)]   # one batch, bad row in it
    error = outcomes[bad_caller]
    assert isinstance(error, Exception) and "null" in str(error).lower() and "url" in str(error)
    assert [o for n, o in enumerate(outcomes) if n != bad_caller] == [True] * (callers - 1)
    assert not fresh_reader.has_result(f"c{bad_caller}")

    # The committer keeps working after a failed batch, and a caller alone fails too.
    bad = _result("bad")
    bad.url = None                     # NOT NULL violation: only this caller fails
    with pytest.raises(Exception, match="(?i)null"):
        store.put_result(bad)
    store.put_result(_result("after-bad"))
    assert store.has_result("after-bad") and not store.has_result("bad")
    assert fresh_reader.has_result("after-bad") and not fresh_reader.has_result("bad")
    assert store.query("SELECT COUNT(*) FROM results")[0][0] == 320 + 1 + callers - 1 + 1


def test_a_batch_is_one_multi_row_insert_and_a_repeated_task_is_written_twice(store, fresh_reader):
    """Rows queued together go in as one INSERT; a task written twice in one batch (the
    second copy starts a new statement) ends with writes = 2 on both back ends."""
    store.enable_group_commit(max_batch=64)
    held, release, batches = _hold_first_batch(store)
    ids = ["m0", "m1", "m0", "m2", "m3"]
    executed: list[str] = []
    real_tx = store._tx

    @contextlib.contextmanager
    def counting_tx():
        with real_tx() as cur:
            yield _CountingCursor(cur, executed)

    gate = threading.Thread(target=store.put_result, args=(_result("gate-m"),))
    gate.start()
    try:
        assert held.wait(30)
        store._tx = counting_tx

        def writer(n: int) -> None:
            time.sleep(0.05 * n)       # queued in this order
            store.put_result(_result(ids[n], worker=f"w{n}"))

        def release_when_queued() -> None:
            try:
                _wait_queued(store, len(ids))
            finally:
                release.set()
        outcomes = _in_threads(writer, len(ids), while_running=release_when_queued)
    finally:
        release.set()
        gate.join(60)
    assert outcomes == [None] * len(ids) and batches[1] == ids
    # the gate's batch alone, then m0 m1 | m0 m2 m3: the repeated m0 starts the second INSERT
    assert [sql.count("), (") + 1 for sql in executed if "INTO results" in sql] == [1, 2, 3]
    rows = dict(fresh_reader.query("SELECT task_id, writes FROM results WHERE task_id LIKE 'm%'"))
    assert rows == {"m0": 2, "m1": 1, "m2": 1, "m3": 1}
    assert fresh_reader.get_result("m0")["worker"] == "w2"      # the later write wins


class _CountingCursor:
    def __init__(self, cur: Any, executed: list[str]) -> None:
        self._cur, self._executed = cur, executed

    def execute(self, sql: str, params: Any = ()) -> Any:
        self._executed.append(sql)
        return self._cur.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


def test_merged_statements_split_where_one_insert_cannot_hold_them():
    from crawld.store.group_commit import MAX_PARAMS, _Pending, merged
    insert = "INSERT INTO t (a, b) VALUES (?, ?) ON CONFLICT (a) DO NOTHING"
    update = "UPDATE t SET b = ? WHERE a = ?"
    batch = [_Pending(insert, (f"k{i}", i)) for i in range(3)] + [_Pending(update, (1, "k0"))] * 2 \
        + [_Pending(insert, ("k9", 9)), _Pending(insert, ("k9", 10))]
    got = list(merged(batch))
    assert got == [("INSERT INTO t (a, b) VALUES (?, ?), (?, ?), (?, ?) ON CONFLICT (a) DO NOTHING",
                    ["k0", 0, "k1", 1, "k2", 2]),
                   (update, (1, "k0")), (update, (1, "k0")),
                   (insert, ("k9", 9)), (insert, ("k9", 10))]
    many = [_Pending(insert, (f"k{i}", i)) for i in range(MAX_PARAMS)]
    sizes = [len(params) // 2 for _, params in merged(many)]
    assert sum(sizes) == MAX_PARAMS and max(sizes) == MAX_PARAMS // 2


# -- quarantine: a suspect's lone runs and the deaths they caused -----------------------------
def test_quarantine_death_counts_each_lone_death_once(store):
    store.quarantine_begin("t", "h:1")
    assert store.quarantined("t")["deaths"] == 0
    assert store.quarantine_death("t", "h:1") == 1
    assert store.quarantine_death("t", "h:1") == 1, "the same death found twice counts once"
    assert store.quarantined("t")["worker"] == ""
    store.quarantine_begin("t", "h:2")                   # alone again: the count stays
    assert (store.quarantined("t")["worker"], store.quarantined("t")["deaths"]) == ("h:2", 1)
    assert store.quarantine_death("t", "h:1") == 1, "an earlier run's worker counts nothing"
    assert store.quarantine_death("t", "h:2") == 2
    store.quarantine_end("t")                            # a run that survived forgets them
    assert store.quarantined("t") is None and store.quarantine_death("t", "h:2") == 0
    store.quarantine_begin("t", "h:3")
    store.quarantine_death("t", "h:3")
    store.reset_delivery_counts(["t"])                   # a replay starts over
    assert store.quarantined("t") is None


OLD_QUARANTINE = ("CREATE TABLE quarantine (task_id TEXT PRIMARY KEY, worker TEXT NOT NULL, "
                  "started_at DOUBLE PRECISION NOT NULL)")


@pytest.fixture(params=["sqlite", "postgresql"])
def old_quarantine_url(request, tmp_path) -> str:
    """A database whose quarantine table an older crawld created (no deaths), one row in it."""
    return older_database(request, tmp_path, OLD_QUARANTINE,
                          "INSERT INTO quarantine (task_id, worker, started_at) VALUES ('old', 'h:1', 1.0)")


def test_older_quarantine_table_gains_deaths_and_keeps_its_rows(old_quarantine_url, tmp_path):
    store = open_store(StoreConfig(url=old_quarantine_url, body_dir=str(tmp_path / "bodies")))
    try:
        assert store.quarantined("old") == {"worker": "h:1", "started_at": 1.0, "deaths": 0}
        assert store.quarantine_death("old", "h:1") == 1
    finally:
        store.close()
    again = open_store(StoreConfig(url=old_quarantine_url, body_dir=str(tmp_path / "bodies")))
    try:                                 # migrating twice is a no-op; the count survived
        run = again.quarantined("old")
        assert (run["worker"], run["deaths"]) == ("", 1)
    finally:
        again.close()
