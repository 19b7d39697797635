"""Plain-client processes the benchmarks compare crawld against (one process each).

    raw_clients.py amqp-consume URL QUEUE [--prefetch 16] [--expect N]
    raw_clients.py amqp-publish URL QUEUE --count N --url-prefix P [--start I] [--transient]
    raw_clients.py nats-pull URL STREAM DURABLE [--batch 16] [--expect N]
    raw_clients.py http-loop URL_PREFIX --count N [--threads 16] [--client urllib3|fetcher]
    raw_clients.py store-loop DB BODY_DIR --count N [--threads 16]
    raw_clients.py baseline URL QUEUE DB BODY_DIR RUN_DIR --expect N [--threads 16] [--sleep-retry 1]

Each prints one JSON line with what it did (count, first/last timestamps or seconds).
The consumers only ack (the ceiling); ``baseline`` is the hand-written alternative to
crawld: raw pika + a thread pool of the same size + the same Fetcher and store upsert,
which on a failed fetch sleeps the retry delay *in the worker thread* and retries in
place (what the references warn against). Every loop stops on its count, on idleness
or on --max-seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable


def amqp_consume(args: argparse.Namespace) -> dict:
    import pika
    conn = pika.BlockingConnection(pika.URLParameters(args.url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=args.prefetch)
    state = {"count": 0, "first": None, "last": None}

    def on_message(channel, method, props, body):
        channel.basic_ack(method.delivery_tag)
        now = time.time()
        if state["first"] is None:
            state["first"] = now
        state["last"] = now
        state["count"] += 1

    print(json.dumps({"ready": True}), flush=True)
    if args.wait_go:
        sys.stdin.readline()
    ch.basic_consume(args.queue, on_message)
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.1)
        if args.expect and state["count"] >= args.expect:
            break
        if state["last"] is not None and time.time() - state["last"] > args.idle:
            break
    conn.close()
    return state


def amqp_publish(args: argparse.Namespace) -> dict:
    import pika
    conn = pika.BlockingConnection(pika.URLParameters(args.url))
    ch = conn.channel()
    ch.queue_declare(args.queue, durable=True)
    props = pika.BasicProperties(delivery_mode=1 if args.transient else 2, content_type="application/json")
    started = time.perf_counter()
    for i in range(args.start, args.start + args.count):
        ch.basic_publish("", args.queue, b'{"url": "%s%d"}' % (args.url_prefix.encode(), i), props)
    conn.process_data_events(0)
    seconds = time.perf_counter() - started
    conn.close()
    return {"count": args.count, "seconds": seconds}


def nats_pull(args: argparse.Namespace) -> dict:
    import nats

    async def main() -> dict:
        nc = await nats.connect(args.url)
        js = nc.jetstream()
        psub = await js.pull_subscribe_bind(durable=args.durable, stream=args.stream)
        state = {"count": 0, "first": None, "last": None}
        print(json.dumps({"ready": True}), flush=True)
        if args.wait_go:
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        deadline = time.monotonic() + args.max_seconds
        while time.monotonic() < deadline:
            try:
                msgs = await psub.fetch(args.batch, timeout=args.idle)
            except (asyncio.TimeoutError, nats.errors.TimeoutError):
                if state["count"]:
                    break
                continue
            for msg in msgs:
                await msg.ack()
            now = time.time()
            if state["first"] is None:
                state["first"] = now
            state["last"] = now
            state["count"] += len(msgs)
            if args.expect and state["count"] >= args.expect:
                break
        await nc.flush()
        await nc.close()
        return state

    return asyncio.run(main())


def http_loop(args: argparse.Namespace) -> dict:
    if args.client == "fetcher":
        import tempfile

        from crawld.config import FetchConfig
        from crawld.fetch import Fetcher
        run_dir = tempfile.TemporaryDirectory(prefix="crawld-bench-http-")   # removed at exit
        fetcher = Fetcher(FetchConfig(allow_networks=("127.0.0.0/8",), per_host_concurrency=256),
                          pool_size=args.threads, run_dir=run_dir.name)
        get = lambda url: fetcher.fetch(url).http_status   # noqa: E731
    else:
        import urllib3
        pool = urllib3.PoolManager(maxsize=args.threads, retries=False)
        get = lambda url: pool.request("GET", url).status  # noqa: E731
    get(args.url_prefix + "warmup")
    return counted_threads(args, lambda n: get(f"{args.url_prefix}{n}") == 200)


def counted_threads(args: argparse.Namespace, one: Callable[[int], bool]) -> dict:
    """Run ``one(n)`` for n = 1..args.count on ``args.threads`` threads (stopping at
    ``args.max_seconds``); ``one`` returns False for a failure."""
    lock = threading.Lock()
    issued = [0]
    failures = [0]
    deadline = time.monotonic() + args.max_seconds

    def worker() -> None:
        while True:
            with lock:
                if issued[0] >= args.count or time.monotonic() > deadline:
                    return
                issued[0] += 1
                n = issued[0]
            if not one(n):
                with lock:
                    failures[0] += 1

    threads = [threading.Thread(target=worker) for _ in range(args.threads)]
    first, started = time.time(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    return {"count": issued[0], "seconds": seconds, "failures": failures[0], "first": first,
            "last": first + seconds}


def store_loop(args: argparse.Namespace) -> dict:
    """The store calls a crawld worker makes per task (has_result, save_body, put_result),
    from ``threads`` threads of one process, group commit on if the store has it (as the
    worker): the store's own ceiling."""
    from crawld.store import ResultRow, SQLiteStore
    store = SQLiteStore(args.db, args.body_dir)
    store.init_schema()
    if hasattr(store, "enable_group_commit"):
        store.enable_group_commit()           # as run_worker does

    def one(n: int) -> bool:
        task_id = f"{args.prefix}{n:08d}"
        url = f"http://127.0.0.1/fast/{task_id}"
        body = f"<html><body>page {url}</body></html>".encode()
        store.has_result(task_id)
        digest = store.save_body(body)
        store.put_result(ResultRow(task_id=task_id, url=url, final_url=url, status="fetched",
                                   http_status=200, reason="", content_type="text/html",
                                   bytes=len(body), body_sha256=digest, attempts=1,
                                   fetched_at=time.time(), worker="store-loop"))
        return True

    out = counted_threads(args, one)
    store.close()
    del out["failures"]             # store-loop's report never had one: its calls raise
    return out


