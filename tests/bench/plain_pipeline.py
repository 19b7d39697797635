"""The same work as one crawld worker, written plainly: the reference crawld is measured against.

    plain_pipeline.py amqp URL QUEUE DB BODY_DIR --expect N [--threads 16] [--prefetch 16]
    plain_pipeline.py jetstream URL STREAM DURABLE DB BODY_DIR --expect N [--threads 16] [--prefetch 16]

Per task, exactly what issue 17 lists and nothing more (no retries, classification, dead
letters, metrics, heartbeats, politeness or SSRF guard):

1. a delivery (pika ``BlockingConnection`` consumer with prefetch = threads, or a nats-py
   JetStream pull ``fetch`` keeping at most ``prefetch`` messages unacked);
2. on a ``ThreadPoolExecutor`` thread: a robots.txt check (protego, fetched and parsed once
   per origin), a urllib3 ``PoolManager`` GET, the body written once to a file named by its
   sha256 (BODY_DIR ``-``: its sha256 only, no file);
3. one writer thread commits the rows in batches to SQLite (WAL, ``synchronous=FULL``);
4. only after the commit, the ack: through ``add_callback_threadsafe`` (pika) or the event
   loop (nats-py).

``run_amqp`` / ``run_jetstream`` are callable in process; the CLI runs one in a subprocess
and prints one JSON line: pages, seconds (first delivery to last commit) and the process
CPU (user + system, start-up included). With ``--wait-go`` it prints ``{"ready": true}``
after connecting and waits for a line on stdin (benchlib.start_json / go). Bounded by
``--expect`` and ``--max-seconds``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import queue
import resource
import sqlite3
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import urllib3
from protego import Protego

USER_AGENT = "plain-pipeline/1.0"
SCHEMA = """CREATE TABLE IF NOT EXISTS results (
    task_id TEXT PRIMARY KEY, url TEXT NOT NULL, final_url TEXT, status TEXT NOT NULL,
    http_status INTEGER, content_type TEXT, bytes INTEGER, body_sha256 TEXT,
    fetched_at REAL NOT NULL, worker TEXT)"""
UPSERT = """INSERT INTO results (task_id, url, final_url, status, http_status, content_type, bytes,
    body_sha256, fetched_at, worker) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT(task_id) DO UPDATE SET final_url=excluded.final_url, status=excluded.status,
    http_status=excluded.http_status, content_type=excluded.content_type, bytes=excluded.bytes,
    body_sha256=excluded.body_sha256, fetched_at=excluded.fetched_at, worker=excluded.worker"""
Row = tuple


# -- the work -------------------------------------------------------------------------------
class Robots:
    """robots.txt per origin, fetched and parsed once (a lock per origin: one download)."""

    def __init__(self, http: urllib3.PoolManager) -> None:
        self.http = http
        self.parsed: dict[str, Protego] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.guard = threading.Lock()

    def allowed(self, url: str) -> bool:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        rules = self.parsed.get(origin)
        if rules is None:
            rules = self._load(origin)
        return rules.can_fetch(url, USER_AGENT)

    def _load(self, origin: str) -> Protego:
        with self.guard:
            lock = self.locks.setdefault(origin, threading.Lock())
        with lock:
            if origin not in self.parsed:
                resp = self.http.request("GET", origin + "/robots.txt", retries=False, timeout=10)
                # RFC 9309: 4xx means no rules; anything else unreadable means disallow all.
                text = resp.data.decode("utf-8", "replace") if resp.status == 200 else ""
                if resp.status >= 500:
                    text = "User-agent: *\nDisallow: /\n"
                self.parsed[origin] = Protego.parse(text)
        return self.parsed[origin]


class Bodies:
    """Content-addressed body files: ``dir/ab/<sha256>``, written once (tmp + rename)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.made: set[str] = set()

    def save(self, body: bytes) -> str:
        digest = hashlib.sha256(body).hexdigest()
        sub = self.dir / digest[:2]
        if digest[:2] not in self.made:
            sub.mkdir(parents=True, exist_ok=True)
            self.made.add(digest[:2])
        path = sub / digest
        if not path.exists():
            tmp = sub / f".{digest}.{threading.get_ident()}"
            with open(tmp, "wb") as fh:
                fh.write(body)
            os.replace(tmp, path)
        return digest


class HashOnly:
    """BODY_DIR "-": the body's sha256 and no file, the least any pipeline does with a body
    (bench_frameworks.py's bound for a Celery task that keeps its bodies in the row)."""

    def save(self, body: bytes) -> str:
        return hashlib.sha256(body).hexdigest()


