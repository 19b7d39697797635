"""Crash points and wrong-on-purpose demonstrations, as a crawld worker middleware.

Tests opt in with ``CRAWLD_TEST_FAULT=point[,point...]``; ``crawld_proc.Crawld`` then
adds ``pipeline.middleware = ["faults:FaultMiddleware"]`` and puts tests/ on the
workers' PYTHONPATH. Points:

* ``boot``, ``after_receive``, ``before_store``, ``after_store``, ``before_settle``:
  the worker process dies (exit 17) there, like a SIGKILL or an OOM kill would.
* ``stuck``: the main loop stops turning (sleeps an hour in a tick).
* ``poison``: any task whose URL contains ``/poison/`` kills every worker it reaches.
* ``early_ack``: ack before storing, then die: the loss crawld never risks.

With ``CRAWLD_TEST_FAULT_ONCE_FILE`` set, only the first process to reach an armed
point fires (the marker file is created atomically), so a respawned worker runs clean.
"""
from __future__ import annotations

import os
import time
from typing import Any

from crawld.pipeline.middleware import Middleware
from crawld.task import Task
from crawld.transports.base import Action, Delivery, Settlement

FAULT_ENV = "CRAWLD_TEST_FAULT"
FAULT_ONCE_ENV = "CRAWLD_TEST_FAULT_ONCE_FILE"   # fire once per test run, not per process
MIDDLEWARE_SPEC = "faults:FaultMiddleware"
CRASH_EXIT = 17
CRASH_POINTS = ("boot", "after_receive", "before_store", "after_store", "before_settle")


class FaultMiddleware(Middleware):
    def __init__(self) -> None:
        self.faults = set(filter(None, os.environ.get(FAULT_ENV, "").split(",")))
        self.worker: Any = None

    def after_worker_boot(self, worker: Any) -> None:
        self.worker = worker              # early_ack needs the transport
        self._crash_at("boot")

    def on_tick(self, worker: Any) -> None:
        if "stuck" in self.faults and fault_armed():
            time.sleep(3600)

    def before_fetch(self, delivery: Delivery, task: Task) -> None:
        self._crash_at("after_receive")
        if "poison" in self.faults and "/poison/" in task.url:
            os._exit(CRASH_EXIT)
        if "early_ack" in self.faults and fault_armed():
            self._ack_then_die(delivery, task)

    def before_store(self, delivery: Delivery, task: Task) -> None:
        self._crash_at("before_store")

    def after_store(self, delivery: Delivery, task: Task) -> None:
        self._crash_at("after_store")

    def before_settle(self, delivery: Delivery, settlement: Settlement) -> None:
        self._crash_at("before_settle")

    def _crash_at(self, point: str) -> None:
        if point in self.faults and fault_armed():
            os._exit(CRASH_EXIT)

    def _ack_then_die(self, delivery: Delivery, task: Task) -> None:
        """What the reference's early-ack consumer did: the broker forgets the task
        before anything is stored, so the crash that follows loses it."""
        transport = self.worker.transport
        transport.settle(delivery, Settlement(Action.ACK, task=task))
        while transport.pending_settlements():   # the main thread sends it to the broker
            time.sleep(0.01)
        time.sleep(0.2)
        os._exit(CRASH_EXIT)


def fault_armed() -> bool:
    """With CRAWLD_TEST_FAULT_ONCE_FILE set, only the first process to get here fires."""
    marker = os.environ.get(FAULT_ONCE_ENV)
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
