"""Result store: outbox, results, attempts and dead letters, keyed by task id.

Every write that records an outcome is a single upsert keyed by ``task_id``: a
redelivered task overwrites its own row, never adds a second one, and there is no
"mark done first, then work" step that could lose a task between the two.

This module holds the row types and the ``Store`` base with the write/read API;
the back ends (``sqlite``, ``postgres``) supply connections and the placeholder
style. Both run the same SQL.
"""
from __future__ import annotations

import hashlib
import operator
import os
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from crawld.output.digests import hashed
from crawld.store.group_commit import GroupCommit
from crawld.store.ledger import LedgerQueries
from crawld.store.reports import ReportQueries
from crawld.store.schema import SCHEMA, migrate_added_columns
from crawld.task import Task, from_extra


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
    warc_file: str = ""              # WARC file (name in store.warc_dir) holding the page
    warc_offset: int | None = None   # its final response/revisit record's gzip member
    warc_length: int | None = None


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
_RESULT_VALUES = operator.attrgetter(*RESULT_COLUMNS)     # one C call per row, not 20 getattrs
# A dead row's replay count belongs to the replay command: writing a task dead again
# must not reset it.
_DEAD_WRITE_COLUMNS = [c for c in DEAD_COLUMNS if c != "replays"]


def _upsert_sql(table: str, columns: list[str], extra_update: str = "") -> str:
    placeholders = ", ".join("?" for _ in columns)
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c != "task_id")
    return (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({placeholders}) "
            f"ON CONFLICT (task_id) DO UPDATE SET {updates}{extra_update}")


RESULT_UPSERT = _upsert_sql("results", RESULT_COLUMNS, ", writes = results.writes + 1")
DEAD_UPSERT = _upsert_sql("dead", _DEAD_WRITE_COLUMNS)

# ids per ``WHERE task_id IN (...)`` statement: below SQLite's bound-variable limit (999)
_IN_CHUNK = 500
_INSERT_CHUNK = 100     # outbox rows per multi-row INSERT (8 values each, also below 999)
CREATED_STEP_S = 1e-6   # between the created_at of rows added together (a double keeps it at 2**31 s)