@dataclass
class Work:
    """Robots + GET + body file for one message: the part that runs on a pool thread."""
    http: urllib3.PoolManager
    robots: Robots
    bodies: Bodies | HashOnly
    worker: str = f"plain:{os.getpid()}"

    def __call__(self, body: bytes, message_id: str | None = None) -> Row:
        msg = json.loads(body)
        url = msg["url"]
        task_id = msg.get("task_id") or message_id or hashlib.sha256(url.encode()).hexdigest()[:32]
        if not self.robots.allowed(url):
            return (task_id, url, url, "skipped", None, "", 0, "", time.time(), self.worker)
        resp = self.http.request("GET", url, retries=False, timeout=20, preload_content=True)
        digest = self.bodies.save(resp.data) if resp.data else ""
        status = "fetched" if resp.status < 400 else "http_error"
        return (task_id, url, url, status, resp.status, resp.headers.get("content-type", ""),
                len(resp.data), digest, time.time(), self.worker)


def make_work(body_dir: str | os.PathLike, threads: int) -> Work:
    http = urllib3.PoolManager(maxsize=threads, block=False, headers={"User-Agent": USER_AGENT})
    return Work(http, Robots(http), HashOnly() if str(body_dir) == "-" else Bodies(body_dir))


# -- the store: one writer thread, batched commits, acks after the commit -------------------------
@dataclass
class Writer:
    """Rows in, batches committed, then each batch's ``ack`` called (after the commit)."""
    db: str
    max_batch: int = 256
    inbox: "queue.Queue[tuple[Row, Callable[[], None]] | None]" = field(default_factory=queue.Queue)
    stored: int = 0
    first: float | None = None
    last: float | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="writer", daemon=True)

    def start(self) -> None:
        conn = self._connect()
        conn.execute(SCHEMA)
        conn.close()
        self.thread.start()

    def put(self, row: Row, ack: Callable[[], None]) -> None:
        self.inbox.put((row, ack))

    def stop(self, timeout: float = 10) -> None:
        self.inbox.put(None)
        self.thread.join(timeout)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")     # durable before the ack, as crawld
        return conn

    def _loop(self) -> None:
        conn = self._connect()
        while True:
            item = self.inbox.get()
            if item is None:
                break
            batch = [item]
            while len(batch) < self.max_batch:      # whatever else is waiting: one commit
                try:
                    nxt = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.inbox.put(None)
                    break
                batch.append(nxt)
            try:
                self._commit(conn, batch)
            except sqlite3.Error as exc:            # no ack: the broker redelivers them later
                failed(exc)
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
        conn.close()

    def _commit(self, conn: sqlite3.Connection, batch: list[tuple[Row, Callable[[], None]]]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(UPSERT, [row for row, _ in batch])
        conn.execute("COMMIT")
        now = time.time()
        self.first = self.first or now
        self.last = now
        self.stored += len(batch)
        for _, ack in batch:
            ack()


# -- AMQP: pika BlockingConnection ---------------------------------------------------------------
def run_amqp(url: str, queue_name: str, db: str, body_dir: str, expect: int, threads: int = 16,
             prefetch: int = 16, max_seconds: float = 300, ready: Callable[[], None] | None = None) -> dict:
    """Consume ``expect`` messages from ``queue_name`` through the pipeline; return the report."""
    import pika
    work, writer = make_work(body_dir, threads), Writer(db)
    writer.start()
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    pool = ThreadPoolExecutor(max_workers=threads)

    def acker(tag: int) -> Callable[[], None]:
        # The writer thread never touches the channel: the connection's thread acks.
        return lambda: conn.add_callback_threadsafe(lambda: ch.basic_ack(tag))

    def process(tag: int, body: bytes, message_id: str | None) -> None:
        try:
            row = work(body, message_id)
        except Exception as exc:                  # put it back: another try, as a plain consumer would
            failed(exc)
            conn.add_callback_threadsafe(lambda: ch.basic_nack(tag, requeue=True))
            return
        writer.put(row, acker(tag))

    def on_message(channel: Any, method: Any, props: Any, body: bytes) -> None:
        pool.submit(process, method.delivery_tag, body, props.message_id)

    if ready:
        ready()
    started = time.time()
    ch.basic_consume(queue_name, on_message)
    deadline = time.monotonic() + max_seconds
    while writer.stored < expect and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    conn.process_data_events(time_limit=0.1)      # send the last acks
    pool.shutdown(wait=True, cancel_futures=True)
    writer.stop()
    conn.close()
    return report(writer, started)


# -- JetStream: nats-py pull consumer --------------------------------------------------------------
def run_jetstream(url: str, stream: str, durable: str, db: str, body_dir: str, expect: int,
                  threads: int = 16, prefetch: int = 16, max_seconds: float = 300,
                  ready: Callable[[], None] | None = None) -> dict:
    return asyncio.run(_jetstream(url, stream, durable, db, body_dir, expect, threads, prefetch,
                                  max_seconds, ready))


async def _jetstream(url: str, stream: str, durable: str, db: str, body_dir: str, expect: int,
                     threads: int, prefetch: int, max_seconds: float,
                     ready: Callable[[], None] | None) -> dict:
    import nats
    work, writer = make_work(body_dir, threads), Writer(db)
    writer.start()
    nc = await nats.connect(url)
    psub = await nc.jetstream().pull_subscribe_bind(durable=durable, stream=stream)
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=threads)
    slots = asyncio.Semaphore(prefetch)             # unacked messages held, as max_ack_pending

    async def settle(msg: Any) -> None:
        await msg.ack()
        slots.release()

    def acker(msg: Any) -> Callable[[], None]:
        return lambda: asyncio.run_coroutine_threadsafe(settle(msg), loop)

    async def retry(msg: Any) -> None:
        await msg.nak()
        slots.release()

    def process(msg: Any) -> None:
        try:
            row = work(msg.data, msg.headers.get("Nats-Msg-Id") if msg.headers else None)
        except Exception as exc:                  # redeliver at once, as a plain consumer would
            failed(exc)
            asyncio.run_coroutine_threadsafe(retry(msg), loop)
            return
        writer.put(row, acker(msg))

    if ready:
        await loop.run_in_executor(None, ready)
    started = time.time()
    deadline = time.monotonic() + max_seconds
    while writer.stored < expect and time.monotonic() < deadline:
        free = await _take_free(slots, prefetch)
        try:
            msgs = await psub.fetch(free, timeout=0.5)
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            msgs = []
        for _ in range(free - len(msgs)):
            slots.release()                          # slots taken but not filled
        for msg in msgs:
            loop.run_in_executor(pool, process, msg)
    await asyncio.sleep(0.1)                         # let the last acks go out
    await nc.flush()
    pool.shutdown(wait=True, cancel_futures=True)
    writer.stop()
    await nc.close()
    return report(writer, started)