def baseline(args: argparse.Namespace) -> dict:
    """Raw pika + thread pool + crawld's Fetcher and store upsert; retries sleep in place."""
    import pika

    from crawld.config import FetchConfig
    from crawld.fetch import Fetcher
    from crawld.store import ResultRow, SQLiteStore
    from crawld.task import parse_message

    store = SQLiteStore(args.db, args.body_dir)
    store.init_schema()
    if args.group_commit and hasattr(store, "enable_group_commit"):
        store.enable_group_commit()
    fetcher = Fetcher(FetchConfig(allow_networks=("127.0.0.0/8",), per_host_concurrency=256),
                      pool_size=args.threads, run_dir=args.run_dir)
    conn = pika.BlockingConnection(pika.URLParameters(args.url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=args.prefetch)
    pool = ThreadPoolExecutor(max_workers=args.threads)
    state = {"done": 0, "retries": 0, "first": None, "last": None}
    lock = threading.Lock()

    def process(tag: int, body: bytes) -> None:
        task = parse_message(body)
        for attempt in range(1, args.max_attempts + 1):
            result = fetcher.fetch(task.url)
            ok = result.kind == "response" and (result.http_status or 0) < 500
            if ok or attempt == args.max_attempts:
                break
            store.put_attempt(task.task_id, attempt, task.url, result.error or str(result.http_status),
                              result.http_status, args.sleep_retry, "baseline")
            with lock:
                state["retries"] += 1
            time.sleep(args.sleep_retry)          # the in-place retry: the thread waits
        digest = store.save_body(result.body) if result.body else ""
        store.put_result(ResultRow(
            task_id=task.task_id, url=task.url, final_url=result.final_url or task.url,
            status="fetched" if ok else "http_error", http_status=result.http_status, reason="",
            content_type=result.content_type, bytes=len(result.body), body_sha256=digest,
            attempts=attempt, fetched_at=time.time(), worker="baseline"))
        conn.add_callback_threadsafe(partial(ch.basic_ack, tag))
        with lock:
            now = time.time()
            state["first"] = state["first"] or now
            state["last"] = now
            state["done"] += 1

    def on_message(channel, method, props, body):
        pool.submit(process, method.delivery_tag, body)

    print(json.dumps({"ready": True}), flush=True)
    if args.wait_go:
        sys.stdin.readline()
    ch.basic_consume(args.queue, on_message)
    started = time.time()
    deadline = time.monotonic() + args.max_seconds
    import sqlite3
    reader = sqlite3.connect(f"file:{args.db}?mode=ro", uri=True, timeout=5)
    while time.monotonic() < deadline and state["done"] < args.expect:
        conn.process_data_events(time_limit=0.1)
        # Several processes may share the queue and the store: stop when the store is full.
        if args.expect_total and reader.execute("SELECT COUNT(*) FROM results").fetchone()[0] >= args.expect_total:
            break
    reader.close()
    conn.process_data_events(time_limit=0.2)
    pool.shutdown(wait=False, cancel_futures=True)
    conn.close()
    fetcher.close()
    store.close()
    return {**state, "started": started, "count": state["done"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("amqp-consume")
    p.add_argument("url"), p.add_argument("queue")
    p.add_argument("--prefetch", type=int, default=16)
    p.add_argument("--expect", type=int, default=0)
    p.add_argument("--idle", type=float, default=1.0)
    p.add_argument("--max-seconds", type=float, default=120)
    p = sub.add_parser("amqp-publish")
    p.add_argument("url"), p.add_argument("queue")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--url-prefix", required=True)
    p.add_argument("--transient", action="store_true")
    p = sub.add_parser("nats-pull")
    p.add_argument("url"), p.add_argument("stream"), p.add_argument("durable")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--expect", type=int, default=0)
    p.add_argument("--idle", type=float, default=1.0)
    p.add_argument("--max-seconds", type=float, default=120)
    p = sub.add_parser("http-loop")
    p.add_argument("url_prefix")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--client", choices=["urllib3", "fetcher"], default="urllib3")
    p.add_argument("--max-seconds", type=float, default=60)
    p = sub.add_parser("store-loop")
    p.add_argument("db"), p.add_argument("body_dir")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--prefix", default="s")
    p.add_argument("--max-seconds", type=float, default=60)
    p = sub.add_parser("baseline")
    p.add_argument("url"), p.add_argument("queue"), p.add_argument("db")
    p.add_argument("body_dir"), p.add_argument("run_dir")
    p.add_argument("--expect", type=int, required=True)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--prefetch", type=int, default=16)
    p.add_argument("--sleep-retry", type=float, default=1.0)
    p.add_argument("--max-attempts", type=int, default=5)
    p.add_argument("--expect-total", type=int, default=0, help="stop when the shared store has this many results")
    p.add_argument("--group-commit", action="store_true", help="use the store's group commit, as crawld does")
    p.add_argument("--max-seconds", type=float, default=300)
    for name in ("amqp-consume", "nats-pull", "baseline", "http-loop", "store-loop"):
        sub.choices[name].add_argument("--wait-go", action="store_true",
                                       help="connect, print ready, then wait for a line on stdin")
    args = parser.parse_args()
    if args.cmd in ("http-loop", "store-loop") and args.wait_go:
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()
    handler = {"amqp-consume": amqp_consume, "amqp-publish": amqp_publish, "nats-pull": nats_pull,
               "http-loop": http_loop, "store-loop": store_loop, "baseline": baseline}[args.cmd]
    print(json.dumps(handler(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
