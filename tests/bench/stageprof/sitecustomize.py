"""Thread CPU per stage of a crawld worker's task, for bench_stages.py.

On PYTHONPATH with ``CRAWLD_STAGEPROF=<dir>`` set, every Python process that starts wraps
the methods in STAGES: each call adds its thread CPU (``time.thread_time_ns``) and wall
time, inclusive, to a per-process table. A crawld worker writes that table to
``<dir>/stages-<pid>.json`` every second. Each wrapper costs ~1-2 us a call, so the
figures are a little high; compare stages with each other, not with an unprofiled run.
Without the variable nothing is imported or wrapped.
"""
from __future__ import annotations

import os

if os.environ.get("CRAWLD_STAGEPROF"):
    import functools
    import importlib
    import json
    import threading
    import time
    from typing import Any, Callable

    # (module, class, method): the pool thread's path through one task, outside in
    STAGES = [
        ("crawld.process.worker", "Worker", "_process"),
        ("crawld.pipeline.handler", "DeliveryHandler", "handle"),
        ("crawld.pipeline.handler", "DeliveryHandler", "_fetch_and_record"),
        ("crawld.store.sqlite", "SQLiteStore", "has_result"),
        ("crawld.pipeline.crashguard", "CrashGuard", "check"),
        ("crawld.fetch.fetcher", "Fetcher", "fetch"),
        ("crawld.fetch.netguard", "NetGuard", "check"),
        ("crawld.fetch.robots", "RobotsCache", "check"),
        ("crawld.fetch.politeness", "HostLimiter", "acquire"),   # partition none
        ("crawld.fetch.sites", "SiteLimiter", "acquire"),        # a shard owner's sites
        ("crawld.fetch.fetcher", "Fetcher", "_exchange"),
        ("crawld.pipeline.handler", "DeliveryHandler", "_store_result"),
        ("crawld.output.sinks", "BodyFiles", "store"),
        ("crawld.output.sinks", "WarcBodies", "store"),
        ("crawld.store.base", "Store", "put_result"),
        ("crawld.store.group_commit", "GroupCommit", "submit"),
        ("crawld.transports.amqp.consumer", "AmqpTransport", "settle"),
        ("crawld.transports.jetstream.consumer", "JetStreamTransport", "settle"),
        ("crawld.process.worker", "Worker", "_count"),
    ]
    _lock = threading.Lock()
    _table: dict[str, list[int]] = {}     # "Class.method" -> [calls, cpu ns, wall ns]

    def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        cpu, wall = time.thread_time_ns, time.perf_counter_ns

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            c0, w0 = cpu(), wall()
            try:
                return fn(*args, **kwargs)
            finally:
                c, w = cpu() - c0, wall() - w0
                with _lock:
                    entry = _table.setdefault(label, [0, 0, 0])
                    entry[0] += 1
                    entry[1] += c
                    entry[2] += w
        return wrapper

    def _dump_every_second(directory: str) -> None:
        path = f"{directory}/stages-{os.getpid()}.json"
        while True:
            time.sleep(1.0)
            with _lock:
                snapshot = {label: list(v) for label, v in _table.items()}
            with open(path + ".tmp", "w") as f:
                json.dump(snapshot, f)
            os.replace(path + ".tmp", path)

    for module, cls_name, method in STAGES:
        cls = getattr(importlib.import_module(module), cls_name)
        setattr(cls, method, _timed(f"{cls_name}.{method}", getattr(cls, method)))

    _worker_cls = importlib.import_module("crawld.process.worker").Worker
    _worker_init = _worker_cls.__init__

    def _init(self: Any, *args: Any, **kwargs: Any) -> None:
        _worker_init(self, *args, **kwargs)
        threading.Thread(target=_dump_every_second, args=(os.environ["CRAWLD_STAGEPROF"],),
                         name="stageprof", daemon=True).start()

    _worker_cls.__init__ = _init
