"""The task body Celery and Dramatiq run in the framework benchmark: the same fetch and
store code a crawld worker runs (crawld's Fetcher, crawld's SQLite store upsert), so the
comparison isolates the framework (delivery, ack, concurrency model), not the work.

Configured by environment: BENCH_DB, BENCH_BODY_DIR, BENCH_RUN_DIR, BENCH_THREADS.
"""
from __future__ import annotations

import os
import threading
import time

from crawld.config import FetchConfig
from crawld.fetch import Fetcher
from crawld.store import ResultRow, SQLiteStore

_lock = threading.Lock()
_state: dict = {}


def _resources() -> tuple[SQLiteStore, Fetcher]:
    """One store and one Fetcher per process, created lazily (after any fork)."""
    with _lock:
        if _state.get("pid") != os.getpid():
            store = SQLiteStore(os.environ["BENCH_DB"], os.environ["BENCH_BODY_DIR"])
            store.init_schema()
            fetcher = Fetcher(FetchConfig(allow_networks=("127.0.0.0/8",), per_host_concurrency=256),
                              pool_size=int(os.environ.get("BENCH_THREADS", "16")),
                              run_dir=os.environ["BENCH_RUN_DIR"])
            _state.update(pid=os.getpid(), store=store, fetcher=fetcher)
        return _state["store"], _state["fetcher"]


def fetch_and_store(task_id: str, url: str, worker: str) -> None:
    store, fetcher = _resources()
    result = fetcher.fetch(url)
    digest = store.save_body(result.body) if result.body else ""
    status = "fetched" if result.kind == "response" and (result.http_status or 0) < 400 else "http_error"
    store.put_result(ResultRow(
        task_id=task_id, url=url, final_url=result.final_url or url, status=status,
        http_status=result.http_status, reason=result.reason, content_type=result.content_type,
        bytes=len(result.body), body_sha256=digest, attempts=1, fetched_at=time.time(),
        worker=f"{worker}:{os.getpid()}"))
