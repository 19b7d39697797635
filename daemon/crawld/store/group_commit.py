"""Group commit: many threads' outcome writes share one transaction and one fsync."""
from __future__ import annotations

import queue
import threading
from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol, Sequence


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
        self.queue: queue.Queue[_Pending | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self.thread.start()

    def submit(self, sql: str, params: Sequence[Any]) -> None:
        """Returns once the statement is committed; raises the error it alone caused."""
        pending = _Pending(sql, params)
        self.queue.put(pending)
        pending.done.wait()
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
                item.done.set()
            return
        try:
            with self.store._tx() as cur:
                for item in batch:
                    cur.execute(item.sql, item.params)
        except Exception:
            for item in batch:
                try:
                    with self.store._tx() as cur:
                        cur.execute(item.sql, item.params)
                except Exception as exc:
                    item.error = exc
        for item in batch:
            item.done.set()


class _Pending:
    __slots__ = ("sql", "params", "done", "error")

    def __init__(self, sql: str, params: Sequence[Any]) -> None:
        self.sql = sql
        self.params = params
        self.done = threading.Event()
        self.error: BaseException | None = None
