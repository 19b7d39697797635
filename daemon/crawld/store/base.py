"""Result store: outbox, results, attempts and dead letters, keyed by task id.

Every write that records an outcome is a single upsert keyed by ``task_id``: a
redelivered task overwrites its own row, never adds a second one, and there is no
"mark done first, then work" step that could lose a task between the two.

SQLite (WAL, one connection per thread, safe across processes) is the default;
PostgreSQL (psycopg 3 with a pool) serves many hosts. Both run the same SQL, only
the placeholder style differs.
"""
from __future__ import annotations

import functools
import hashlib
import os
import queue
import sqlite3
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from crawld.config import StoreConfig, sqlite_path
from crawld.task import Task

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS outbox (
        task_id TEXT PRIMARY KEY, url TEXT NOT NULL, round TEXT NOT NULL, source TEXT NOT NULL,
        state TEXT NOT NULL DEFAULT 'new', tries INTEGER NOT NULL DEFAULT 0,
        created_at DOUBLE PRECISION NOT NULL, confirmed_at DOUBLE PRECISION,
        last_error TEXT NOT NULL DEFAULT '')""",
    """CREATE TABLE IF NOT EXISTS results (
        task_id TEXT PRIMARY KEY, url TEXT NOT NULL, final_url TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL, http_status INTEGER, reason TEXT NOT NULL DEFAULT '',
        content_type TEXT NOT NULL DEFAULT '', bytes INTEGER NOT NULL DEFAULT 0,
        body_sha256 TEXT NOT NULL DEFAULT '', attempts INTEGER NOT NULL DEFAULT 1,
        fetched_at DOUBLE PRECISION NOT NULL, worker TEXT NOT NULL DEFAULT '',
        round TEXT NOT NULL DEFAULT '', source TEXT NOT NULL DEFAULT '',
        redirects INTEGER NOT NULL DEFAULT 0, enqueued_at DOUBLE PRECISION NOT NULL DEFAULT 0,
        stream_seq INTEGER, writes INTEGER NOT NULL DEFAULT 1)""",
    """CREATE TABLE IF NOT EXISTS attempts (
        task_id TEXT NOT NULL, attempt INTEGER NOT NULL, url TEXT NOT NULL,
        error TEXT NOT NULL, http_status INTEGER, delay_s DOUBLE PRECISION NOT NULL DEFAULT 0,
        worker TEXT NOT NULL DEFAULT '', at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (task_id, attempt))""",
    """CREATE TABLE IF NOT EXISTS dead (
        task_id TEXT PRIMARY KEY, url TEXT NOT NULL, reason TEXT NOT NULL, error TEXT NOT NULL,
        attempts INTEGER NOT NULL, origin TEXT NOT NULL, dead_at DOUBLE PRECISION NOT NULL,
        body TEXT NOT NULL DEFAULT '', round TEXT NOT NULL DEFAULT '',
        source TEXT NOT NULL DEFAULT '', replays INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS redeliveries (
        task_id TEXT PRIMARY KEY, count INTEGER NOT NULL, last_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS outbox_state ON outbox (state)",
    "CREATE INDEX IF NOT EXISTS dead_at ON dead (dead_at)",
    "CREATE INDEX IF NOT EXISTS results_fetched ON results (fetched_at)",
]


@dataclass
class ResultRow:
    task_id: str
    url: str
    final_url: str
    status: str            # fetched | redirected | http_error | skipped
    http_status: int | None
    reason: str
    content_type: str
    bytes: int
    body_sha256: str
    attempts: int
    fetched_at: float
    worker: str
    round: str = ""
    source: str = ""
    redirects: int = 0
    enqueued_at: float = 0.0
    stream_seq: int | None = None


@dataclass
class DeadRow:
    task_id: str
    url: str
    reason: str
    error: str
    attempts: int
    origin: str
    dead_at: float
    body: str = ""          # the original message body (for malformed ones: as text)
    round: str = ""
    source: str = ""
    replays: int = 0


RESULT_COLUMNS = [f.name for f in fields(ResultRow)]
DEAD_COLUMNS = [f.name for f in fields(DeadRow)]


def _upsert_sql(table: str, columns: list[str], extra_update: str = "") -> str:
    placeholders = ", ".join("?" for _ in columns)
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c != "task_id")
    return (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({placeholders}) "
            f"ON CONFLICT (task_id) DO UPDATE SET {updates}{extra_update}")


RESULT_UPSERT = _upsert_sql("results", RESULT_COLUMNS, ", writes = results.writes + 1")
DEAD_UPSERT = _upsert_sql("dead", [c for c in DEAD_COLUMNS if c != "replays"])


