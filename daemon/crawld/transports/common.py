"""Mechanics every transport needs, written once (base.py holds the interface).

A transport plugs its broker client in; what stays the same for every broker lives
here: the inbox and the count of settlements handed from pool threads to the I/O loop,
the stop-aware connect backoff, connection generations (stale deliveries, reconnect
events), the ``Action`` dispatch and the headers a forwarded copy carries.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from tenacity import AsyncRetrying, RetryError, Retrying, retry_if_exception_type, wait_random_exponential

from crawld.config import Config, redact_url
from crawld.transports.base import (ATTEMPT_HEADER, ERROR_HEADER, EVENT_UNCONFIRMED, MAX_HEADER_CHARS,
                                    ORIGIN_HEADER, REASON_HEADER, Action, Delivery, Settlement, Transport)

T = TypeVar("T")
Logger = Any   # a structlog bound logger; each transport passes its own so events keep its name

SYNC_SLEEP_SLICE_S = 0.2    # a stop request ends a backoff wait within this long
ASYNC_SLEEP_SLICE_S = 0.1


# -- settlements in transit ------------------------------------------------------------
class PendingSettlements:
    """Settlements a pool thread handed to the I/O loop that the loop has not finished.

    The worker drains until this is zero, so every path that takes one must give it back:
    ``hand_off`` does when the loop refuses the work, the loop's handler via ``done``.
    """

    def __init__(self, log: Logger, transport: str) -> None:
        self._log = log
        self._transport = transport
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def done(self) -> None:
        with self._lock:
            self._count -= 1

    def add(self) -> None:
        """One more the loop owes, taken on the loop itself (an ack waiting for its event)."""
        with self._lock:
            self._count += 1

    def hand_off(self, schedule: Callable[[], None], delivery: Delivery, settlement: Settlement,
                 refused: tuple[type[BaseException], ...], reason: str) -> None:
        """Count first, then ``schedule``: the loop may run the handler (and call ``done``)
        before ``schedule`` even returns."""
        with self._lock:
            self._count += 1
        try:
            schedule()
        except refused as exc:
            self.done()
            self._log.warning("settle_dropped", transport=self._transport, reason=reason,
                              error=repr(exc), message_id=delivery.message_id,
                              action=settlement.action.value)


Queued = tuple[Delivery, Settlement]


class SettleInbox:
    """Settlements pool threads queue for the I/O loop, drained in bursts: the first
    ``put`` after a drain asks its caller to wake the loop, later ones ride on that
    wake-up (a group commit settles its batch at once: one wake-up, not one each)."""

    def __init__(self) -> None:
        self._items: list[Queued] = []
        self._lock = threading.Lock()
        self._wake_pending = False
        self._closed = False

    def put(self, items: list[Queued]) -> bool:
        """Queue ``items``; True when the caller must wake the loop. Refused with a
        RuntimeError once ``close`` ran: nothing would drain them."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the transport's settle inbox is closed")
            self._items.extend(items)
            wake, self._wake_pending = not self._wake_pending, True
            return wake

    def park(self, items: list[Queued]) -> None:
        """Queue ``items`` for the next drain without asking for a wake-up."""
        with self._lock:
            self._items.extend(items)

    def wake_failed(self) -> None:
        """The wake-up ``put`` asked for could not be scheduled: the next put asks again."""
        with self._lock:
            self._wake_pending = False

    def take(self) -> list[Queued]:
        with self._lock:
            items, self._items = self._items, []
            self._wake_pending = False
            return items

    def close(self) -> list[Queued]:
        """No more puts; what is still queued is returned, for the caller to give up."""
        with self._lock:
            self._closed = True
        return self.take()


