"""A worker's store at boot: wait for a store that is not up yet, fail fast on a wrong one.

PostgreSQL still starting when `crawld run` starts (a host boot, a failover) is a fault of
the moment: the worker waits, paused with reason ``store``, probing with capped jittered
backoff, and beats its heartbeat meanwhile, so the supervisor neither kills it as stuck
nor counts it toward the crash-loop limit. A store that refused us for good (no such
database or role, bad password, pg_hba) will refuse again: that stays a boot error.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

from tenacity import Retrying, retry_if_exception, wait_random_exponential

from crawld.config import Config
from crawld.logs import get_logger
from crawld.pipeline.faults import Fault, local_fault
from crawld.process.heartbeat import Heartbeat
from crawld.process.states import Phase
from crawld.store import PG_PERMANENT_ERRORS, Store

log = get_logger("crawld.worker")

PAUSED_AFTER_S = 1.0     # a store slower than this to open is reported as waited for


def store_not_ready(exc: BaseException, url: str) -> bool:
    """True when waiting may help: anything but PostgreSQL's refusal for good, or a
    local fault (disk) on SQLite."""
    if url.startswith("sqlite:"):
        return local_fault(exc) is not None
    message = " ".join(str(exc).split())
    return not any(text in message for text in PG_PERMANENT_ERRORS)


def open_store_when_ready(cfg: Config, opener: Callable[[], Store]) -> Store:
    """``opener()`` until it succeeds; raises at once on a permanent error."""
    beat = _BootBeat()
    waited = time.monotonic()
    beat.start()
    try:
        store = Retrying(retry=retry_if_exception(lambda exc: store_not_ready(exc, cfg.store.url)),
                         wait=wait_random_exponential(multiplier=0.5, max=cfg.workers.probe_max_s),
                         before_sleep=beat.failed, reraise=True)(opener)
    finally:
        beat.stop()
    if beat.paused:
        log.info("worker_resumed", reason=Fault.STORE, at="boot",
                 paused_s=round(time.monotonic() - waited, 3))
    return store


class _BootBeat:
    """Heartbeats from a thread while the boot waits: one attempt alone may block for long
    (PostgresStore retries a refused connection for up to 30 s itself). A store that has
    not opened after ``PAUSED_AFTER_S`` is reported as a pause, with one event."""

    def __init__(self) -> None:
        self._beat = Heartbeat.from_env()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.paused = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="boot-beat", daemon=True)
        self._thread.start()

    def failed(self, state: object) -> None:
        """tenacity before_sleep: an attempt failed; pause now if not already."""
        outcome = getattr(state, "outcome", None)
        self._pause(repr(outcome.exception())[:300] if outcome is not None else "")

    def _pause(self, error: str) -> None:
        with self._lock:
            if self.paused:
                return
            self.paused = True
        log.warning("worker_paused", reason=Fault.STORE, at="boot", error=error)

    def _run(self) -> None:
        if self._done.wait(PAUSED_AFTER_S):
            return
        self._pause("store not reachable yet")
        since = time.time()
        while not self._done.is_set():
            if self._beat.due():
                self._beat.send({"state": Phase.PAUSED, "paused_reason": Fault.STORE,
                                 "paused_since": since, "pid": os.getpid(), "inflight": 0})
            self._done.wait(0.5)

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(2)
