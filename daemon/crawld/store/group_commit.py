"""Group commit: many threads' outcome writes share one transaction and one fsync."""
from __future__ import annotations

import functools
import queue
import re
import threading
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator, Protocol, Sequence

# The one row of an ``INSERT ... VALUES (?, ?, ...)`` (SQLite ``?``, psycopg ``%s``).
_ONE_ROW = re.compile(r"VALUES\s*(\((?:\s*(?:\?|%s)\s*,)*\s*(?:\?|%s)\s*\))")
MAX_PARAMS = 999        # per statement: SQLite's bound-variable limit before 3.32


class _Transactional(Protocol):
    def _tx(self) -> AbstractContextManager[Any]: ...


class GroupCommit:
    """One writer thread commits the queued statements of many threads together.

    If a batch fails, each statement is retried in its own transaction so one bad
    row cannot fail its neighbours; the caller sees only its own error.
    """

    def __init__(self, store: _Transactional, max_batch: int) -> None:
        self.store = store
        self.max_batch = max_batch
        # Runs before each batch's transaction, on the commit thread: makes what the rows
        # point at durable first (the WARC fsync). Raising fails the whole batch.
        self.barriers: list[Callable[[], None]] = []
        # SimpleQueue: put and get are C calls (queue.Queue runs a Condition in Python).
        self.queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self.thread.start()

    def submit(self, sql: str, params: Sequence[Any]) -> None:
        """Returns once the statement is committed; raises the error it alone caused."""
        pending = _Pending(sql, params, waited=True)
        self.queue.put(pending)
        pending.done.acquire()      # released by the commit thread
        if pending.error is not None:
            raise pending.error

    def post(self, sql: str, params: Sequence[Any]) -> None:
        """Queue the statement with the next batch and return at once (for writes whose
        loss in a crash costs only repeated work, never an outcome)."""
        self.queue.put(_Pending(sql, params))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(10)

    def _run(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.queue.put(None)      # finish this batch, then stop
                    break
                batch.append(item)
            self._commit(batch)

    def _commit(self, batch: list[_Pending]) -> None:
        try:
            for barrier in self.barriers:
                barrier()
        except Exception as exc:
            for item in batch:
                item.error = exc
                item.finish()
            return
        try:
            with self.store._tx() as cur:
                for sql, params in merged(batch):
                    cur.execute(sql, params)
        except Exception:
            for item in batch:
                try:
                    with self.store._tx() as cur:
                        cur.execute(item.sql, item.params)
                except Exception as exc:
                    item.error = exc
        for item in batch:
            item.finish()


class _Pending:
    """One statement; ``done`` is a bare lock held until the commit thread releases it:
    a third of what a threading.Event costs to make, wait on and set, once per row."""
    __slots__ = ("sql", "params", "done", "error")

    def __init__(self, sql: str, params: Sequence[Any], waited: bool = False) -> None:
        self.sql = sql
        self.params = params
        self.done: Any = None
        if waited:
            self.done = threading.Lock()
            self.done.acquire()
        self.error: BaseException | None = None

    def finish(self) -> None:
        if self.done is not None:
            self.done.release()


def merged(batch: Sequence[_Pending]) -> Iterator[tuple[str, Sequence[Any]]]:
    """The batch's statements, runs of one single-row INSERT as one multi-row INSERT.

    Each statement gives up the GIL for its step, and with the pool's threads waiting for
    it the commit thread then waits to get it back: one step for a run of rows instead of
    one per row. A run stops at a repeated first value (the task id the upserts conflict
    on: PostgreSQL refuses to update one row twice in one statement) and at MAX_PARAMS.
    """
    run: list[_Pending] = []
    keys: set[Any] = set()      # the run's first values: a repeat ends it
    for item in batch:
        if run and not _joins(run, keys, item):
            yield _statement(run)
            run, keys = [], set()
        run.append(item)
        if item.params and _row_of(item.sql) is not None:
            keys.add(item.params[0])
    if run:
        yield _statement(run)


def _joins(run: list[_Pending], keys: set[Any], item: _Pending) -> bool:
    first = run[0]
    return (item.sql == first.sql and _row_of(item.sql) is not None
            and (len(run) + 1) * len(item.params) <= MAX_PARAMS
            and item.params[0] not in keys)


def _statement(run: list[_Pending]) -> tuple[str, Sequence[Any]]:
    if len(run) == 1:
        return run[0].sql, run[0].params
    return _rows_sql(run[0].sql, len(run)), [p for item in run for p in item.params]


@functools.lru_cache(maxsize=64)
def _row_of(sql: str) -> re.Match[str] | None:
    return _ONE_ROW.search(sql) if sql.lstrip()[:6].upper() == "INSERT" else None


@functools.lru_cache(maxsize=256)
def _rows_sql(sql: str, rows: int) -> str:
    match = _row_of(sql)
    assert match is not None
    start, end = match.span(1)
    return sql[:start] + ", ".join([match.group(1)] * rows) + sql[end:]
