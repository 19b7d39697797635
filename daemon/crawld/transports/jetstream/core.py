"""NATS JetStream transport on nats-py: a durable pull consumer on a WorkQueue stream.

Topology: stream ``CRAWL`` (``crawl.url.<source>``, WorkQueue, file storage) and dead
stream ``CRAWL_DEAD`` (``crawl.dead.<source>``, Limits, kept long). One durable pull
consumer per job (``queue.name``), shared by every worker: the consumer on the server
holds the position, the pending acks and the delivery counts, never the worker.

Threading: the transport owns a private asyncio loop that only runs inside ``connect``,
``poll`` and ``close`` (the worker's main thread). A pull task and an in-progress ticker
live on that loop. Pool threads call ``settle``, which only hands the work to the loop
with ``call_soon_threadsafe``; it is executed during the next ``poll``.

Unlike AMQP delivery tags, JetStream acks are published to the message's reply
subject (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...``), which does not belong
to a connection: an ack sent after nats-py transparently reconnected is still valid and
saves a duplicate fetch. Only deliveries from a connection object we gave up on and
replaced are dropped on settle (the server redelivers them after AckWait).

``max_deliver`` on the consumer is unlimited (-1) on purpose: our worker dead-letters at
``queue.max_deliver`` itself (publish to ``CRAWL_DEAD``, then term). A server-side limit
would strand a message whose last delivery crashed the worker in the WorkQueue stream
forever: never redelivered, never dead-lettered, invisible to reconciliation.
Note that ``num_delivered`` (our ``Delivery.attempt``) counts every delivery, releases
(nak at drain) included: keep prefetch near the thread count so releases stay rare.

Terminal replies (ack, nak, term) are sent as requests ("double ack"): the server answers
once it has recorded them, so ``pending_settlements() == 0`` means the broker has them.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import nats
import nats.errors
import nats.js.errors as jse
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, ReplayPolicy,
                         RetentionPolicy, StorageType, StreamConfig)
from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, wait_random_exponential

from crawld.config import Config, redact_url
from crawld.task import Task, safe_source
from crawld.transports.base import (ATTEMPT_HEADER, ERROR_HEADER, ORIGIN_HEADER, REASON_HEADER, Action, Delivery,
                   DeliveryCallback, ProgressCallback, PublishReport, Publisher, Settlement,
                   TopologyError, Transport, truncate)

log = structlog.get_logger("crawld.jetstream")

STREAM = "CRAWL"
DEAD_STREAM = "CRAWL_DEAD"
WORK_PREFIX = "crawl.url."
DEAD_PREFIX = "crawl.dead."
WORK_FILTER = WORK_PREFIX + ">"
DEAD_FILTER = DEAD_PREFIX + ">"
MSG_ID_HEADER = "Nats-Msg-Id"

# Safety nets, not the normal path: the work stream rejects new publishes when full
# (DiscardPolicy.NEW, so the publisher sees a failure and the outbox resends later)
# instead of silently dropping queued tasks; a task older than two weeks is expired and
# shows up as lost in reconciliation.
WORK_MAX_AGE_S = 14 * 86400.0
WORK_MAX_BYTES = 4 << 30
DEAD_MAX_AGE_S = 30 * 86400.0
DEAD_MAX_BYTES = 1 << 30

API_TIMEOUT_S = 5.0          # JetStream API requests and dead-letter PubAcks
FETCH_EXPIRY_S = 1.0         # short pull requests: a restarted server is noticed within ~1 s
MAX_FETCH_BATCH = 256
DEAD_RETRY_DELAY_S = 5.0     # nak delay when the dead-letter publish failed
RECONNECT_BASE_S = 0.1       # first reconnect delay ceiling; doubles per failed attempt

RETRYABLE = (OSError, asyncio.TimeoutError, nats.errors.Error)

T = TypeVar("T")




# -- naming and topology -------------------------------------------------------------
def work_subject(source: str) -> str:
    """Subjects carry the source, never the URL (URLs would break subject tokens)."""
    return WORK_PREFIX + safe_source(source)


def dead_subject(source: str) -> str:
    return DEAD_PREFIX + safe_source(source)


def work_stream_config(cfg: Config) -> StreamConfig:
    return StreamConfig(
        name=STREAM, subjects=[WORK_FILTER], retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE, num_replicas=cfg.queue.replicas,
        duplicate_window=cfg.queue.duplicate_window_s, max_age=WORK_MAX_AGE_S,
        max_bytes=WORK_MAX_BYTES, discard=DiscardPolicy.NEW)


def dead_stream_config(cfg: Config) -> StreamConfig:
    return StreamConfig(
        name=DEAD_STREAM, subjects=[DEAD_FILTER], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, num_replicas=cfg.queue.replicas,
        duplicate_window=min(cfg.queue.duplicate_window_s, DEAD_MAX_AGE_S),
        max_age=DEAD_MAX_AGE_S, max_bytes=DEAD_MAX_BYTES, discard=DiscardPolicy.OLD)


def max_ack_pending(cfg: Config) -> int:
    """Consumer-wide ceiling on unacked messages, shared by every worker on every host.

    Messages waiting out a ``nak(delay=...)`` retry count as ack-pending until they are
    redelivered, so this must leave room for all delayed retries; a small value stalls
    the whole consumer behind them. Each worker bounds its own share by queue.prefetch.
    """
    return max(cfg.queue.max_ack_pending, cfg.queue.prefetch)


def consumer_config(cfg: Config) -> ConsumerConfig:
    name = cfg.queue.name
    return ConsumerConfig(
        name=name, durable_name=name, filter_subject=WORK_FILTER,
        ack_policy=AckPolicy.EXPLICIT, ack_wait=float(cfg.queue.ack_wait_s),
        max_deliver=-1,   # see the module docstring: our code dead-letters at queue.max_deliver
        max_ack_pending=max_ack_pending(cfg), deliver_policy=DeliverPolicy.ALL,
        replay_policy=ReplayPolicy.INSTANT)


STREAM_DRIFT_FIELDS = ("subjects", "retention", "storage", "num_replicas", "duplicate_window",
                       "max_age", "max_bytes", "discard")
CONSUMER_DRIFT_FIELDS = ("filter_subject", "ack_policy", "ack_wait", "max_deliver",
                         "max_ack_pending", "deliver_policy")


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float):
        return round(value, 3)
    return value


def config_drift(have: Any, want: Any, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{field: {"have": ..., "want": ...}}`` for every field that differs."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        h, w = _plain(getattr(have, name, None)), _plain(getattr(want, name, None))
        if h != w:
            out[name] = {"have": h, "want": w}
    return out


async def ensure_stream(js: JetStreamContext, want: StreamConfig) -> None:
    """Create the stream, or bind to it and report (never replace) a differing config."""
    try:
        info = await js.stream_info(want.name)
    except jse.NotFoundError:
        try:
            await js.add_stream(want)
            log.info("jetstream_stream_created", stream=want.name, subjects=want.subjects,
                     replicas=want.num_replicas)
            return
        except jse.BadRequestError as exc:
            # Either another worker won a creation race (then it exists now), or the server
            # refuses it for good (e.g. another stream already owns the subjects).
            info = await _info_or_refuse(js.stream_info(want.name), f"stream {want.name}", exc)
    diffs = config_drift(info.config, want, STREAM_DRIFT_FIELDS)
    if diffs:
        log.warning("jetstream_stream_drift", stream=want.name, diffs=diffs,
                    hint="existing stream kept as is; update it deliberately to apply the config")


async def _info_or_refuse(lookup: Awaitable[T], what: str, exc: jse.APIError) -> T:
    try:
        return await lookup
    except jse.NotFoundError:
        raise TopologyError(f"{what} refused by the server: {exc.description} "
                            f"(err_code {exc.err_code})") from None


async def ensure_streams(js: JetStreamContext, cfg: Config) -> None:
    await ensure_stream(js, work_stream_config(cfg))
    await ensure_stream(js, dead_stream_config(cfg))


async def ensure_consumer(js: JetStreamContext, cfg: Config) -> dict[str, dict[str, Any]]:
    """Create-or-bind the durable; returns the drift (also logged as a warning)."""
    want = consumer_config(cfg)
    try:
        info = await js.consumer_info(STREAM, cfg.queue.name)
    except jse.NotFoundError:
        try:
            await js.add_consumer(STREAM, want)
            log.info("jetstream_consumer_created", stream=STREAM, consumer=cfg.queue.name,
                     ack_wait_s=want.ack_wait, max_ack_pending=want.max_ack_pending)
            return {}
        except jse.BadRequestError as exc:
            try:   # lost a creation race to another worker: bind to its consumer
                info = await js.consumer_info(STREAM, cfg.queue.name)
            except jse.NotFoundError:
                raise TopologyError(await _consumer_refusal(js, cfg, exc)) from None
    diffs = config_drift(info.config, want, CONSUMER_DRIFT_FIELDS)
    if diffs:
        log.warning("jetstream_consumer_drift", stream=STREAM, consumer=cfg.queue.name, diffs=diffs,
                    hint="existing consumer kept as is; delete or update it to apply the config")
    return diffs


async def _consumer_refusal(js: JetStreamContext, cfg: Config, exc: jse.APIError) -> str:
    """Name the consumers that already own the work queue: the usual cause is a renamed
    queue.name (a WorkQueue stream allows one consumer per subject)."""
    try:
        others = [c.name for c in await js.consumers_info(STREAM)]
    except RETRYABLE:
        others = []
    return (f"stream {STREAM} refused durable consumer {cfg.queue.name!r}: {exc.description} "
            f"(err_code {exc.err_code}). Existing consumers: {others or 'unknown'}. A WorkQueue "
            f"stream allows one consumer per subject: set queue.name to the existing one, or "
            f"delete that consumer deliberately.")


# -- connection ----------------------------------------------------------------------
def _servers(cfg: Config) -> list[str]:
    return [url.strip() for url in cfg.broker.url.split(",") if url.strip()]


def _reconnect_handler(cap_s: float) -> Callable[[list[Any], dict[str, Any]], tuple[Any, float]]:
    """nats-py's own reconnect waits a fixed time; we want capped, jittered exponential.

    nats-py calls this before each reconnect attempt with per-server attempt counts; we
    pick the least-tried server and a full-jitter delay.
    """
    def choose(servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        server = min(servers, key=lambda s: s.reconnects)
        ceiling = min(cap_s, RECONNECT_BASE_S * (2 ** min(server.reconnects, 20)))
        return server, random.uniform(0, ceiling)
    return choose


async def open_connection(cfg: Config, name: str, **callbacks: Any) -> Client:
    """One connection attempt (each server tried twice); never gives up once connected."""
    nc = await nats.connect(
        servers=_servers(cfg), name=name, allow_reconnect=True,
        # Initial connect: fail fast so our tenacity loop owns the backoff and the stop check.
        max_reconnect_attempts=1, reconnect_time_wait=0.05, connect_timeout=2,
        ping_interval=cfg.broker.heartbeat_s or 120, max_outstanding_pings=2,
        reconnect_to_server_handler=_reconnect_handler(cfg.broker.reconnect_max_s), **callbacks)
    # Once connected, reconnect forever: a worker must not silently end up without a broker.
    nc.options["max_reconnect_attempts"] = -1
    return nc


async def retry_with_backoff(cfg: Config, should_stop: Callable[[], bool], what: str,
                             attempt: Callable[[], Awaitable[T]]) -> T | None:
    """Run ``attempt`` until it succeeds; jittered exponential waits, capped; None if stopped."""
    async def _sleep(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not should_stop():
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _log_attempt(state: Any) -> None:
        log.warning("broker_connect_failed", transport="jetstream", what=what,
                    broker_url=redact_url(cfg.broker.url), attempt=state.attempt_number,
                    error=repr(state.outcome.exception()), retry_in_s=round(state.next_action.sleep, 2))

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(RETRYABLE),
        wait=wait_random_exponential(multiplier=0.5, max=cfg.broker.reconnect_max_s),
        stop=lambda _state: should_stop(), sleep=_sleep, before_sleep=_log_attempt, reraise=True)
    try:
        return await retrying(attempt)
    except RetryError:
        return None
    except RETRYABLE:
        if should_stop():
            return None
        raise


async def _close_quietly(nc: Client | None, timeout: float = 2.0) -> None:
    if nc is None or nc.is_closed:
        return
    try:
        if nc.is_connected:
            await nc.flush(timeout=timeout)   # acks/naks are fire-and-forget: push them out
    except RETRYABLE:
        pass
    try:
        await asyncio.wait_for(nc.close(), timeout)
    except RETRYABLE:
        pass


def _header_value(text: Any) -> str:
    """Header values are single-line strings; keep them short."""
    return truncate(" ".join(str(text).split()))


# -- consumer ------------------------------------------------------------------------
@dataclass
class _Held:
    """A delivery handed to the worker and not yet settled."""

    msg: Msg
    delivery: Delivery
    generation: int
    last_signal: float          # monotonic time of delivery or of the last in_progress
    settling: bool = False


class JetStreamTransport(Transport):
    name = "jetstream"
    counts_deliveries = True   # num_delivered comes from the server: no attempt header needed

    def __init__(self, cfg: Config, worker_id: str) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self._loop = asyncio.new_event_loop()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._psub: Any = None
        self._generation = 0
        self._on_delivery: DeliveryCallback | None = None
        self._free_slots: Callable[[], int] = lambda: 0
        self._consuming = False
        self._closed = False
        self._closing = False
        self._rebind = False
        self._pull_task: asyncio.Task[None] | None = None
        self._ticker_task: asyncio.Task[None] | None = None
        self._settle_tasks: set[asyncio.Task[None]] = set()
        self._held: dict[int, _Held] = {}          # id(msg) -> held; the entry keeps msg alive
        self._backlog: deque[Msg] = deque()        # fetched beyond the free slots (rare)
        self._backlog_signal = 0.0
        self._pull_deadline = 0.0                  # when our last pull request expires
        self._wake = asyncio.Event()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.reconnects = 0
        self.drift: dict[str, dict[str, Any]] = {}

    # -- connection life cycle --------------------------------------------------------
    def connect(self) -> None:
        """Blocking: connect, declare streams, create-or-bind the durable, subscribe."""
        ok = self._run(retry_with_backoff(self.cfg, self.should_stop, "consumer", self._open))
        if ok is None:
            log.info("broker_connect_abandoned", transport="jetstream", reason="stopping")
            return
        self._generation += 1
        log.info("broker_connected", transport="jetstream", broker_url=redact_url(self.cfg.broker.url),
                 stream=STREAM, consumer=self.cfg.queue.name, generation=self._generation,
                 ack_wait_s=self.cfg.queue.ack_wait_s)
        if self._consuming:
            self._start_tasks()

    async def _open(self) -> bool:
        nc = await open_connection(
            self.cfg, f"crawld-worker {self.worker_id}", error_cb=self._on_error,
            disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
            closed_cb=self._on_closed)
        try:
            js = nc.jetstream(timeout=API_TIMEOUT_S)
            await ensure_streams(js, self.cfg)
            self.drift = await ensure_consumer(js, self.cfg)
            psub = await js.pull_subscribe_bind(durable=self.cfg.queue.name, stream=STREAM)
        except BaseException:
            await _close_quietly(nc)
            raise
        self._nc, self._js, self._psub = nc, js, psub
        return True

    async def _on_error(self, exc: Exception) -> None:
        log.warning("broker_error", transport="jetstream", error=repr(exc))

    async def _on_disconnected(self) -> None:
        if self._closed:
            return      # our own close(): not news
        log.warning("broker_disconnected", transport="jetstream", unsettled=len(self._held),
                    broker_url=redact_url(self.cfg.broker.url))

    async def _on_reconnected(self) -> None:
        # The server may have restarted (or lost its store): re-check topology before pulling.
        self.reconnects += 1
        self._rebind = True
        nc = self._nc
        log.info("broker_reconnected", transport="jetstream", unsettled=len(self._held),
                 server=nc.connected_url.netloc if nc and nc.connected_url else None)

    async def _on_closed(self) -> None:
        if not self._closed:
            log.warning("broker_connection_closed", transport="jetstream", unsettled=len(self._held))

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def start_consuming(self, on_delivery: DeliveryCallback, free_slots: Callable[[], int]) -> None:
        self._on_delivery = on_delivery
        self._free_slots = free_slots
        self._consuming = True
        if self._nc is not None:
            self._start_tasks()

    def _start_tasks(self) -> None:
        if self._pull_task is None or self._pull_task.done():
            self._pull_task = self._loop.create_task(self._pull_loop())
        if self._ticker_task is None or self._ticker_task.done():
            self._ticker_task = self._loop.create_task(self._progress_loop())

    def stop_consuming(self) -> None:
        """No new pulls. What the pull in flight still brings is handed to the worker if it
        has room (a release would count as a redelivery caused by the stop); the rest is
        released by close()."""
        self._consuming = False
        self._wake.set()

    def poll(self, timeout: float) -> None:
        if self._closed:
            time.sleep(timeout)
            return
        if self._nc is None or self._nc.is_closed:
            if self.should_stop() and not self._consuming:
                time.sleep(timeout)
                return
            self._lost("connection closed")
            self.connect()
            return
        self._run(asyncio.sleep(timeout))

    def _run(self, coro: Awaitable[T]) -> T:
        return self._loop.run_until_complete(coro)

    def _lost(self, why: str) -> None:
        """Give up on a closed connection object; its deliveries come back after AckWait."""
        log.warning("broker_connection_lost", transport="jetstream", reason=why,
                    dropped_unsettled=len(self._held), generation=self._generation)
        self._held.clear()
        self._backlog.clear()
        self._nc = self._js = self._psub = None
        for task in (self._pull_task, self._ticker_task):
            if task is not None:
                task.cancel()
        self._pull_task = self._ticker_task = None

    # -- pulling ------------------------------------------------------------------------
    async def _pull_loop(self) -> None:
        failures = 0
        while self._consuming:
            try:
                await self._pull_once()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:   # keep pulling whatever happens; log and back off
                failures += 1
                delay = random.uniform(0, min(self.cfg.broker.reconnect_max_s, 0.2 * 2 ** min(failures, 10)))
                log.warning("jetstream_pull_failed", error=repr(exc), failures=failures,
                            code=getattr(exc, "code", None), err_code=getattr(exc, "err_code", None),
                            description=getattr(exc, "description", None), retry_in_s=round(delay, 2))
                self._rebind = True
                await asyncio.sleep(delay)

    async def _pull_once(self) -> None:
        slots = self._slots()
        while self._backlog and slots > 0:
            self._dispatch(self._backlog.popleft())
            slots -= 1
        if slots <= 0 or not self.connected:
            await self._wait_wake(0.2)
            return
        if self._rebind:
            await self._bind()
        # nats-py's fetch may leave its server-side pull request open until it expires; close()
        # waits for that before naking, or the naked messages would come straight back to us.
        self._pull_deadline = time.monotonic() + FETCH_EXPIRY_S + 0.05
        try:
            # No idle heartbeat: nats-py 2.16 drops `expires` from a pull when leftovers
            # were already queued but keeps the heartbeat, and the server answers "400
            # heartbeat value too large" -- messages in that pull then wait out AckWait.
            # A 1 s pull notices a restarted server just as well.
            msgs = await self._psub.fetch(min(slots, MAX_FETCH_BATCH), timeout=FETCH_EXPIRY_S)
        except asyncio.TimeoutError:   # nats TimeoutError/FetchTimeoutError: empty queue, normal
            return
        # nats-py may hand back messages left over from an earlier pull: never exceed the slots.
        slots = 0 if self._closing else self._slots()
        for msg in msgs:
            if slots > 0:
                self._dispatch(msg)
                slots -= 1
            else:
                if not self._backlog:
                    self._backlog_signal = time.monotonic()
                self._backlog.append(msg)

    def _slots(self) -> int:
        try:
            return int(self._free_slots())
        except Exception as exc:   # a broken callback must not kill the pull loop
            log.error("free_slots_failed", error=repr(exc))
            return 0

    async def _wait_wake(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    async def _bind(self) -> None:
        """After a reconnect: make sure the stream and durable still exist (a server that lost
        its store comes back empty); the inbox subscription itself is replayed by nats-py."""
        assert self._js is not None
        await ensure_streams(self._js, self.cfg)
        self.drift = await ensure_consumer(self._js, self.cfg)
        self._rebind = False
        log.info("jetstream_consumer_bound", consumer=self.cfg.queue.name, stream=STREAM)

    def _dispatch(self, msg: Msg) -> None:
        md = msg.metadata
        headers = dict(msg.headers or {})
        delivery = Delivery(body=msg.data, message_id=headers.get(MSG_ID_HEADER),
                            attempt=md.num_delivered, redelivered=md.num_delivered > 1,
                            origin=msg.subject, handle=msg, headers=headers,
                            stream_seq=md.sequence.stream)
        self._held[id(msg)] = _Held(msg, delivery, self._generation, time.monotonic())
        try:
            assert self._on_delivery is not None
            self._on_delivery(delivery)
        except Exception as exc:   # the worker could not take it: give it back at once
            log.error("delivery_callback_failed", error=repr(exc), stream_seq=delivery.stream_seq)
            self._held.pop(id(msg), None)
            self._spawn(self._safe(msg.nak(), "nak"))

    # -- in progress ------------------------------------------------------------------
    async def _progress_loop(self) -> None:
        """One ticker for all unsettled deliveries: +WPI about every ack_wait/3, so slow
        fetches and deliveries queued in the pool never outlive AckWait."""
        every = self.cfg.queue.ack_wait_s / 3.0
        while True:
            await asyncio.sleep(max(0.05, min(every / 2.0, 1.0)))
            if not self.connected:
                continue    # sent after the reconnect instead of piling up in the buffer
            now = time.monotonic()
            for held in list(self._held.values()):
                if now - held.last_signal >= every:
                    held.last_signal = now
                    await self._safe(held.msg.in_progress(), "in_progress")
            if self._backlog and now - self._backlog_signal >= every:
                # Not handed out yet, but naking them would burn a delivery attempt.
                self._backlog_signal = now
                for msg in list(self._backlog):
                    await self._safe(msg.in_progress(), "in_progress")

    async def _safe(self, coro: Awaitable[Any], what: str) -> None:
        try:
            await coro
        except (nats.errors.Error, OSError) as exc:
            log.warning("jetstream_reply_failed", what=what, error=repr(exc))

    # -- settling -----------------------------------------------------------------------
    def pending_settlements(self) -> int:
        """Queued settles, plus the last pull request while it may still bring messages:
        a draining worker waits for both before it calls close()."""
        with self._pending_lock:
            pending = self._pending
        pulling = not self._consuming and self._pull_task is not None and not self._pull_task.done()
        return pending + int(pulling)

    def settle(self, delivery: Delivery, settlement: Settlement) -> None:
        """Thread-safe: the broker side runs on the loop during the next poll()."""
        with self._pending_lock:
            self._pending += 1
        try:
            self._loop.call_soon_threadsafe(self._start_settle, delivery, settlement)
        except RuntimeError as exc:   # loop closed: the transport is gone
            self._done_pending()
            log.warning("settle_dropped", transport="jetstream", reason="transport closed",
                        error=str(exc), message_id=delivery.message_id, action=settlement.action.value)

    def _start_settle(self, delivery: Delivery, settlement: Settlement) -> None:
        self._spawn(self._settle_now(delivery, settlement))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = self._loop.create_task(coro)  # type: ignore[arg-type]
        self._settle_tasks.add(task)
        task.add_done_callback(self._settle_tasks.discard)

    def _done_pending(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    async def _settle_now(self, delivery: Delivery, settlement: Settlement) -> None:
        try:
            held = self._held.get(id(delivery.handle))
            if held is None or held.msg is not delivery.handle or held.generation != self._generation \
                    or held.settling:
                # Released at close, from a replaced connection, or settled twice: the
                # server already has (or will redeliver) it.
                log.info("stale_delivery_dropped", transport="jetstream", message_id=delivery.message_id,
                         stream_seq=delivery.stream_seq, action=settlement.action.value,
                         reason="settled twice" if held is not None and held.settling else "unknown delivery",
                         generation=self._generation)
                return
            held.settling = True    # stays held (and in progress) until the broker has it
            try:
                await self._apply(held, settlement)
            finally:
                self._held.pop(id(held.msg), None)
        except Exception as exc:   # never lose the task silently: it comes back after AckWait
            log.warning("settle_failed", transport="jetstream", message_id=delivery.message_id,
                        action=settlement.action.value, error=repr(exc))
        finally:
            self._done_pending()
            self._wake.set()

    async def _apply(self, held: _Held, settlement: Settlement) -> None:
        msg, action = held.msg, settlement.action
        if action is Action.ACK:
            await self._reply(msg, Msg.Ack.Ack, settlement)
        elif action is Action.SKIP:
            await self._reply(msg, Msg.Ack.Term, settlement)
        elif action is Action.RETRY:
            await self._reply(msg, _nak_payload(settlement.delay_s), settlement)
        elif action is Action.RELEASE:
            await self._reply(msg, Msg.Ack.Nak, settlement)
        elif action is Action.DEAD:
            await self._dead_letter(held.delivery, settlement, msg)

    async def _reply(self, msg: Msg, payload: bytes, settlement: Settlement) -> None:
        """Double ack: the server answers once it has recorded the ack/nak/term, so
        ``pending_settlements() == 0`` means the broker has every settlement (drain,
        status and reconciliation see consistent numbers). While disconnected the
        request stays in nats-py's buffer and is sent after the reconnect; if it is lost
        anyway the server redelivers: a duplicate, never a loss."""
        nc = self._nc
        if nc is None or nc.is_closed:
            raise nats.errors.ConnectionClosedError
        try:
            await nc.request(msg.reply, payload, timeout=API_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("settle_unconfirmed", transport="jetstream", action=settlement.action.value,
                        stream_seq=msg.metadata.sequence.stream, connected=self.connected)
        msg._ackd = True   # keep nats-py's own guard (MsgAlreadyAckdError) consistent

    async def _dead_letter(self, delivery: Delivery, settlement: Settlement, msg: Msg) -> None:
        """Publish to crawl.dead.<source>, wait for the PubAck, only then term the original."""
        if self._js is None:
            raise nats.errors.ConnectionClosedError
        task_id = _task_id(delivery, settlement.task)
        subject = dead_subject(_source(delivery, settlement.task))
        headers = {k: v for k, v in delivery.headers.items() if not k.startswith("Nats-")}
        headers.update({
            MSG_ID_HEADER: f"{task_id}:dead:{delivery.attempt}",
            ATTEMPT_HEADER: str(delivery.attempt), ERROR_HEADER: _header_value(settlement.error),
            REASON_HEADER: _header_value(settlement.reason), ORIGIN_HEADER: delivery.origin})
        try:
            ack = await self._js.publish(subject, delivery.body, timeout=API_TIMEOUT_S, headers=headers)
        except (asyncio.TimeoutError, nats.errors.Error, OSError) as exc:
            log.error("dead_letter_failed", task_id=task_id, subject=subject, attempt=delivery.attempt,
                      error=repr(exc), retry_in_s=DEAD_RETRY_DELAY_S)
            # Keep it in CRAWL (nothing is lost); the worker dead-letters it again later.
            await self._reply(msg, _nak_payload(DEAD_RETRY_DELAY_S), settlement)
            return
        await self._reply(msg, Msg.Ack.Term, settlement)
        log.info("dead_lettered", task_id=task_id, subject=subject, dead_seq=ack.seq,
                 duplicate=bool(ack.duplicate), attempt=delivery.attempt, reason=settlement.reason)

    # -- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Release (nak) whatever was delivered but never settled, flush, close."""
        if self._closed:
            return
        self._consuming = False
        self._closing = True
        try:
            self._run(self._shutdown())
        finally:
            self._closed = True
            self._finish_loop()

    def abort(self) -> None:
        """Close without releasing anything, as a crash would (fast stop, tests): the server
        redelivers the unsettled deliveries after AckWait."""
        if self._closed:
            return
        self._consuming = False
        self._closed = True
        self._held.clear()
        self._backlog.clear()
        try:
            if self._nc is not None:
                self._run(asyncio.wait_for(self._nc.close(), 2.0))
        except RETRYABLE:
            pass
        finally:
            self._finish_loop()

    async def _shutdown(self) -> None:
        if self._pull_task is not None and not self._pull_task.done():
            self._wake.set()
            try:   # the pull in flight ends by itself within its expiry: nothing orphaned
                await asyncio.wait_for(asyncio.shield(self._pull_task), FETCH_EXPIRY_S + 1.0)
            except (asyncio.TimeoutError, Exception):
                self._pull_task.cancel()
        if self._settle_tasks:
            await asyncio.wait(list(self._settle_tasks), timeout=API_TIMEOUT_S + 1.0)
        # No pull request of ours may be open when we nak: the server would hand the
        # released messages right back to this closing subscription (then AckWait).
        await asyncio.sleep(max(0.0, self._pull_deadline - time.monotonic()))
        await self._release_all()
        self._closed = True
        await _close_quietly(self._nc)

    async def _release_all(self) -> None:
        held = [h.msg for h in self._held.values() if not h.settling]
        leftovers = self._drain_subscription()
        await self._release(held + list(self._backlog) + leftovers)
        if held or leftovers:
            log.info("unsettled_released", transport="jetstream", unsettled=len(held),
                     undelivered=len(leftovers))
        self._held.clear()
        self._backlog.clear()

    async def _release(self, msgs: list[Msg]) -> None:
        """Nak at once (redelivered now, not after AckWait), all in parallel, and wait for
        the server's answers so close() returns with the broker up to date."""
        nc = self._nc
        if not msgs or nc is None or not nc.is_connected:
            return   # gone anyway: the server redelivers after AckWait
        replies = [nc.request(m.reply, Msg.Ack.Nak, timeout=2.0) for m in msgs if m.reply]
        results = await asyncio.gather(*replies, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning("release_unconfirmed", transport="jetstream", count=len(failed),
                        error=repr(failed[0]))

    def _drain_subscription(self) -> list[Msg]:
        """Messages that arrived for an expired pull but were never returned by fetch()."""
        queue = getattr(getattr(self._psub, "_sub", None), "_pending_queue", None)
        out: list[Msg] = []
        while queue is not None and not queue.empty():
            msg = queue.get_nowait()
            if msg.reply and not JetStreamContext.is_status_msg(msg):
                out.append(msg)
        return out

    def _finish_loop(self) -> None:
        pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()
        self._nc = self._js = self._psub = None


def _nak_payload(delay_s: float) -> bytes:
    """``-NAK {"delay": ns}``: a delayed redelivery outside the main path (no sleeping)."""
    if delay_s <= 0:
        return Msg.Ack.Nak
    return Msg.Ack.Nak + b" " + json.dumps({"delay": int(delay_s * 1e9)}).encode()


def _task_id(delivery: Delivery, task: Task | None) -> str:
    if task is not None and task.task_id:
        return task.task_id
    return delivery.message_id or f"{STREAM}-seq-{delivery.stream_seq}"


def _source(delivery: Delivery, task: Task | None) -> str:
    if task is not None and task.source:
        return task.source
    token = delivery.origin.rsplit(".", 1)[-1] if delivery.origin.startswith(WORK_PREFIX) else ""
    return token or "unknown"


# -- publisher --------------------------------------------------------------------------
class JetStreamPublisher(Publisher):
    """``js.publish`` with ``Nats-Msg-Id`` = task id; ``window`` PubAcks in flight at once.

    A PubAck (duplicate or not) means the stream holds the task: confirmed. Timeouts and
    errors go to ``failed``; the outbox resends them later (the id makes that safe).
    """

    def __init__(self, cfg: Config, window: int = 500, timeout_s: float = 10.0,
                 declare: bool = True) -> None:
        self.cfg = cfg
        self.window = max(1, window)
        self.timeout_s = timeout_s
        self.declare = declare
        self.duplicates = 0          # PubAcks with duplicate=True in the last publish()
        self._loop = asyncio.new_event_loop()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None

    def publish(self, tasks: Sequence[Task], progress: ProgressCallback | None = None,
                attempt_reset: bool = False) -> PublishReport:
        if not tasks:
            return PublishReport()
        return self._loop.run_until_complete(self._publish_all(list(tasks), progress, attempt_reset))

    async def _connect(self) -> JetStreamContext:
        if self._js is None or self._nc is None or self._nc.is_closed:
            self._nc = await open_connection(self.cfg, "crawld-publisher", error_cb=self._on_error)
            self._js = self._nc.jetstream(timeout=API_TIMEOUT_S)
            if self.declare:
                await ensure_streams(self._js, self.cfg)
        return self._js

    async def _on_error(self, exc: Exception) -> None:
        log.warning("broker_error", transport="jetstream", role="publisher", error=repr(exc))

    async def _publish_all(self, tasks: list[Task], progress: ProgressCallback | None,
                           attempt_reset: bool) -> PublishReport:
        report = PublishReport()
        self.duplicates = 0
        try:
            js = await self._connect()
        except (*RETRYABLE, TopologyError) as exc:
            reason = f"connect failed: {exc!r}"
            report.failed.update({t.task_id: reason for t in tasks})
            return report
        # Replays need a fresh id, or the duplicate window would swallow them.
        suffix = f":replay:{int(time.time() * 1000)}" if attempt_reset else ""
        pending = iter(tasks)
        done = 0

        async def lane() -> None:
            nonlocal done
            for task in pending:   # lanes share one iterator: at most `window` in flight
                await self._publish_one(js, task, task.task_id + suffix, report)
                done += 1
                if progress is not None and (done % 200 == 0 or done == len(tasks)):
                    progress(done, len(tasks))

        await asyncio.gather(*(lane() for _ in range(min(self.window, len(tasks)))))
        return report

    async def _publish_one(self, js: JetStreamContext, task: Task, msg_id: str,
                           report: PublishReport) -> None:
        try:
            ack = await js.publish(work_subject(task.source), task.to_body(), timeout=self.timeout_s,
                                   headers={MSG_ID_HEADER: msg_id})
        except asyncio.TimeoutError:
            report.failed[task.task_id] = f"no PubAck within {self.timeout_s:g}s"
        except jse.NoStreamResponseError:
            report.failed[task.task_id] = f"no stream for subject {work_subject(task.source)}"
        except jse.APIError as exc:
            report.failed[task.task_id] = f"rejected: {exc.description} (err_code {exc.err_code})"
        except (nats.errors.Error, OSError) as exc:
            report.failed[task.task_id] = repr(exc)
        else:
            self.duplicates += bool(ack.duplicate)
            report.confirmed.append(task.task_id)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.run_until_complete(_close_quietly(self._nc))
        self._loop.close()
        self._nc = self._js = None


# -- status -------------------------------------------------------------------------------
def jetstream_stats(cfg: Config, timeout_s: float = API_TIMEOUT_S) -> dict[str, Any]:
    """Numbers for ``crawld status``; raises ConnectionError if the server is unreachable."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_stats(cfg, timeout_s))
    finally:
        loop.close()


async def _stats(cfg: Config, timeout_s: float) -> dict[str, Any]:
    try:
        # max_reconnect_attempts=1: nats-py's initial connect otherwise retries a dead
        # server 60 times, 2 s apart, even with allow_reconnect=False.
        nc = await nats.connect(servers=_servers(cfg), name="crawld-status", allow_reconnect=False,
                                max_reconnect_attempts=1, reconnect_time_wait=0.05,
                                connect_timeout=2, error_cb=_quiet_error)
    except RETRYABLE as exc:
        raise ConnectionError(f"cannot reach NATS at {redact_url(cfg.broker.url)}: {exc!r}") from None
    try:
        js = nc.jetstream(timeout=timeout_s)
        out: dict[str, Any] = {"transport": "jetstream", "stream": STREAM, "consumer": cfg.queue.name,
                               "dead_stream": DEAD_STREAM}
        out.update(await _stream_stats(js))
        out.update(await _consumer_stats(js, cfg.queue.name))
        out.update(await _dead_stats(js))
        return out
    finally:
        await _close_quietly(nc)


async def _quiet_error(exc: Exception) -> None:
    log.debug("broker_error", transport="jetstream", role="status", error=repr(exc))


async def _stream_stats(js: JetStreamContext) -> dict[str, Any]:
    try:
        info = await js.stream_info(STREAM)
    except jse.NotFoundError:
        return {"stream_exists": False, "messages": 0, "depth": 0, "bytes": 0, "oldest_waiting_s": None}
    state = info.state
    out = {"stream_exists": True, "messages": state.messages, "depth": state.messages,
           "bytes": state.bytes, "first_seq": state.first_seq, "last_seq": state.last_seq,
           "consumers": state.consumer_count, "oldest_waiting_s": None}
    if state.messages:
        try:   # the first message still in a WorkQueue stream is the oldest unfinished task
            first = await js.get_msg(STREAM, state.first_seq)
            if first.time is not None:
                out["oldest_waiting_s"] = round(max(0.0, time.time() - first.time.timestamp()), 3)
        except (jse.NotFoundError, asyncio.TimeoutError):
            pass   # acked in between: not worth a retry for a status line
    return out


async def _consumer_stats(js: JetStreamContext, name: str) -> dict[str, Any]:
    try:
        info = await js.consumer_info(STREAM, name)
    except jse.NotFoundError:
        return {"consumer_exists": False}
    return {"consumer_exists": True, "num_pending": info.num_pending,
            "num_ack_pending": info.num_ack_pending, "num_redelivered": info.num_redelivered,
            "num_waiting": info.num_waiting,
            "delivered_consumer_seq": info.delivered.consumer_seq if info.delivered else 0,
            "delivered_stream_seq": info.delivered.stream_seq if info.delivered else 0,
            "ack_floor_consumer_seq": info.ack_floor.consumer_seq if info.ack_floor else 0,
            "ack_floor_stream_seq": info.ack_floor.stream_seq if info.ack_floor else 0,
            "ack_wait_s": info.config.ack_wait, "max_ack_pending": info.config.max_ack_pending}


async def _dead_stats(js: JetStreamContext) -> dict[str, Any]:
    try:
        info = await js.stream_info(DEAD_STREAM)
    except jse.NotFoundError:
        return {"dead_messages": 0, "dead_bytes": 0}
    return {"dead_messages": info.state.messages, "dead_bytes": info.state.bytes}
