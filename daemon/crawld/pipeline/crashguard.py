"""Count only real crashes, and run a suspect alone before calling it poison.

Every delivery the broker hands out again counts toward ``queue.max_deliver`` (our store
counter on classic AMQP queues, ``x-delivery-count`` on quorum queues, ``num_delivered``
on JetStream), except those the ledger forgave: deliveries a worker gave back through no
fault of the task (its connection dropped, the broker restarted, it drained, it paused).
A SIGKILLed worker forgives nothing, so its deliveries do count.

A task whose count reaches the limit is only a *suspect*: on quorum queues and JetStream
every delivery in a dying worker is counted, so it may just have shared the worker with
the real poison. The suspect runs alone (``Isolation``: no other fetch in flight in its
worker), with a quarantine row written first. Its next delivery finding that row, left by
a worker that is gone, means the run killed the worker: one lone death, counted in the
row. One is not proof: an outside SIGKILL (the OOM killer, an operator, a chaos test) can
land on a healthy suspect during its short run, so the suspect runs alone again, and only
``LONE_DEATHS`` (2) lone runs that killed their worker make it dead as ``poison``. A real
poison task thus costs ``max_deliver + LONE_DEATHS`` worker deaths. Nothing loops: each
lone run either survives, and the task is handled like any task (its row and count go),
or adds a death, and the ``LONE_DEATHS``-th is final.
"""
from __future__ import annotations

import os
import socket
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from crawld.config import Config
from crawld.logs import get_logger
from crawld.pipeline.classify import Decision, Verdict
from crawld.pipeline.outcomes import Reason
from crawld.store import Store
from crawld.task import Task
from crawld.transports.base import Delivery

log = get_logger("crawld.crashguard")

# Lone runs that killed their worker before a suspect is dead as poison: one can be an
# outside kill that happened to land on it; two in a row, each alone, is the task.
LONE_DEATHS = 2


@dataclass(frozen=True)
class Guard:
    attempt: int                    # the attempt this delivery really is (forgiven ones off)
    dead: Decision | None = None    # dead-letter it now
    suspect: bool = False           # run it alone


class CrashGuard:
    """Thread-safe; one per worker process."""

    def __init__(self, cfg: Config, store: Store, *, counts_deliveries: bool, worker_id: str) -> None:
        self.limit = cfg.queue.max_deliver
        self.store = store
        self.counts_deliveries = counts_deliveries
        self.worker_id = worker_id
        self.isolation = Isolation()
        self._lock = threading.Lock()
        self._owed: Counter[str] = Counter()   # forgiveness not yet written (store trouble)

    def check(self, delivery: Delivery, task: Task) -> Guard:
        attempt = delivery.attempt
        again = delivery.redelivered or attempt > 1 or bool(delivery.broker_redeliveries)
        if not again:
            return Guard(attempt)                     # a first delivery: no store read at all
        deaths, worker = self._quarantined(task)
        if deaths >= LONE_DEATHS:
            return Guard(attempt, dead=Decision(
                Verdict.DEAD, reason=Reason.POISON,
                error=f"killed its worker in {LONE_DEATHS} runs alone"))
        guard = self._counted(delivery, task, attempt)
        if not deaths or guard.dead is not None:
            return guard
        if worker:      # counted by this check: one event per death, not per copy that finds it
            log.warning("suspect_killed_alone", task_id=task.task_id, url=task.url,
                        attempt=guard.attempt, deaths=deaths, worker=worker)
        # A lone death may have been an outside kill: alone again, whatever the count says.
        return Guard(guard.attempt, suspect=True)

    def _counted(self, delivery: Delivery, task: Task, attempt: int) -> Guard:
        """The guard from the delivery count alone (forgiven deliveries off)."""
        forgiven = self.store.forgiven(task.task_id)
        if self.counts_deliveries and delivery.broker_redeliveries is None:
            attempt = max(1, attempt - forgiven)      # JetStream: num_delivered counts all
            return Guard(attempt, suspect=attempt > self.limit)
        if attempt > self.limit:                      # our header: retries, never crashes
            return Guard(attempt, dead=Decision(
                Verdict.DEAD, reason=Reason.RETRIES_EXHAUSTED,
                error=f"delivered {attempt} times (max_deliver {self.limit})"))
        count = delivery.broker_redeliveries
        if count is None and delivery.redelivered:
            count = self.store.bump_redelivery(task.task_id)
        return Guard(attempt, suspect=count is not None and count - forgiven >= self.limit)

    def _quarantined(self, task: Task) -> tuple[int, str]:
        """Lone runs of ``task`` that killed their worker, and the worker whose death this
        call counted ('' if none). A row left by a worker still alive (its run ended in a
        store error, or still runs) adds no death."""
        run = self.store.quarantined(task.task_id)
        if run is None:
            return 0, ""
        worker = run["worker"]
        if worker and not _alive(worker):
            return self.store.quarantine_death(task.task_id, worker), worker
        return run["deaths"], ""

    # -- forgiveness ------------------------------------------------------------------
    def forgive(self, task_ids: list[str]) -> None:
        """Owe forgiveness now (any thread, never blocks); ``flush`` writes it."""
        if not task_ids:
            return
        with self._lock:
            self._owed.update(task_ids)

    def flush(self) -> None:
        """Write what is owed; on store trouble keep it for the next flush."""
        with self._lock:
            owed, self._owed = self._owed, Counter()
        if not owed:
            return
        try:
            self.store.forgive(owed)
        except Exception as exc:
            with self._lock:
                self._owed.update(owed)
            # debug: the pause that explains it was logged once already
            log.debug("forgiveness_deferred", tasks=len(owed), error=repr(exc))

    @property
    def owed(self) -> int:
        with self._lock:
            return len(self._owed)

    # -- the suspect's run -----------------------------------------------------------
    @contextmanager
    def alone(self, task: Task) -> Iterator[None]:
        with self.isolation.alone():
            self.store.quarantine_begin(task.task_id, self.worker_id)
            try:
                yield
            finally:     # not reached when the run kills the process: the row stays
                self.store.quarantine_end(task.task_id)


class Isolation:
    """A readers-writer lock for fetches: ordinary ones share it; a suspect waits until
    none is in flight and holds it alone. A waiting suspect stops new fetches from
    starting (they wait unacked, with JetStream in-progress pings) so it cannot starve."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._alone = False
        self._waiting_alone = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._alone or self._waiting_alone:
                self._cond.wait()
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                if self._waiting_alone:     # only a suspect waits for fetches to end
                    self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._waiting_alone += 1
            while self._alone or self._running:
                self._cond.wait()
            self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()


def _alive(worker_id: str) -> bool:
    """Whether the worker ``host:pid`` still runs (a run that ended in a store error left
    its row behind without killing anything). Another host's worker: assume it died."""
    host, _, pid = worker_id.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