class Store:
    """Common logic; subclasses supply connections and the placeholder style."""

    placeholder = "?"

    def __init__(self, body_dir: str) -> None:
        self.body_dir = Path(body_dir)
        self._group: GroupCommit | None = None
        self._body_dirs: set[Path] = set()      # created already: skip the mkdir syscalls

    # -- plumbing -----------------------------------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[Any]:
        raise NotImplementedError

    def _sql(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    def _exec(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._tx() as cur:
            cur.execute(self._sql(sql), params)
            return cur.fetchall() if cur.description else []

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """A read-only statement (SQLite overrides it to skip the write lock)."""
        return self._exec(sql, params)

    def _write(self, sql: str, params: Sequence[Any]) -> None:
        """An outcome write: durable when this returns (through the group committer if on)."""
        if self._group is not None:
            self._group.submit(self._sql(sql), params)
        else:
            self._exec(sql, params)

    def enable_group_commit(self, max_batch: int = 256) -> None:
        """Many threads' outcome writes share one transaction and one fsync. Each caller
        still returns only after its own row is committed, so ack-after-store holds."""
        if self._group is None:
            self._group = GroupCommit(self, max_batch)

    def _exec_many(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        """Run ``sql`` for every row in one transaction; returns the rows changed."""
        with self._tx() as cur:
            cur.executemany(self._sql(sql), list(rows))
            return max(0, cur.rowcount)

    def init_schema(self) -> None:
        with self._tx() as cur:
            for stmt in SCHEMA:
                cur.execute(stmt)

    def close(self) -> None:
        self._close_group()

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    # -- bodies -------------------------------------------------------------------
    def save_body(self, body: bytes) -> str:
        """Content-addressed: the file name is the sha256; writing twice is harmless."""
        digest = hashlib.sha256(body).hexdigest()
        path = self.body_path(digest)
        if path.exists():
            return digest
        if path.parent not in self._body_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._body_dirs.add(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(body)
            os.replace(tmp, path)
        except BaseException:
            with _suppress():
                os.unlink(tmp)
            raise
        return digest

    def body_path(self, digest: str) -> Path:
        return self.body_dir / digest[:2] / digest[2:4] / digest

    # -- outbox -------------------------------------------------------------------
    def outbox_add(self, tasks: Sequence[Task]) -> int:
        """Insert new tasks; an id already in the outbox is left as it is. Returns new count."""
        now = time.time()
        return self._exec_many(
            "INSERT INTO outbox (task_id, url, round, source, state, tries, created_at) "
            "VALUES (?, ?, ?, ?, 'new', 0, ?) ON CONFLICT (task_id) DO NOTHING",
            [(t.task_id, t.url, t.round, t.source, now) for t in tasks])

    def outbox_count(self, state: str | None = None) -> int:
        if state is None:
            return self._read("SELECT COUNT(*) FROM outbox")[0][0]
        return self._read("SELECT COUNT(*) FROM outbox WHERE state = ?", (state,))[0][0]

    def outbox_unconfirmed(self, limit: int = 1_000_000, after: str = "") -> list[Task]:
        """Rows still ``new``, in task id order after ``after`` (keyset paging)."""
        rows = self._read(
            "SELECT task_id, url, round, source, created_at FROM outbox WHERE state = 'new' "
            "AND task_id > ? ORDER BY task_id LIMIT ?", (after, limit))
        return [Task(task_id=r[0], url=r[1], round=r[2], source=r[3], enqueued_at=time.time())
                for r in rows]

    def outbox_mark_confirmed(self, task_ids: Sequence[str]) -> None:
        now = time.time()
        self._exec_many("UPDATE outbox SET state = 'confirmed', confirmed_at = ?, tries = tries + 1, "
                        "last_error = '' WHERE task_id = ?", [(now, tid) for tid in task_ids])

    def outbox_mark_failed(self, failures: dict[str, str]) -> None:
        self._exec_many("UPDATE outbox SET tries = tries + 1, last_error = ? WHERE task_id = ?",
                        [(reason, tid) for tid, reason in failures.items()])

    def outbox_get(self, task_ids: Sequence[str]) -> list[Task]:
        return [Task(task_id=r[0], url=r[1], round=r[2], source=r[3], enqueued_at=time.time())
                for r in self._select_in("SELECT task_id, url, round, source FROM outbox", task_ids)]

    # -- outcomes -----------------------------------------------------------------
    def has_result(self, task_id: str) -> bool:
        return bool(self._read("SELECT 1 FROM results WHERE task_id = ?", (task_id,)))

    def put_result(self, row: ResultRow) -> None:
        self._write(RESULT_UPSERT, [getattr(row, c) for c in RESULT_COLUMNS])

    def get_result(self, task_id: str) -> dict[str, Any] | None:
        rows = self._read(f"SELECT {', '.join(RESULT_COLUMNS)}, writes FROM results WHERE task_id = ?",
                          (task_id,))
        return dict(zip(RESULT_COLUMNS + ["writes"], rows[0])) if rows else None

    def put_attempt(self, task_id: str, attempt: int, url: str, error: str,
                    http_status: int | None, delay_s: float, worker: str) -> None:
        self._exec("INSERT INTO attempts (task_id, attempt, url, error, http_status, delay_s, worker, at) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (task_id, attempt) DO UPDATE SET "
                   "error = excluded.error, http_status = excluded.http_status, "
                   "delay_s = excluded.delay_s, worker = excluded.worker, at = excluded.at",
                   (task_id, attempt, url, error, http_status, delay_s, worker, time.time()))

    def put_dead(self, row: DeadRow) -> None:
        cols = [c for c in DEAD_COLUMNS if c != "replays"]
        self._write(DEAD_UPSERT, [getattr(row, c) for c in cols])

    def bump_redelivery(self, task_id: str, delta: int = 1) -> int:
        """Count crash redeliveries of one task (classic AMQP queues keep no counter).

        A delivery we give back on purpose (drain) is pre-paid with ``delta=-1``.
        """
        rows = self._exec(
            "INSERT INTO redeliveries (task_id, count, last_at) VALUES (?, ?, ?) "
            "ON CONFLICT (task_id) DO UPDATE SET count = redeliveries.count + excluded.count, "
            "last_at = excluded.last_at RETURNING count", (task_id, delta, time.time()))
        return int(rows[0][0])

    # -- dead letters -------------------------------------------------------------
    def list_dead(self, limit: int = 100, task_ids: Sequence[str] | None = None) -> list[DeadRow]:
        cols = ", ".join(DEAD_COLUMNS)
        if task_ids is not None:
            rows = self._select_in(f"SELECT {cols} FROM dead", task_ids)
        else:
            rows = self._read(f"SELECT {cols} FROM dead ORDER BY dead_at DESC LIMIT ?", (limit,))
        return [DeadRow(*r) for r in rows]

    def remove_dead(self, task_ids: Sequence[str]) -> None:
        """After a replay is confirmed: the task is live again, no longer dead."""
        self._exec_many("DELETE FROM dead WHERE task_id = ?", [(t,) for t in task_ids])
        self._exec_many("DELETE FROM redeliveries WHERE task_id = ?", [(t,) for t in task_ids])

    def dead_since(self, since: float) -> int:
        return self._read("SELECT COUNT(*) FROM dead WHERE dead_at >= ?", (since,))[0][0]

    # -- reporting ----------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        row = self._read(
            "SELECT (SELECT COUNT(*) FROM outbox), "
            "(SELECT COUNT(*) FROM outbox WHERE state = 'confirmed'), "
            "(SELECT COUNT(*) FROM outbox WHERE state = 'new'), "
            "(SELECT COUNT(*) FROM results), (SELECT COUNT(*) FROM dead), "
            "(SELECT COUNT(*) FROM attempts), "
            "(SELECT COALESCE(SUM(writes - 1), 0) FROM results)")[0]
        keys = ["outbox", "confirmed", "unconfirmed", "done", "dead", "retried_attempts",
                "duplicate_writes"]
        return {k: int(v) for k, v in zip(keys, row)}

    def result_status_counts(self) -> dict[str, int]:
        return {r[0]: int(r[1]) for r in self._read("SELECT status, COUNT(*) FROM results GROUP BY status")}

    def lost(self, grace_s: float) -> list[str]:
        """Confirmed in the outbox longer than ``grace_s`` ago, yet neither stored nor dead."""
        cutoff = time.time() - grace_s
        rows = self._read(
            "SELECT o.task_id FROM outbox o WHERE o.state = 'confirmed' AND o.confirmed_at <= ? "
            "AND NOT EXISTS (SELECT 1 FROM results r WHERE r.task_id = o.task_id) "
            "AND NOT EXISTS (SELECT 1 FROM dead d WHERE d.task_id = o.task_id) "
            "ORDER BY o.task_id", (cutoff,))
        return [r[0] for r in rows]

    def pending_confirmed(self) -> int:
        """Confirmed tasks not yet in results or dead (in the broker or in flight)."""
        return self._read(
            "SELECT COUNT(*) FROM outbox o WHERE o.state = 'confirmed' "
            "AND NOT EXISTS (SELECT 1 FROM results r WHERE r.task_id = o.task_id) "
            "AND NOT EXISTS (SELECT 1 FROM dead d WHERE d.task_id = o.task_id)")[0][0]

    def latency_percentiles(self, limit: int = 10000) -> dict[str, float | None]:
        """End-to-end seconds from enqueued_at to stored, over the latest results."""
        rows = self._read("SELECT fetched_at - enqueued_at FROM results WHERE enqueued_at > 0 "
                          "ORDER BY fetched_at DESC LIMIT ?", (limit,))
        values = sorted(float(r[0]) for r in rows)
        if not values:
            return {"p50": None, "p95": None}
        return {"p50": values[int(0.50 * (len(values) - 1))], "p95": values[int(0.95 * (len(values) - 1))]}

    def oldest_unfinished_age(self) -> float | None:
        rows = self._read(
            "SELECT MIN(o.confirmed_at) FROM outbox o WHERE o.state = 'confirmed' "
            "AND NOT EXISTS (SELECT 1 FROM results r WHERE r.task_id = o.task_id) "
            "AND NOT EXISTS (SELECT 1 FROM dead d WHERE d.task_id = o.task_id)")
        return None if not rows or rows[0][0] is None else time.time() - float(rows[0][0])

    def attempts_for(self, task_id: str) -> list[dict[str, Any]]:
        rows = self._read("SELECT attempt, error, http_status, delay_s, worker, at FROM attempts "
                          "WHERE task_id = ? ORDER BY attempt", (task_id,))
        return [dict(zip(["attempt", "error", "http_status", "delay_s", "worker", "at"], r)) for r in rows]

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Read-only helper for reports and tests."""
        return self._read(sql, params)

    def _select_in(self, base_sql: str, task_ids: Sequence[str]) -> list[tuple]:
        out: list[tuple] = []
        ids = list(task_ids)
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            marks = ", ".join("?" for _ in chunk)
            out.extend(self._read(f"{base_sql} WHERE task_id IN ({marks})", chunk))
        return out


class SQLiteStore(Store):
    """One connection per thread; WAL lets readers run beside the single writer."""

    def __init__(self, path: str | os.PathLike, body_dir: str) -> None:
        super().__init__(body_dir)
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a stored result survives power loss before we ack it.
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA busy_timeout=60000")
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
                with _suppress():
                    conn.close()
            self._all.clear()
        self._local = threading.local()


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
      here, and an existing INTEGER column is migrated on start.
    * Pooled connections are checked before use: after a PostgreSQL restart (or a
      failover) the pool would otherwise hand out each dead connection once, and every
      one of those store writes would fail and send its task to a retry tier.
    * The first connection is made directly, so a wrong URL / password / database name
      fails with PostgreSQL's own message (instead of a bare pool timeout after 30 s and
      pool warnings on stderr); a server that is merely not reachable yet is retried up
      to ``connect_wait_s``.
    """

    placeholder = "%s"
    BIGINT_COLUMNS = {"results": ("stream_seq", "bytes")}
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
            for stmt in SCHEMA:
                for table, columns in self.BIGINT_COLUMNS.items():
                    if f"TABLE IF NOT EXISTS {table} " in stmt:
                        for col in columns:
                            stmt = stmt.replace(f"{col} INTEGER", f"{col} BIGINT")
                cur.execute(stmt)
            for table, columns in self.BIGINT_COLUMNS.items():
                cur.execute("SELECT column_name FROM information_schema.columns "
                            "WHERE table_schema = current_schema() AND table_name = %s "
                            "AND data_type = 'integer' AND column_name = ANY(%s)",
                            (table, list(columns)))
                for (col,) in cur.fetchall():
                    cur.execute(f"ALTER TABLE {table} ALTER COLUMN {col} TYPE BIGINT")

    def close(self) -> None:
        self._close_group()
        self.pool.close()


class GroupCommit:
    """One writer thread commits the queued statements of many threads together.

    If a batch fails, each statement is retried in its own transaction so one bad
    row cannot fail its neighbours; the caller sees only its own error.
    """

    def __init__(self, store: Store, max_batch: int) -> None:
        self.store = store
        self.max_batch = max_batch
        self.queue: queue.Queue[_Pending | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self.thread.start()

    def submit(self, sql: str, params: Sequence[Any]) -> None:
        pending = _Pending(sql, params)
        self.queue.put(pending)
        pending.done.wait()
        if pending.error is not None:
            raise pending.error

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

    def _commit(self, batch: list["_Pending"]) -> None:
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


def open_store(cfg: StoreConfig, pool_size: int = 8) -> Store:
    if cfg.url.startswith("sqlite:"):
        store: Store = SQLiteStore(sqlite_path(cfg.url), cfg.body_dir)
    else:
        store = PostgresStore(cfg.url, cfg.body_dir, pool_size=pool_size)
    store.init_schema()
    return store


@contextmanager
def _suppress() -> Iterator[None]:
    try:
        yield
    except Exception:
        pass


def result_row_dict(row: ResultRow) -> dict[str, Any]:
    return asdict(row)
