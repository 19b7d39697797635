"""The small delivery interface the worker loop talks to.

A transport owns its broker client and its I/O thread (the worker's main thread).
The worker loop only calls ``poll`` from that thread; pool threads only call
``settle``, which every transport must make thread-safe by handing the operation
to its I/O loop (pika: ``add_callback_threadsafe``; asyncio: ``call_soon_threadsafe``).
"""
from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from crawld.task import Task

ATTEMPT_HEADER = "x-crawld-attempt"
ERROR_HEADER = "x-crawld-error"
ORIGIN_HEADER = "x-crawld-origin"
REASON_HEADER = "x-crawld-reason"
MAX_HEADER_CHARS = 512


class TopologyError(RuntimeError):
    """The broker refused our queues/streams/consumer: retrying cannot help (boot error)."""


class Action(enum.Enum):
    ACK = "ack"          # stored a result: done
    SKIP = "skip"        # stored a skipped result: AMQP ack, JetStream term
    RETRY = "retry"      # attempt row stored: delayed redelivery outside the main path
    DEAD = "dead"        # dead row stored: publish to the dead queue/stream, then ack/term
    RELEASE = "release"  # never started (drain): give back at once, no attempt used
    DEFER = "defer"      # a worker fault (disk, store, network): back after delay_s, no attempt used


EVENT_TIMEOUT_S = 20.0      # how long a stored task waits for its event's confirm before release
EVENT_UNCONFIRMED = "event_unconfirmed"    # the reason of such a release


@dataclass(frozen=True)
class ResultEvent:
    """The result event of a stored task (``output.events``), settled with its delivery."""

    task_id: str
    status: str            # the AMQP routing key / the JetStream subject's last token
    body: bytes


@dataclass(frozen=True)
class Settlement:
    action: Action
    delay_s: float = 0.0
    reason: str = ""
    error: str = ""
    task: Task | None = None   # the parsed task, when there is one (dead/retry republish)
    # ACK / SKIP only. The transport publishes it on the delivery's own connection and acks
    # once the broker confirmed it (publisher confirm, PubAck); nacked, refused or not
    # confirmed within EVENT_TIMEOUT_S, it gives the delivery back instead (RELEASE,
    # EVENT_UNCONFIRMED) and the redelivery, a duplicate, announces the stored row again.
    event: ResultEvent | None = None


@dataclass
class Delivery:
    """One message as the worker sees it. ``handle`` is the transport's own."""

    body: bytes
    message_id: str | None
    attempt: int                 # 1 for the first try; AMQP: our header, JetStream: num_delivered
    redelivered: bool            # a hint for metrics and the crash-loop guard, never for dedup
    origin: str                  # queue or subject it came from
    handle: Any
    headers: dict[str, Any] = field(default_factory=dict)
    stream_seq: int | None = None
    broker_redeliveries: int | None = None   # when the broker counts them (quorum x-delivery-count)
    received_at: float = field(default_factory=time.monotonic)
    # The parsed body, kept by the first parse (the worker's site gate, on the I/O thread)
    # so the handler does not parse it again.
    task: Task | None = field(default=None, repr=False, compare=False)


DeliveryCallback = Callable[[Delivery], None]