async def _take_free(slots: asyncio.Semaphore, most: int) -> int:
    """Wait for one free slot, then take every other one free now (one fetch for them all)."""
    await slots.acquire()
    taken = 1
    while taken < most and not slots.locked():
        await slots.acquire()
        taken += 1
    return taken


ERRORS = [0]


def failed(exc: BaseException) -> None:
    ERRORS[0] += 1
    print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


# -- report and CLI ---------------------------------------------------------------------------
def report(writer: Writer, started: float) -> dict:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    seconds = (writer.last - started) if writer.last else None
    return {"pages": writer.stored, "count": writer.stored, "seconds": seconds,
            "first": writer.first, "last": writer.last, "started": started,
            "cpu_user_s": usage.ru_utime, "cpu_system_s": usage.ru_stime,
            "cpu_s": usage.ru_utime + usage.ru_stime, "pid": os.getpid(), "errors": ERRORS[0]}


def wait_go() -> None:
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    amqp = sub.add_parser("amqp")
    amqp.add_argument("url"), amqp.add_argument("queue")
    js = sub.add_parser("jetstream")
    js.add_argument("url"), js.add_argument("stream"), js.add_argument("durable")
    for p in (amqp, js):
        p.add_argument("db"), p.add_argument("body_dir")
        p.add_argument("--expect", type=int, required=True)
        p.add_argument("--threads", type=int, default=16)
        p.add_argument("--prefetch", type=int, default=16)
        p.add_argument("--max-seconds", type=float, default=300)
        p.add_argument("--wait-go", action="store_true")
        p.add_argument("--linger", type=float, default=0.0,
                       help="stay up this long after the report (until SIGTERM), as a daemon would: "
                            "an outside poller sees the last row before the process goes")
    args = parser.parse_args(argv)
    common = dict(db=args.db, body_dir=args.body_dir, expect=args.expect, threads=args.threads,
                  prefetch=args.prefetch, max_seconds=args.max_seconds,
                  ready=wait_go if args.wait_go else None)
    if args.cmd == "amqp":
        out = run_amqp(args.url, args.queue, **common)
    else:
        out = run_jetstream(args.url, args.stream, args.durable, **common)
    print(json.dumps(out), flush=True)
    time.sleep(args.linger)
    return 0 if out["pages"] >= args.expect else 1


if __name__ == "__main__":
    sys.exit(main())
