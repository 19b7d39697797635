"""Pause, probe, resume: what a worker does while a fault of its own lasts.

Any thread may ``trip`` the pause (a pool thread that met a full disk, the network
breaker); only the main thread acts on it, through ``poll``, which reports each change
once so the worker stops or restarts consuming and logs one event per change, never one
per task. While paused, one probe thread calls the fault's probe with capped, jittered
exponential waits (tenacity) until it passes; the main thread keeps beating and servicing
the broker meanwhile, so no probe (a store write waiting on a lock, say) can stall it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from tenacity import Retrying, retry_if_exception_type, wait_random_exponential

from crawld.logs import get_logger

log = get_logger("crawld.pause")

Probe = Callable[[], None]      # raises while the fault lasts
PROBE_SLICE_S = 0.2             # a stopping worker ends a probe wait within this long


@dataclass(frozen=True)
class Change:
    paused: bool
    reason: str
    error: str = ""
    paused_for_s: float = 0.0
    probes: int = 0


class Pause:
    def __init__(self, probes: Mapping[str, Probe], probe_max_s: float,
                 should_stop: Callable[[], bool]) -> None:
        self.probes = dict(probes)
        self.probe_max_s = probe_max_s
        self.should_stop = should_stop
        self._lock = threading.Lock()
        self._reason = ""
        self._error = ""
        self._since = 0.0
        self._reported = ""          # the reason the main thread last acted on
        self._cleared = threading.Event()
        self._probes_run = 0
        self._thread: threading.Thread | None = None

    @property
    def reason(self) -> str:
        """The fault the worker is paused for, "" when it runs."""
        with self._lock:
            return self._reason

    @property
    def since(self) -> float:
        with self._lock:
            return self._since

    def trip(self, reason: str, error: str = "") -> bool:
        """Pause for ``reason``; True if this call paused it (the first report of a fault)."""
        with self._lock:
            if self._reason:
                return False
            self._reason, self._error, self._since = reason, error[:300], time.time()
            self._cleared.clear()
            return True

    def poll(self) -> Change | None:
        """Main thread: the change since the last poll, if any; starts the probe thread."""
        with self._lock:
            reason, reported = self._reason, self._reported
            if reason and self._cleared.is_set():
                change = Change(False, reason, paused_for_s=round(time.time() - self._since, 3),
                                probes=self._probes_run)
                self._reason = self._reported = ""
                self._thread = None
                return change
            if reason == reported:
                return None
            self._reported = reason
            self._probes_run = 0
            self._thread = threading.Thread(target=self._probe_until_clear, args=(reason,),
                                            name=f"probe-{reason}", daemon=True)
            self._thread.start()
            return Change(True, reason, error=self._error)

    def _probe_until_clear(self, reason: str) -> None:
        probe = self.probes.get(reason, lambda: None)
        try:
            Retrying(wait=wait_random_exponential(multiplier=0.5, max=self.probe_max_s),
                     retry=retry_if_exception_type(Exception), sleep=self._sleep,
                     stop=lambda _state: self.should_stop(), before_sleep=self._log_probe,
                     reraise=True)(self._counted, probe)
        except Exception:      # stopped while still failing: the drain takes over
            return
        self._cleared.set()

    def _counted(self, probe: Probe) -> None:
        self._probes_run += 1
        probe()

    def _log_probe(self, state: object) -> None:
        # debug only: one event per state change is the rule at info and above
        outcome = getattr(state, "outcome", None)
        log.debug("pause_probe_failed", reason=self._reason, attempt=getattr(state, "attempt_number", 0),
                  error=repr(outcome.exception()) if outcome is not None else "")

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.should_stop():
            time.sleep(min(PROBE_SLICE_S, max(0.0, deadline - time.monotonic())))


DISK_PROBE_BYTES = 256 * 1024    # room for a typical page, not just a few bytes


def write_probe(directory: str, size: int = DISK_PROBE_BYTES) -> None:
    """Raises while ``directory`` cannot take a page-sized write (full, read-only, EIO)."""
    import os
    import tempfile
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=directory, prefix=".probe-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(b"\0" * size)
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        os.unlink(path)