# -- connection generations ------------------------------------------------------------
class Generations:
    """Which connection object is current. A delivery remembers its generation; one from
    an older generation belongs to a connection we gave up on, whose unsettled messages
    the broker hands out again (settling it there is impossible or redundant)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self.current = 0

    def advance(self) -> int:
        """A new connection object exists: deliveries from older ones are stale from now on
        (before any setup call, which may already run queued settlements)."""
        self.current += 1
        return self.current

    def ready(self) -> None:
        """The new connection is fully set up; if it replaced one, that is a reconnect."""
        if self.current > 1:
            self._transport.reconnected()

    def is_stale(self, generation: int) -> bool:
        return generation != self.current


# -- connect backoff ------------------------------------------------------------------
@dataclass(frozen=True)
class Backoff:
    """Jittered exponential waits, capped at ``broker.reconnect_max_s``, that end as soon
    as ``should_stop`` says so; every failed attempt logs ``broker_connect_failed``."""

    cfg: Config
    should_stop: Callable[[], bool]
    retryable: tuple[type[BaseException], ...]
    log: Logger
    transport: str
    what: str

    def call(self, attempt: Callable[[], T]) -> T | None:
        """Blocking: ``attempt()`` until it succeeds; None if told to stop first."""
        try:
            return Retrying(sleep=self._sleep, **self._policy())(attempt)
        except RetryError:
            return None
        except self.retryable as exc:
            return self._stopped(exc)

    async def acall(self, attempt: Callable[[], Awaitable[T]]) -> T | None:
        """On an asyncio loop: the same, without blocking the loop while it waits."""
        try:
            return await AsyncRetrying(sleep=self._asleep, **self._policy())(attempt)
        except RetryError:
            return None
        except self.retryable as exc:
            return self._stopped(exc)

    def _stopped(self, exc: BaseException) -> None:
        """reraise=True hands back the last connect error when the stop check ends the
        loop: that is a stop, not a failure."""
        if not self.should_stop():
            raise exc

    def _policy(self) -> dict[str, Any]:
        return {"retry": retry_if_exception_type(self.retryable),
                "wait": wait_random_exponential(multiplier=0.5, max=self.cfg.broker.reconnect_max_s),
                "stop": lambda _state: self.should_stop(), "before_sleep": self._log_attempt,
                "reraise": True}

    def _log_attempt(self, state: Any) -> None:
        self.log.warning("broker_connect_failed", transport=self.transport, what=self.what,
                         broker_url=redact_url(self.cfg.broker.url), attempt=state.attempt_number,
                         error=repr(state.outcome.exception()),
                         retry_in_s=round(state.next_action.sleep, 2))

    def _deadline_passed(self, deadline: float) -> bool:
        return time.monotonic() >= deadline or self.should_stop()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._deadline_passed(deadline):
            time.sleep(min(SYNC_SLEEP_SLICE_S, max(0.0, deadline - time.monotonic())))

    async def _asleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._deadline_passed(deadline):
            await asyncio.sleep(min(ASYNC_SLEEP_SLICE_S, max(0.0, deadline - time.monotonic())))


# -- settling -----------------------------------------------------------------------
def dispatch(handlers: Mapping[Action, Callable[..., T]], settlement: Settlement, *args: Any) -> T:
    """Run the broker operation for ``settlement.action``; ``handlers`` covers every Action
    (checked once by ``complete``), so an unknown action is a bug, not a silent no-op."""
    return handlers[settlement.action](*args, settlement)


def complete(handlers: Mapping[Action, T]) -> Mapping[Action, T]:
    """Fail when the transport is built, not at the first settle, if it forgot an Action."""
    missing = set(Action) - set(handlers)
    if missing:
        raise TypeError(f"settlement handlers missing for {sorted(a.value for a in missing)}")
    return handlers


def task_id_of(delivery: Delivery, settlement: Settlement, fallback: str = "") -> str:
    """The id a forwarded copy is published under: the parsed task's, else the broker's."""
    task = settlement.task
    if task is not None and task.task_id:
        return task.task_id
    return delivery.message_id or fallback


def event_outcome(delivery: Delivery, settlement: Settlement, error: str | None, log: Logger,
                  transport: str) -> Settlement:
    """How an ACK / SKIP that carried a result event ends: itself once the event is
    confirmed (``error`` None); else the delivery goes back (logged), and its redelivery
    (a duplicate, no fetch) announces the stored row again."""
    if error is None:
        return replace(settlement, event=None)
    task = settlement.task
    log.warning("event_unconfirmed", transport=transport, task_id=task_id_of(delivery, settlement),
                url=task.url if task is not None else "", attempt=delivery.attempt, error=error)
    return Settlement(Action.RELEASE, reason=EVENT_UNCONFIRMED, error=error, task=task)


# -- forwarded copies ----------------------------------------------------------------
def header_value(text: Any, limit: int = MAX_HEADER_CHARS) -> str:
    """One short line: NATS headers cannot hold newlines, and neither broker needs a
    traceback-sized value in every copy of a message."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def forward_headers(delivery: Delivery, settlement: Settlement, attempt: int) -> dict[str, Any]:
    """Our headers on a copy sent to a retry tier or the dead queue/stream (RabbitMQ 4.x
    ignores a client-supplied x-death, so the attempt count travels in our own header)."""
    return {ATTEMPT_HEADER: attempt, ERROR_HEADER: header_value(settlement.error),
            REASON_HEADER: header_value(settlement.reason), ORIGIN_HEADER: delivery.origin}