class Transport(abc.ABC):
    """Consumer side of a broker, used by one worker process."""

    name: str = "?"
    # True when Delivery.attempt already counts crash redeliveries (JetStream num_delivered);
    # False when the worker must count them itself (classic AMQP queues keep no counter).
    counts_deliveries: bool = True

    @abc.abstractmethod
    def connect(self) -> None:
        """Connect (retrying with backoff until ``should_stop``), declare topology."""

    @abc.abstractmethod
    def start_consuming(self, on_delivery: DeliveryCallback, free_slots: Callable[[], int]) -> None:
        """Begin delivering to ``on_delivery`` (called on the I/O thread).

        ``free_slots`` says how many more deliveries the worker can start now; a pull
        transport fetches no more than that, a push transport relies on its prefetch.
        """

    @abc.abstractmethod
    def poll(self, timeout: float) -> None:
        """Service the connection for up to ``timeout`` seconds: heartbeats, deliveries,
        queued settlements, in-progress signals, reconnects."""

    @abc.abstractmethod
    def settle(self, delivery: Delivery, settlement: Settlement) -> None:
        """Thread-safe: queue the broker side of a finished delivery on the I/O loop."""

    @abc.abstractmethod
    def stop_consuming(self) -> None:
        """Stop taking new deliveries; keep the connection serviced for pending settles."""

    @abc.abstractmethod
    def pending_settlements(self) -> int:
        """Settlements queued but not yet sent to the broker."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close cleanly; whatever is unsettled goes back to the broker."""

    def set_reconnect_listener(self, on_reconnect: Callable[[], None]) -> None:
        """Called on the I/O thread each time a lost connection has been re-established."""
        self._on_reconnect = on_reconnect

    def reconnected(self) -> None:
        """Transports call this after a successful reconnect (not the first connect)."""
        listener = getattr(self, "_on_reconnect", None)
        if listener is not None:
            listener()

    def set_giveback_listener(self, on_giveback: Callable[[list[Delivery]], None]) -> None:
        """Called on the I/O thread with the deliveries a lost connection or a close handed
        back to the broker unsettled: their redelivery is not the task's fault."""
        self._on_giveback = on_giveback

    def gave_back(self, deliveries: Iterable[Delivery]) -> None:
        listener = getattr(self, "_on_giveback", None)
        given = list(deliveries)
        if listener is not None and given:
            listener(given)

    def set_take_back(self, take_back: Callable[[Callable[[Delivery], bool]], list[Delivery]]) -> None:
        """How the transport gets back deliveries the worker holds but has not started
        (those that match a predicate), e.g. a shard's while it is handed over."""
        self._take_back = take_back

    def take_back(self, matches: Callable[[Delivery], bool]) -> list[Delivery]:
        take_back = getattr(self, "_take_back", None)
        return take_back(matches) if take_back is not None else []

    def set_settled_listener(self, on_settled: Callable[[Delivery, Settlement], None]) -> None:
        """Called on the I/O thread with how a delivery whose ACK / SKIP carried an event
        ended: that ack once the event was confirmed, or the RELEASE that replaced it (the
        worker counts those outcomes here, not when its pool thread handed them over)."""
        self._on_settled = on_settled

    def event_settled(self, delivery: Delivery, settlement: Settlement) -> None:
        listener = getattr(self, "_on_settled", None)
        if listener is not None:
            listener(delivery, settlement)

    def set_shard_listener(self, on_acquired: Callable[[int], None]) -> None:
        """Called on the I/O thread when a shard starts delivering to this worker (again)."""
        self._on_shard = on_acquired

    def shard_acquired(self, shard: int) -> None:
        listener = getattr(self, "_on_shard", None)
        if listener is not None:
            listener(shard)

    def set_stop_check(self, should_stop: Callable[[], bool]) -> None:
        """Lets ``connect`` give up its backoff loop when the worker is told to stop."""
        self._should_stop = should_stop

    def should_stop(self) -> bool:
        check = getattr(self, "_should_stop", None)
        return bool(check and check())

    @property
    def connected(self) -> bool:
        return True

    def owned_shards(self) -> list[int]:
        """The shards this worker serves now (empty when the work is not partitioned)."""
        return []

    @property
    def handovers(self) -> int:
        """Shards this worker handed to another one so far (rebalance, drain)."""
        return 0


@dataclass
class PublishReport:
    confirmed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)   # task_id -> reason

    def merge(self, other: "PublishReport") -> None:
        self.confirmed.extend(other.confirmed)
        self.failed.update(other.failed)


ProgressCallback = Callable[[int, int], None]   # (done so far, total)


class Publisher(abc.ABC):
    """Publishing side: durable, confirmed, deduplicated by task id."""

    @abc.abstractmethod
    def publish(self, tasks: Sequence[Task], progress: ProgressCallback | None = None,
                attempt_reset: bool = False) -> PublishReport:
        """Publish persistent messages; report which were confirmed by the broker."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tier_for(delay_s: float, tiers: Iterable[float]) -> float:
    """The smallest configured tier >= delay (or the largest tier if none is)."""
    ordered = sorted(tiers)
    for tier in ordered:
        if tier >= delay_s:
            return tier
    return ordered[-1]


EVENTS_EXCHANGE = "crawl.events"       # AMQP topic exchange, routing key = result status
EVENTS_STREAM = "CRAWL_EVENTS"         # JetStream stream on crawl.event.>
EVENTS_SUBJECT_PREFIX = "crawl.event."
