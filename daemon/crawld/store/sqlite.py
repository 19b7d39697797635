"""SQLite back end: WAL, one connection per thread, safe across processes."""
from __future__ import annotations

import os
import sqlite3
import threading
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator, Sequence

from crawld.store.base import Store


class SQLiteStore(Store):
    """One connection per thread; WAL lets readers run beside the single writer."""

    def __init__(self, path: str | os.PathLike, body_dir: str, lock_wait_s: float = 60.0) -> None:
        super().__init__(body_dir)
        self.path = str(path)
        # Past this wait for another process's write lock, "database is locked" is raised:
        # a worker fault (pipeline/faults.py), so the worker pauses instead of blocking on.
        self.lock_wait_s = lock_wait_s
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=self.lock_wait_s, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a stored result survives power loss before we ack it.
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute(f"PRAGMA busy_timeout={int(self.lock_wait_s * 1000)}")
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        # Autocommit SELECT: WAL gives it a consistent snapshot without BEGIN IMMEDIATE,
        # so reads (has_result on every delivery) never queue behind a commit's fsync.
        cur = self._conn().execute(sql, params)
        try:
            return cur.fetchall()
        finally:
            cur.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Cursor]:
        conn = self._conn()
        cur = conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        else:
            conn.execute("COMMIT")
        finally:
            cur.close()

    def close(self) -> None:
        self._close_group()
        with self._lock:
            for conn in self._all:
                with suppress(Exception):
                    conn.close()
            self._all.clear()
        self._local = threading.local()