def _outbox_values(task: Task, now: float) -> tuple:
    return (task.task_id, task.url, task.round, task.source, now, task.depth, task.parent,
            task.extra())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _create(path: str, parent: str) -> int:
    """A new private file; its directory made only when missing. Opening first: a store
    past its first bodies has every ``ab/cd/`` directory already, and a process that
    remembered the ones it made would still try a mkdir (and a stat) for each of the
    65,536 it has not seen yet, nearly every body of its first hours."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(parent, exist_ok=True)
        return os.open(path, flags, 0o600)


class Store(ReportQueries, LedgerQueries):
    """Common logic; subclasses supply connections and the placeholder style."""

    placeholder = "?"

    def __init__(self, body_dir: str) -> None:
        self.body_dir = Path(body_dir)
        self._group: GroupCommit | None = None
        self._last_created = 0.0
        self._body_root = str(self.body_dir)
        self._tmp_pid = 0                       # the process _tmp_tag was drawn in
        self._tmp_tag = ""

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

    def add_commit_barrier(self, barrier: Any) -> bool:
        """Run ``barrier()`` before every group commit (e.g. fsync the files the rows point
        at). False without group commit: the caller must make its data durable itself."""
        if self._group is None:
            return False
        self._group.barriers.append(barrier)
        return True

    def _exec_many(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        """Run ``sql`` for every row in one transaction; returns the rows changed."""
        with self._tx() as cur:
            cur.executemany(self._sql(sql), list(rows))
            return max(0, cur.rowcount)

    def init_schema(self) -> None:
        with self._tx() as cur:
            for stmt in SCHEMA:
                cur.execute(stmt)
            migrate_added_columns(cur, postgres=False)

    def close(self) -> None:
        self._close_group()

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    # -- bodies -------------------------------------------------------------------
    def save_body(self, body: bytes) -> str:
        """Content-addressed: the file name is the sha256; writing twice is harmless. The
        body goes to a temporary name first, so a crash never leaves a short file under the
        final one. Plain string paths and a temporary name unique to this thread (a tag
        drawn once per process, and the thread id) keep the interpreter's share small."""
        digest = hashed(hashlib.sha256, body).hexdigest()
        parent = self._body_parent(digest)
        path = f"{parent}/{digest}"
        if os.path.exists(path):
            return digest
        tmp = f"{parent}/.tmp-{self._process_tag()}-{threading.get_ident()}"
        try:
            fd = _create(tmp, parent)
            try:
                _write_all(fd, body)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with suppress(Exception):
                os.unlink(tmp)
            raise
        return digest

    def _process_tag(self) -> str:
        """This process's part of a temporary name: its pid and a random draw, made again
        after a fork. The pid alone is not unique where hosts share the body directory (the
        cluster notes' NFS mount; containers all running as pid 7), and a name two writers
        share would put one body's bytes under another's digest."""
        pid = os.getpid()
        if pid != self._tmp_pid:    # threads racing here each draw a tag of this process
            self._tmp_tag, self._tmp_pid = f"{pid}-{os.urandom(6).hex()}", pid
        return self._tmp_tag

    def body_path(self, digest: str) -> Path:
        return Path(self._body_parent(digest), digest)

    def _body_parent(self, digest: str) -> str:
        """The one place the layout is written: ``body_dir/ab/cd/`` for digest ``abcd...``."""
        return f"{self._body_root}/{digest[:2]}/{digest[2:4]}"

    # -- outbox -------------------------------------------------------------------
    def outbox_add(self, tasks: Sequence[Task]) -> int:
        """Insert new tasks; an id already in the outbox is left as it is. Returns new count."""
        return self._exec_many(
            "INSERT INTO outbox (task_id, url, round, source, state, tries, created_at, depth, "
            "parent, extra) VALUES (?, ?, ?, ?, 'new', 0, ?, ?, ?, ?) ON CONFLICT (task_id) DO NOTHING",
            [_outbox_values(t, at) for t, at in zip(tasks, self._creation_times(len(tasks)))])

    def _creation_times(self, n: int) -> list[float]:
        """``created_at`` for ``n`` rows added in this order: now, one microsecond apart and
        after any this store gave before, so the outbox publishes them in the order given
        (a frontier's round-robin over sites stays one; task id order scattered a site's
        pages, and a shard's prefetch window then held none of some sites for seconds)."""
        start = max(time.time(), self._last_created + CREATED_STEP_S)
        self._last_created = start + (n - 1) * CREATED_STEP_S
        return [start + i * CREATED_STEP_S for i in range(n)]

    def outbox_insert(self, tasks: Sequence[Task]) -> None:
        """``outbox_add`` as outcome writes: durable on return, through the group commit
        when it is on (a page's discovered URLs share the fsync of other pages' rows)."""
        times = self._creation_times(len(tasks))
        for i in range(0, len(tasks), _INSERT_CHUNK):
            chunk = tasks[i:i + _INSERT_CHUNK]
            rows = ", ".join("(?, ?, ?, ?, 'new', 0, ?, ?, ?, ?)" for _ in chunk)
            self._write("INSERT INTO outbox (task_id, url, round, source, state, tries, created_at, "
                        f"depth, parent, extra) VALUES {rows} ON CONFLICT (task_id) DO NOTHING",
                        [v for t, at in zip(chunk, times[i:]) for v in _outbox_values(t, at)])

    def outbox_unconfirmed_children(self, parent: str) -> list[Task]:
        """Rows still ``new`` that were inserted for page ``parent`` (the first insert of a
        task id wins, so its ``parent`` says which page publishes it)."""
        rows = self._read("SELECT task_id, url, round, source, depth, parent, extra FROM outbox "
                          "WHERE parent = ? AND state = 'new'", (parent,))
        return [Task(task_id=r[0], url=r[1], round=r[2], source=r[3], enqueued_at=time.time(),
                     depth=r[4], parent=r[5], **from_extra(r[6])) for r in rows]

    def outbox_count(self, state: str | None = None) -> int:
        if state is None:
            return self._read("SELECT COUNT(*) FROM outbox")[0][0]
        return self._read("SELECT COUNT(*) FROM outbox WHERE state = ?", (state,))[0][0]

    def outbox_unconfirmed(self, limit: int = 1_000_000) -> list[Task]:
        """The first ``limit`` rows still ``new``, in the order they were added."""
        return next(self.outbox_unconfirmed_pages(limit), [])

    def outbox_unconfirmed_pages(self, size: int) -> Iterator[list[Task]]:
        """Rows still ``new`` in the order they were added, ``size`` at a time (keyset
        paging on the index over state, created_at, task_id)."""
        after: tuple[float, str] = (-1.0, "")
        while rows := self._read(
                "SELECT task_id, url, round, source, depth, parent, extra, created_at FROM outbox "
                "WHERE state = 'new' AND (created_at, task_id) > (?, ?) "
                "ORDER BY created_at, task_id LIMIT ?", (*after, size)):
            after = (rows[-1][7], rows[-1][0])
            yield [Task(task_id=r[0], url=r[1], round=r[2], source=r[3], enqueued_at=time.time(),
                        depth=r[4], parent=r[5], **from_extra(r[6])) for r in rows]

    def outbox_mark_confirmed(self, task_ids: Sequence[str]) -> None:
        now = time.time()
        self._exec_many("UPDATE outbox SET state = 'confirmed', confirmed_at = ?, tries = tries + 1, "
                        "last_error = '' WHERE task_id = ?", [(now, tid) for tid in task_ids])

    def outbox_mark_failed(self, failures: dict[str, str]) -> None:
        self._exec_many("UPDATE outbox SET tries = tries + 1, last_error = ? WHERE task_id = ?",
                        [(reason, tid) for tid, reason in failures.items()])

    # -- hooks --------------------------------------------------------------------
    def hooks_done(self, task_id: str) -> bool:
        return bool(self._read("SELECT 1 FROM hooks_done WHERE task_id = ?", (task_id,)))

    def put_hooks_done(self, task_id: str, links: int) -> None:
        """After the hooks returned and the URLs they found are confirmed. Only a hint for a
        redelivery (skip the hooks), so it does not wait for its commit: lost in a crash,
        the redelivered page runs its hooks again, and finds its URLs already confirmed."""
        sql = ("INSERT INTO hooks_done (task_id, links, done_at) VALUES (?, ?, ?) "
               "ON CONFLICT (task_id) DO UPDATE SET links = excluded.links, done_at = excluded.done_at")
        params = (task_id, links, time.time())
        if self._group is not None:
            self._group.post(self._sql(sql), params)
        else:
            self._exec(sql, params)

    # -- outcomes -----------------------------------------------------------------
    def has_result(self, task_id: str) -> bool:
        return bool(self._read("SELECT 1 FROM results WHERE task_id = ?", (task_id,)))

    def put_result(self, row: ResultRow) -> None:
        self._write(RESULT_UPSERT, _RESULT_VALUES(row))

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
        self._write(DEAD_UPSERT, [getattr(row, c) for c in _DEAD_WRITE_COLUMNS])

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
        self.reset_delivery_counts(task_ids)

    def dead_since(self, since: float) -> int:
        return self._read("SELECT COUNT(*) FROM dead WHERE dead_at >= ?", (since,))[0][0]

    def _select_in(self, base_sql: str, task_ids: Sequence[str]) -> list[tuple]:
        out: list[tuple] = []
        ids = list(task_ids)
        for i in range(0, len(ids), _IN_CHUNK):
            chunk = ids[i:i + _IN_CHUNK]
            marks = ", ".join("?" for _ in chunk)
            out.extend(self._read(f"{base_sql} WHERE task_id IN ({marks})", chunk))
        return out

