"""NATS JetStream consumer on nats-py: a durable pull consumer on a WorkQueue stream.

One durable pull consumer per job (``queue.name``), shared by every worker: the consumer
on the server holds the position, the pending acks and the delivery counts, never the
worker. A partitioned fleet (``queue.partition`` host / domain) adds one durable per shard
and routes the intake durable into them (shards.py, leases.py).

Threading: the transport owns a private asyncio loop that only runs inside ``connect``,
``poll`` and ``close`` (the worker's main thread). The pull tasks (one per durable), an
in-progress ticker and, when partitioned, the lease ticker live on that loop. Pool threads call ``settle`` (settle.py), which only hands the work
to the loop with ``call_soon_threadsafe``; it is executed during the next ``poll``.

``max_deliver`` on the consumer is unlimited (-1) on purpose: our worker dead-letters at
``queue.max_deliver`` itself (publish to ``CRAWL_DEAD``, then term). A server-side limit
would strand a message whose last delivery crashed the worker in the WorkQueue stream
forever: never redelivered, never dead-lettered, invisible to reconciliation.
Note that ``num_delivered`` (our ``Delivery.attempt``) counts every delivery, releases
(nak at drain) included: keep prefetch near the thread count so releases stay rare.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from typing import Any, Awaitable, Callable, TypeVar

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from crawld.config import Config, redact_url
from crawld.fleet.partition import shard_pull_cap, shard_window
from crawld.transports.base import Delivery, DeliveryCallback, Transport
from crawld.transports.common import Generations, PendingSettlements, SettleInbox
from crawld.transports.jetstream.connection import (API_TIMEOUT_S, close_quietly, log, open_connection,
                                                    retry_with_backoff)
from crawld.transports.jetstream.events import events_stream_config
from crawld.transports.jetstream.leases import ShardLeases, open_bucket
from crawld.transports.jetstream.pulls import Pull
from crawld.transports.jetstream.replies import Replies
from crawld.transports.jetstream.settle import Held, SettleMixin
from crawld.transports.jetstream.shards import FETCH_EXPIRY_S, MAX_FETCH_BATCH, ShardMixin
from crawld.transports.jetstream.topology import (MSG_ID_HEADER, STREAM, WORK_FILTER, ensure_consumer,
                                                  ensure_stream, ensure_streams, partitioned)

T = TypeVar("T")


class JetStreamTransport(ShardMixin, SettleMixin, Transport):
    name = "jetstream"
    counts_deliveries = True   # num_delivered comes from the server: no attempt header needed

    def __init__(self, cfg: Config, worker_id: str) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self._loop = asyncio.new_event_loop()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._pulls: dict[str, Pull] = {}          # durable name -> its pull (intake first)
        self._generations = Generations(self)
        self._on_delivery: DeliveryCallback | None = None
        self._free_slots: Callable[[], int] = lambda: 0
        self._consuming = False
        self._closed = False
        self._closing = False
        self._ticker_task: asyncio.Task[None] | None = None
        self._settle_tasks: set[asyncio.Task[None]] = set()
        self._inbox = SettleInbox()                # settles queued by pool threads
        self._announcing = 0
        self._replies = Replies()                  # acks and event PubAcks (replies.py)
        self._held: dict[int, Held] = {}           # id(msg) -> held; the entry keeps msg alive
        self._backlog: deque[Msg] = deque()        # fetched beyond the free slots (rare)
        self._backlog_signal = 0.0
        self._wake = asyncio.Event()
        self._pending = PendingSettlements(log, self.name)
        self._handlers = self._settle_handlers()
        self.reconnects = 0
        self.drift: dict[str, dict[str, Any]] = {}
        self._partitioned = partitioned(cfg)
        self._pull_cap = shard_pull_cap(cfg)         # of one shard's pulls (shards.py)
        self._window = shard_window(cfg)             # without a cap, what a shard always may hold
        self._leases = ShardLeases(None, worker_id, cfg.queue.shards, cost=self._inflight_of,
                                     busy=self._busy_shard, on_claimed=self.shard_acquired) \
            if self._partitioned else None
        self._lease_task: asyncio.Task[None] | None = None
        self._grant_task: asyncio.Task[None] | None = None
        self._bucket_rebind = False
        self.routed = 0                            # intake messages routed to their shard

    # -- connection life cycle --------------------------------------------------------
    def connect(self) -> None:
        """Blocking: connect, declare streams, create-or-bind the durable, subscribe."""
        ok = self._run(retry_with_backoff(self.cfg, self.should_stop, "consumer", self._open))
        if ok is None:
            log.info("broker_connect_abandoned", transport="jetstream", reason="stopping")
            return
        generation = self._generations.advance()
        log.info("broker_connected", transport="jetstream", broker_url=redact_url(self.cfg.broker.url),
                 stream=STREAM, consumer=self.cfg.queue.name, generation=generation,
                 ack_wait_s=self.cfg.queue.ack_wait_s)
        if self._consuming:
            self._start_tasks()
        self._generations.ready()   # a new connection object after _lost(): a reconnect

    async def _open(self) -> bool:
        nc = await open_connection(
            self.cfg, f"crawld-worker {self.worker_id}", error_cb=self._on_error,
            disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
            closed_cb=self._on_closed)
        try:
            js = nc.jetstream(timeout=API_TIMEOUT_S)
            await ensure_streams(js, self.cfg)
            if self.cfg.output.events:
                await ensure_stream(js, events_stream_config(self.cfg))
            self.drift = await ensure_consumer(js, self.cfg)
            psub = await js.pull_subscribe_bind(durable=self.cfg.queue.name, stream=STREAM)
            kv = await open_bucket(js, self.cfg.queue.replicas) if self._leases else None
            await self._replies.bind(nc)
        except BaseException:
            await close_quietly(nc)
            raise
        self._nc, self._js = nc, js
        self._pulls = {self.cfg.queue.name: Pull(self.cfg.queue.name, WORK_FILTER, None, psub)}
        if self._leases is not None and kv is not None:
            self._leases.bind(kv)     # leases survive a new connection object; fencing guards them
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
        for pull in self._pulls.values():
            pull.rebind = True
        self._bucket_rebind = True      # a server that lost its store lost the bucket too
        nc = self._nc
        log.info("broker_reconnected", transport="jetstream", unsettled=len(self._held),
                 server=nc.connected_url.netloc if nc and nc.connected_url else None)
        self.reconnected()   # nats-py replaced the socket: same generation, acks stay valid

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
        for pull in self._pulls.values():
            self._start_pull(pull)
        if self._ticker_task is None or self._ticker_task.done():
            self._ticker_task = self._loop.create_task(self._progress_loop())
        if self._leases is not None and (self._lease_task is None or self._lease_task.done()):
            self._lease_task = self._loop.create_task(self._lease_loop())
        if self._leases is not None and (self._grant_task is None or self._grant_task.done()):
            self._grant_task = self._loop.create_task(self._grant_loop())

    def _start_pull(self, pull: Pull) -> None:
        if self._consuming and not pull.stopping and not pull.running:
            pull.task = self._loop.create_task(self._pull_loop(pull))

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
                    dropped_unsettled=len(self._held), generation=self._generations.current)
        self.gave_back(h.delivery for h in self._held.values())
        self._held.clear()
        self._backlog.clear()
        self._nc = self._js = None
        for task in [p.task for p in self._pulls.values()] + [self._ticker_task, self._lease_task,
                                                              self._grant_task]:
            if task is not None:
                task.cancel()
        self._pulls = {}          # their subscriptions died with the connection object
        self._ticker_task = self._lease_task = self._grant_task = None

    # -- pulling ------------------------------------------------------------------------
    async def _pull_loop(self, pull: Pull) -> None:
        failures = 0
        while self._consuming and not pull.stopping:
            try:
                await self._pull_once(pull)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:   # keep pulling whatever happens; log and back off
                failures += 1
                delay = random.uniform(0, min(self.cfg.broker.reconnect_max_s, 0.2 * 2 ** min(failures, 10)))
                log.warning("jetstream_pull_failed", error=repr(exc), failures=failures,
                            consumer=pull.durable, code=getattr(exc, "code", None),
                            err_code=getattr(exc, "err_code", None),
                            description=getattr(exc, "description", None), retry_in_s=round(delay, 2))
                pull.rebind = True
                await asyncio.sleep(delay)

    async def _pull_once(self, pull: Pull) -> None:
        self._pump_backlog()
        if not self.connected:
            await self._wait_wake(0.2)
            return
        if pull.rebind:
            await self._bind(pull)
        if pull.shard is None and self._partitioned:
            await self._route_batch(pull)       # intake: route to shards, never start work
            return
        if pull.shard is not None:
            await self._pull_shard(pull)        # slots granted by ShardMixin._allocate
            return
        free = self._slots() - len(self._backlog)
        if free <= 0:
            await self._wait_wake(0.2)
            return
        self._take(await self._fetch(pull, min(free, MAX_FETCH_BATCH), FETCH_EXPIRY_S))

    async def _fetch(self, pull: Pull, batch: int, expiry: float) -> list[Msg]:
        # nats-py's fetch may leave its server-side pull request open until it expires; close()
        # waits for that before naking, or the naked messages would come straight back to us.
        pull.start_request(expiry)
        try:
            # No idle heartbeat: nats-py 2.16 drops `expires` from a pull when leftovers
            # were already queued but keeps the heartbeat, and the server answers "400
            # heartbeat value too large" -- messages in that pull then wait out AckWait.
            # A 1 s pull notices a restarted server just as well.
            msgs = await pull.psub.fetch(batch, timeout=expiry)
        except asyncio.TimeoutError:   # nats TimeoutError/FetchTimeoutError: empty queue, normal
            msgs = []
        # The server says how many are left after each message: a drained shard goes back
        # to probing instead of holding slots in a pull that would only wait out its expiry.
        pull.pending = msgs[-1].metadata.num_pending if msgs else 0
        return msgs

    def _take(self, msgs: list[Msg]) -> None:
        """Hand what a pull brought to the worker, never more than its free slots (nats-py
        may return leftovers from an earlier pull); the rest waits in the backlog."""
        slots = 0 if self._closing else self._slots()
        for msg in msgs:
            if slots > 0 and self._may_start(msg):
                self._dispatch(msg)
                slots -= 1
            else:
                if not self._backlog:
                    self._backlog_signal = time.monotonic()
                self._backlog.append(msg)

    def _pump_backlog(self) -> None:
        """Backlog first whenever slots free up; a message of a shard we are giving up
        stays parked until that shard's release naks it."""
        if not self._backlog or self._closing:
            return
        slots = self._slots()
        parked: list[Msg] = []
        while self._backlog and slots > 0:
            msg = self._backlog.popleft()
            if self._may_start(msg):
                self._dispatch(msg)
                slots -= 1
            else:
                parked.append(msg)
        self._backlog.extendleft(reversed(parked))

    def _slots(self) -> int:
        """The worker's free slots, less the deliveries whose pool thread is done but whose
        event is not PubAcked yet: queue.prefetch bounds what is held, as with AMQP."""
        try:
            return int(self._free_slots()) - self._announcing
        except Exception as exc:   # a broken callback must not kill the pull loop
            log.error("free_slots_failed", error=repr(exc))
            return 0

    async def _wait_wake(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    async def _bind(self, pull: Pull) -> None:
        """After a reconnect: make sure the stream and durable still exist (a server that lost
        its store comes back empty); the inbox subscription itself is replayed by nats-py."""
        assert self._js is not None
        await ensure_streams(self._js, self.cfg)
        drift = await ensure_consumer(self._js, self.cfg, self._consumer_config(pull))
        if pull.shard is None:
            self.drift = drift
        pull.rebind = False
        log.info("jetstream_consumer_bound", consumer=pull.durable, stream=STREAM)

    def _delivery_of(self, msg: Msg) -> Delivery:
        md = msg.metadata
        headers = dict(msg.headers or {})
        return Delivery(body=msg.data, message_id=headers.get(MSG_ID_HEADER),
                        attempt=md.num_delivered, redelivered=md.num_delivered > 1,
                        origin=msg.subject, handle=msg, headers=headers,
                        stream_seq=md.sequence.stream)

    def _dispatch(self, msg: Msg) -> None:
        delivery = self._delivery_of(msg)
        self._held[id(msg)] = Held(msg, delivery, self._generations.current, time.monotonic())
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

    def pending_settlements(self) -> int:
        """Queued settles, plus the last pull request while it may still bring messages:
        a draining worker waits for both before it calls close()."""
        pulling = not self._consuming and any(p.running for p in self._pulls.values())
        return self._pending.count + int(pulling)

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
            self._drop_inbox()

    async def _shutdown(self) -> None:
        await self._stop_lease_loop()
        running = [p.task for p in self._pulls.values() if p.task is not None and not p.task.done()]
        if running:
            self._wake.set()
            try:   # the pulls in flight end by themselves within their expiry: nothing orphaned
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*running, return_exceptions=True)),
                                       FETCH_EXPIRY_S + 1.0)
            except (asyncio.TimeoutError, Exception):
                for task in running:
                    task.cancel()
        if self._settle_tasks:
            await asyncio.wait(list(self._settle_tasks), timeout=API_TIMEOUT_S + 1.0)
        # No pull request of ours may be open when we nak: the server would hand the
        # released messages right back to this closing subscription (then AckWait).
        await asyncio.sleep(max([p.request_open_s() for p in self._pulls.values()], default=0.0))
        await self._release_all()
        if self._leases is not None and self.connected:
            await self._leases.release_all()   # settled and released: others take over now
        self._closed = True
        await close_quietly(self._nc)

    async def _release_all(self) -> None:
        unsettled = [h for h in self._held.values() if not h.settling]
        leftovers = [m for p in self._pulls.values() for m in p.leftovers()]
        undelivered = list(self._backlog) + leftovers
        self.gave_back([h.delivery for h in unsettled] + self._deliveries_of(undelivered))
        held = [h.msg for h in unsettled]
        await self._release(held + undelivered)
        if held or leftovers:
            log.info("unsettled_released", transport="jetstream", unsettled=len(held),
                     undelivered=len(leftovers))
        self._held.clear()
        self._backlog.clear()

    def _deliveries_of(self, undelivered: list[Msg]) -> list[Delivery]:
        """Messages pulled but never handed to the worker, as deliveries to forgive when they
        are given back: the server counted them as delivered, so without forgiveness every
        close or shard hand-over a message waits through in a backlog costs it an attempt."""
        return [self._delivery_of(m) for m in undelivered]

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

    def _finish_loop(self) -> None:
        pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()
        self._nc = self._js = None
        self._pulls = {}

