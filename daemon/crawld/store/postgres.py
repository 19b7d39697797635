"""PostgreSQL back end: psycopg 3 with a small pool, for many hosts on one database."""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Any, Iterator

from crawld.store.base import Store
from crawld.store.schema import (BIGINT_COLUMNS, migrate_added_columns, migrate_postgres_bigint,
                                 postgres_schema)

PG_PERMANENT_ERRORS = ("does not exist", "authentication failed", "no pg_hba.conf entry",
                       "password", "permission denied", "invalid connection option")


class PostgresStore(Store):
    """psycopg 3 with a small pool; the same statements as SQLite.

    Differences from SQLite handled here (the shared SQL stays as it is):

    * Placeholders: ``?`` becomes ``%s`` outside string literals, and a literal ``%``
      (``LIKE '%x%'``) is doubled: psycopg parses every ``%`` of a statement that has
      parameters, and we always pass a (maybe empty) parameter sequence.
    * 64-bit columns: SQLite's INTEGER is 64-bit, PostgreSQL's is 32-bit. A JetStream
      stream sequence (uint64) above 2**31-1 would make every ``put_result`` fail with
      "integer out of range", so ``results.stream_seq`` and ``results.bytes`` are BIGINT
      here, and an existing INTEGER column is migrated on start (``store.schema``).
    * Pooled connections are checked before use: after a PostgreSQL restart (or a
      failover) the pool would otherwise hand out each dead connection once, and every
      one of those store writes would fail and send its task to a retry tier.
    * The first connection is made directly, so a wrong URL / password / database name
      fails with PostgreSQL's own message (instead of a bare pool timeout after 30 s and
      pool warnings on stderr); a server that is merely not reachable yet is retried up
      to ``connect_wait_s``.
    """

    placeholder = "%s"
    BIGINT_COLUMNS = BIGINT_COLUMNS
    SCHEMA_LOCK = 7263521

    def __init__(self, url: str, body_dir: str, pool_size: int = 8,
                 connect_wait_s: float = 30.0) -> None:
        super().__init__(body_dir)
        try:
            import psycopg
            from psycopg_pool import ConnectionPool
        except ImportError as exc:  # pragma: no cover - depends on extras
            raise RuntimeError("store.url is postgresql:// but psycopg / psycopg-pool are not "
                               "installed (pip install 'crawld[postgres]')") from exc
        self._first_connect(psycopg, url, connect_wait_s)
        self.pool = ConnectionPool(url, min_size=1, max_size=max(1, pool_size), open=True,
                                   kwargs={"autocommit": False, "application_name": "crawld"},
                                   check=ConnectionPool.check_connection,
                                   timeout=connect_wait_s, name="crawld-store")

    @staticmethod
    def _first_connect(psycopg: Any, url: str, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        delay = 0.1
        while True:
            try:
                psycopg.connect(url, connect_timeout=max(2, min(10, int(wait_s)))).close()
                return
            except psycopg.OperationalError as exc:
                # The server refused us for good (no such database/role, bad password,
                # pg_hba): waiting will not help. Anything else (refused, timeout, "the
                # database system is starting up", too many clients) may pass: retry.
                # (Connection-phase errors carry no sqlstate, hence the message match.)
                message = " ".join(str(exc).split())
                if any(p in message for p in PG_PERMANENT_ERRORS) or time.monotonic() + delay > deadline:
                    raise RuntimeError(message) from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _sql(self, sql: str) -> str:
        return _pg_placeholders(sql)

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        with self.pool.connection() as conn:
            with conn.transaction():
                with conn.cursor() as cur:
                    yield cur

    def init_schema(self) -> None:
        # Concurrent CREATE IF NOT EXISTS can race on the catalog (two hosts starting
        # together): serialise with a transaction-scoped advisory lock.
        with self._tx() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (self.SCHEMA_LOCK,))
            for stmt in postgres_schema():
                cur.execute(stmt)
            migrate_added_columns(cur, postgres=True)
            migrate_postgres_bigint(cur)

    def close(self) -> None:
        self._close_group()
        self.pool.close()


@functools.lru_cache(maxsize=256)
def _pg_placeholders(sql: str) -> str:
    """``?`` -> ``%s`` outside string literals, literal ``%`` doubled (cached: the same
    few statements run for every task)."""
    out = []
    in_literal = False
    for ch in sql:
        if ch == "'":
            in_literal = not in_literal   # '' inside a literal toggles twice: fine
            out.append(ch)
        elif ch == "%":
            out.append("%%")
        elif ch == "?" and not in_literal:
            out.append("%s")
        else:
            out.append(ch)
    return "".join(out)
