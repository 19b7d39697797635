"""RabbitMQ consumer on pika's BlockingConnection.

One connection per worker process, owned by the worker's main thread. Channel 1
consumes with manual acks and an explicit prefetch; channel 2 publishes retries and
dead letters with publisher confirms + ``mandatory``. Pool threads never touch
either channel: ``settle`` hands the broker work to the connection with
``add_callback_threadsafe`` and it runs inside the next ``poll``.

Settlements queue up in an inbox that the connection thread drains in bursts (one
wake-up per burst, not per task), and the acks of a burst go out as one
``basic_ack(multiple=True)`` up to the oldest delivery still in progress: a group commit
settles its whole batch at once, so one frame acks most of it.

With ``output.events`` a third channel carries the result events (events.py): an ack
whose settlement has an event waits in ``_unsettled`` until the broker confirmed it.

Delivery tags are channel-scoped: every delivery remembers the connection
generation it came from, and a settle for an older generation is dropped (the
broker has already requeued that message) instead of raising
``PRECONDITION_FAILED - unknown delivery tag``.
"""
from __future__ import annotations

import random
import time
from typing import Any, Callable

import pika
import pika.exceptions as pex

from crawld.config import Config, redact_url
from crawld.transports.amqp.connection import (CONNECTION_ERRORS, connect_with_backoff, log,
                                               message_properties)
from crawld.task import MalformedMessage, parse_message
from crawld.transports.amqp.events import EventChannel, Outcome
from crawld.transports.amqp.shards import Shards
from crawld.transports.amqp.topology import (TIER_HEADER, dead_queue_name, declare_topology, partitioned,
                                             retry_queue_name, route_for, shard_retry_exchange, tier_label)
from crawld.transports.base import (ATTEMPT_HEADER, Action, Delivery, DeliveryCallback, Settlement,
                                    Transport, tier_for)
from crawld.transports.common import (Generations, PendingSettlements, SettleInbox, complete, dispatch,
                                      event_outcome, forward_headers, task_id_of)

HANDOVER = "shard_handover"     # the reason header of a copy passed on to a shard's next owner

# What settle() meets when the connection is gone or closing under it.
HANDOFF_REFUSED = (pex.ConnectionWrongStateError, AttributeError, ValueError, OSError)


class AmqpTransport(Transport):
    name = "amqp"
    counts_deliveries = False   # no delivery counter on classic queues: the worker counts

    def __init__(self, cfg: Config, worker_id: str) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.queue = cfg.queue.name
        self._conn: pika.BlockingConnection | None = None
        self._ch: Any = None
        self._pub: Any = None
        self._events: EventChannel | None = None
        self._generations = Generations(self)
        self._tags: dict[str, str] = {}             # queue -> consumer tag
        self._tag_queue: dict[str, str] = {}        # consumer tag -> queue (the origin)
        self._shards = Shards(cfg) if partitioned(cfg) else None
        self._on_delivery: DeliveryCallback | None = None
        self._consuming = False
        self._pending = PendingSettlements(log, self.name)
        self._unsettled: dict[int, Delivery] = {}
        self._inbox = SettleInbox()
        self._acks: list[int] | None = None       # a burst's acks, sent once it is done
        self._held: list[tuple[Delivery, Settlement]] | None = None
        self._handlers = complete({Action.ACK: self._ack, Action.SKIP: self._ack,
                                   Action.RELEASE: self._release, Action.RETRY: self._retry,
                                   Action.DEAD: self._dead, Action.DEFER: self._defer})
        self.reconnects = 0
        self.routed = 0

    # connection life cycle
    def connect(self) -> None:
        conn = connect_with_backoff(self.cfg, self.should_stop, "consumer")
        if conn is None:
            return
        self._conn = conn
        generation = self._generations.advance()
        self._ch = conn.channel()
        declare_topology(self._ch, self.cfg)
        self._set_qos()
        self._pub = conn.channel()
        self._pub.confirm_delivery()
        if self.cfg.output.events:
            self._events = EventChannel(conn, self._on_event_outcomes)
        log.info("broker_connected", transport="amqp", broker_url=redact_url(self.cfg.broker.url),
                 queue=self.queue, prefetch=self.cfg.queue.prefetch, generation=generation)
        if self._consuming:
            self._basic_consume()
        self._generations.ready()

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.is_open and self._ch is not None and self._ch.is_open

    def start_consuming(self, on_delivery: DeliveryCallback, free_slots: Callable[[], int]) -> None:
        self._on_delivery = on_delivery
        self._consuming = True
        if self.connected:
            self._basic_consume()

    def _set_qos(self) -> None:
        """Unpartitioned: one prefetch for the one consumer. Partitioned: a per-shard
        prefetch (shard queues are quorum queues, which know no channel-wide limit), small
        enough that one slow site's shard does not hoard while the others have work."""
        prefetch = self.cfg.queue.prefetch if self._shards is None else self._shards.prefetch
        self._ch.basic_qos(prefetch_count=prefetch)

    def _basic_consume(self) -> None:
        # Manual acks (pika's default): an ack only ever follows the store write.
        self._subscribe(self.queue)
        if self._shards is not None:
            # In a random order: workers starting together then split the shards between
            # them from the start (the first subscriber of a queue is its active consumer).
            for queue in random.sample(self._shards.queues, len(self._shards.queues)):
                self._subscribe(queue)

    def _subscribe(self, queue: str) -> None:
        intake = self._shards is not None and queue == self.queue
        tag = self._ch.basic_consume(queue, self._on_intake if intake else self._on_message)
        self._tags[queue] = tag
        self._tag_queue[tag] = queue

    def stop_consuming(self) -> None:
        self._consuming = False
        if self.connected and self._tags:
            try:
                self._close_prefetch_window()
                for tag in list(self._tags.values()):
                    # What pika has buffered for this consumer is handed to us first:
                    # basic_cancel would reject it (requeued, flagged redelivered).
                    self._conn.process_data_events(time_limit=0)
                    self._ch.basic_cancel(tag)
                self._requeue_releasing()
            except CONNECTION_ERRORS as exc:
                self._lost(exc)
            finally:
                self._release_held()
        self._forget_consumers()

    def _forget_consumers(self) -> None:
        self._tags.clear()
        self._tag_queue.clear()
        if self._shards is not None:
            self._shards.reset()

    def _close_prefetch_window(self, wait_s: float = 0.5) -> None:
        """Hold acks for a moment so the broker's prefetch window fills and nothing is on
        the wire when we cancel: pika rejects deliveries that arrive during a cancel, and
        the broker would redeliver them (a redelivery caused by a deploy)."""
        self._held = []
        deadline = time.monotonic() + wait_s
        if self._shards is None:
            while time.monotonic() < deadline and len(self._unsettled) < self.cfg.queue.prefetch:
                self._conn.process_data_events(time_limit=0.05)
            return
        # One window per shard consumer: wait until deliveries stop arriving (every window
        # with work behind it is full) rather than for one count.
        seen = -1
        while time.monotonic() < deadline and seen != len(self._unsettled):
            seen = len(self._unsettled)
            self._conn.process_data_events(time_limit=0.1)

    def _release_held(self) -> None:
        held, self._held = self._held or [], None
        for delivery, settlement in held:
            self._settle_now(delivery, settlement, may_hold=False)

    def poll(self, timeout: float) -> None:
        if not self.connected:
            if self.should_stop() and not self._consuming:
                time.sleep(timeout)
                return
            self._reconnect()
            return
        try:
            self._drain_inbox()
            self._conn.process_data_events(time_limit=timeout)
            self._drain_inbox()
            if self._ch is None:
                return          # a settle callback inside process_data_events found it lost
            if not self._ch.is_open:
                # process_data_events does not raise when only the channel was closed
                # (e.g. consumer_timeout): treat it as a lost connection.
                raise pex.ChannelClosed(0, "consumer channel closed by broker")
            self._check_events()
            if self._shards is not None and self._consuming:
                self._balance()
        except CONNECTION_ERRORS as exc:
            self._lost(exc)

    def _check_events(self) -> None:
        if self._events is None:
            return
        if not self._events.is_open:      # e.g. the exchange was deleted under a publish
            raise pex.ChannelClosed(0, "events channel closed by broker")
        self._events.expire()     # what expires is queued with a wake-up, like a confirm

    def _reconnect(self) -> None:
        self.reconnects += 1
        self.connect()

    def _lost(self, exc: BaseException) -> None:
        """Forget the dead connection; its unacked deliveries are already back in the queue."""
        log.warning("broker_connection_lost", transport="amqp", error=repr(exc),
                    unsettled=len(self._unsettled), generation=self._generations.current)
        self.gave_back(self._unsettled.values())
        self._unsettled.clear()
        if self._acks is not None:
            self._acks.clear()
        self._forget_consumers()
        self._drop_events()
        conn, self._conn, self._ch, self._pub = self._conn, None, None, None
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception:  # already broken; nothing more to do with it
                pass

    def close(self) -> None:
        if self.connected:
            self.gave_back(self._unsettled.values())
            for delivery in list(self._unsettled.values()):
                self._nack(delivery)
            try:
                self._conn.close()
            except CONNECTION_ERRORS:
                pass
        self._drop_events()
        self._conn = self._ch = self._pub = None

    def _drop_events(self) -> None:
        """Events still unconfirmed went with the connection (their deliveries are back
        in the queue, nacked or requeued by the broker): nothing more to settle."""
        if self._events is not None:
            for _ in self._events.drop():
                self._pending.done()
        self._events = None

    # shards: exactly one active consumer per shard queue, chosen by the broker
    def owned_shards(self) -> list[int]:
        return self._shards.active() if self._shards is not None else []

    @property
    def handovers(self) -> int:
        return self._shards.released if self._shards is not None else 0

    def _balance(self) -> None:
        """Give shards beyond the fair share to the next consumer in line (RabbitMQ's single
        active consumer is whoever subscribed first, so without this the first worker up
        would own every shard). A shard is handed over only once nothing of it runs here."""
        assert self._shards is not None
        if self._shards.releasing:      # counting what runs per shard is per poll: only then
            for queue in self._shards.ready_to_release(self._inflight_by_queue()):
                self._hand_over(queue)
        if self._shards.balance_due():
            consumers, waiting = self._shard_load()
            for queue in self._shards.start_releases(consumers, waiting):
                # What waits here for its site goes over with the shard, not after it has run
                # (a window of a shard's tasks at about one a second per site: 5-7 s).
                parked = self.take_back(lambda d, queue=queue: d.origin == queue)
                self._shards.releasing[queue].extend(parked)
                log.info("shard_releasing", shard=queue, worker=self.worker_id, consumers=consumers,
                         busy=len(waiting), parked=len(parked))
            stepped = [q for q in self._shards.step_backs(consumers, waiting) if self._step_back(q)]
            if stepped:
                log.debug("shard_step_back", shards=stepped, worker=self.worker_id)

    def _step_back(self, queue: str) -> bool:
        """Subscribe to ``queue`` again, at the back of its line. Only as a standby: should
        the shard have started delivering here just now, keep it."""
        assert self._shards is not None
        self._conn.process_data_events(time_limit=0)
        tag = self._tags.get(queue)
        if tag is None or queue in [self._shards.queues[i] for i in self._shards.active()]:
            return False
        self._tags.pop(queue)
        self._tag_queue.pop(tag, None)
        self._ch.basic_cancel(tag)
        self._subscribe(queue)
        return True

    def _shard_load(self) -> tuple[int, set[str]]:
        """(live workers, shard queues with messages ready), by passive declares: one cheap
        round trip per queue every few seconds, no management plugin. Every worker consumes
        the intake, so its consumers are the workers (a single-active-consumer quorum queue
        reports only its active consumer)."""
        assert self._shards is not None
        consumers = self._ch.queue_declare(self.queue, passive=True).method.consumer_count
        if consumers <= 1:
            # Alone: nothing to hand over or step back from, so skip one blocking round trip
            # per shard queue (64 by default), which stalled this thread every balance round.
            return consumers, set()
        waiting = {queue for queue in self._shards.queues
                   if self._ch.queue_declare(queue, passive=True).method.message_count}
        return consumers, waiting

    def _inflight_by_queue(self) -> dict[str, int]:
        held = self._shards.held_ids() if self._shards is not None else set()
        counts: dict[str, int] = {}
        for delivery in self._unsettled.values():
            if id(delivery) not in held:
                counts[delivery.origin] = counts.get(delivery.origin, 0) + 1
        return counts

    def _hand_over(self, queue: str) -> None:
        """Cancel (the broker activates the next consumer), pass on what arrived for the
        shard meanwhile, and queue up again behind the others."""
        assert self._shards is not None
        tag = self._tags.pop(queue, None)
        if tag is not None:
            self._tag_queue.pop(tag, None)
            # No ack may reopen a prefetch window while the cancel is on the wire: pika
            # rejects what arrives for a cancelled consumer (a redelivery).
            self._held = []
            try:
                self._conn.process_data_events(time_limit=0)   # buffered ones: held here
                self._ch.basic_cancel(tag)
            finally:
                self._release_held()
        passed = self._pass_on(self._shards.finish_release(queue))
        log.info("shard_released", shard=queue, worker=self.worker_id, passed_on=passed)
        if self._consuming:
            self._subscribe(queue)

    def _requeue_releasing(self) -> None:
        """Stopping: what shards being handed over held goes on to their next owner."""
        if self._shards is None:
            return
        for queue in list(self._shards.releasing):
            self._pass_on(self._shards.finish_release(queue))

    def _pass_on(self, held: list[Delivery]) -> int:
        """Deliveries held (never started) while their shard was handed over: a fresh copy
        goes back to the shard queue (confirmed), then the original is acked. A nack with
        requeue would do too, but every copy would come back flagged as redelivered, i.e.
        as if a worker had died with it; a handover is no such thing."""
        for delivery in held:
            self._unsettled.pop(delivery.handle[1], None)
            self._forward(delivery, Settlement(Action.DEFER, reason=HANDOVER), delivery.origin,
                          delivery.attempt)
        return len(held)

    # deliveries
    def _on_intake(self, channel: Any, method: Any, props: Any, body: bytes) -> None:
        """A message from a plain publisher: publish it to its shard (confirmed), then ack
        it here. At least once: a crash in between leaves both copies; the task id makes
        the second one a duplicate. What does not parse is handled as a delivery (dead)."""
        try:
            task = parse_message(body, props.message_id, self.cfg.queue.max_message_bytes)
        except MalformedMessage:
            self._on_message(channel, method, props, body)
            return
        target = route_for(self.cfg, task.url)
        try:
            self._pub.basic_publish("", target, body, message_properties(task.task_id, dict(props.headers or {})),
                                    mandatory=True)
        except (pex.UnroutableError, pex.NackError) as exc:
            log.error("intake_route_failed", task_id=task.task_id, url=task.url, attempt=1,
                      target=target, error=repr(exc))
            self._ch.basic_nack(method.delivery_tag, requeue=True)
            return
        self._ch.basic_ack(method.delivery_tag)
        self.routed += 1

    def _on_message(self, channel: Any, method: Any, props: Any, body: bytes) -> None:
        headers = dict(props.headers or {})
        attempt = _int_header(headers.get(ATTEMPT_HEADER), 1)
        # Quorum queues count for us. Only they: the broker overwrites x-delivery-count on
        # a quorum queue (0 on the first delivery on 3.10), but a classic queue passes a
        # client-supplied header through untouched, so on classic queues the header is
        # just publisher data (a plain client, or a copy forwarded from a quorum queue)
        # and must not count as crash redeliveries (the store counter does that there).
        origin = self._tag_queue.get(method.consumer_tag, self.queue)
        quorum = self.cfg.queue.type == "quorum" or origin != self.queue    # shards: always
        broker_count = headers.get("x-delivery-count") if quorum else None
        delivery = Delivery(body=body, message_id=props.message_id, attempt=attempt,
                            redelivered=bool(method.redelivered), origin=origin,
                            handle=(self._generations.current, method.delivery_tag), headers=headers,
                            broker_redeliveries=int(broker_count) if broker_count is not None else None)
        self._unsettled[method.delivery_tag] = delivery
        if self._shards is not None and self._shards.hold(origin, delivery, self.shard_acquired):
            return      # the shard is being handed over: given back, not started
        assert self._on_delivery is not None
        self._on_delivery(delivery)

    # settling
    def pending_settlements(self) -> int:
        return self._pending.count

    def settle(self, delivery: Delivery, settlement: Settlement) -> None:
        """Called from pool threads: queue the work for the connection's thread, and wake
        that thread unless a wake-up is already on its way."""
        conn = self._conn

        def schedule() -> None:
            if conn is None:
                raise pex.ConnectionWrongStateError("not connected")
            self._enqueue(conn, [(delivery, settlement)])

        self._pending.hand_off(schedule, delivery, settlement, HANDOFF_REFUSED, "connection gone")

    def _enqueue(self, conn: pika.BlockingConnection, items: list[tuple[Delivery, Settlement]],
                 own_thread: bool = False) -> None:
        """Into the inbox, and a wake-up for the connection thread unless one is on its way:
        ``add_callback_threadsafe`` also ends a ``process_data_events`` wait, which
        nothing else would for an event's confirm (pika hands those to us directly).
        On the connection's own thread (``own_thread``) a zero-delay ``call_later`` does
        the same without the wake-up pipe: two syscalls fewer per confirm."""
        if self._inbox.put(items):
            try:
                if own_thread:
                    conn.call_later(0, self._drain_inbox)
                else:
                    conn.add_callback_threadsafe(self._drain_inbox)
            except HANDOFF_REFUSED:
                # Queued all the same: the next poll drains it (and drops it as stale
                # if the connection is gone), which keeps the pending count exact.
                self._inbox.wake_failed()

    def _drain_inbox(self) -> None:
        """Runs on the connection thread: settle everything queued, acks coalesced. A call
        nested in a drain (pika may run callbacks while a forward waits for its confirm)
        leaves the work to the outer one, which loops until the inbox is empty."""
        if self._acks is not None:
            return
        self._acks = []
        try:
            while batch := self._inbox.take():
                for delivery, settlement in batch:
                    self._settle_now(delivery, settlement)
            self._send_acks(self._acks)
        except CONNECTION_ERRORS as exc:
            self._lost(exc)
        finally:
            self._acks = None

    def _send_acks(self, tags: list[int]) -> None:
        """One multiple-ack up to the oldest delivery still in progress (every tag below it
        is settled by now: acked here, or nacked or acked before), single acks above it."""
        if not tags or not self.connected:
            return
        oldest_open = min(self._unsettled, default=None)
        below = [t for t in tags if oldest_open is None or t < oldest_open]
        if len(below) > 1:
            self._ch.basic_ack(max(below), multiple=True)
        elif below:
            self._ch.basic_ack(below[0])
        for tag in tags:
            if oldest_open is not None and tag > oldest_open:
                self._ch.basic_ack(tag)

    def _settle_now(self, delivery: Delivery, settlement: Settlement, may_hold: bool = True) -> None:
        """Runs on the connection thread inside process_data_events."""
        if self._held is not None and may_hold:
            self._held.append((delivery, settlement))   # still pending until released
            return
        try:
            generation, tag = delivery.handle
            if self._generations.is_stale(generation) or not self.connected:
                log.info("stale_delivery_tag_dropped", delivery_tag=tag, generation=generation,
                         current=self._generations.current, action=settlement.action.value,
                         task_id=delivery.message_id)
                return
            self._unsettled.pop(tag, None)
            dispatch(self._handlers, settlement, delivery)
        except CONNECTION_ERRORS as exc:
            self._lost(exc)
        finally:
            self._pending.done()

    def _ack(self, delivery: Delivery, settlement: Settlement) -> None:
        if settlement.event is not None and self._events is not None:
            self._announce(delivery, settlement)
            return
        if self._acks is not None:
            self._acks.append(delivery.handle[1])     # sent when the burst is done
        else:
            self._ch.basic_ack(delivery.handle[1])

    def _announce(self, delivery: Delivery, settlement: Settlement) -> None:
        """Publish the event; the ack (or the release) follows its confirm, settled again
        through the inbox: still pending, and still unsettled, so no multiple-ack covers it."""
        assert self._events is not None
        self._unsettled[delivery.handle[1]] = delivery
        self._pending.add()
        self._events.publish(delivery, settlement)

    def _on_event_outcomes(self, outcomes: list[Outcome]) -> None:
        """Connection thread, inside process_data_events: queue the acks (or releases) of
        confirmed (or failed) events, drained as soon as that call returns."""
        settled = [(delivery, event_outcome(delivery, settlement, error, log, self.name))
                   for delivery, settlement, error in outcomes]
        for delivery, settlement in settled:
            self.event_settled(delivery, settlement)
        if self._conn is not None:
            self._enqueue(self._conn, settled, own_thread=True)
        else:       # the next poll drains them as stale, which keeps the pending count exact
            self._inbox.park(settled)

    def _requeue(self, delivery: Delivery, settlement: Settlement) -> None:
        self._ch.basic_nack(delivery.handle[1], requeue=True)

    def _release(self, delivery: Delivery, settlement: Settlement) -> None:
        """Given back unstarted (drain) or unannounced. A shard's delivery goes back as a
        fresh copy, like a handover: a requeue would flag it redelivered and count it in the
        quorum queue's x-delivery-count, as if a worker had died with it."""
        if self._shards is not None and delivery.origin != self.queue:
            self._forward(delivery, settlement, delivery.origin, delivery.attempt)
            return
        self._requeue(delivery, settlement)

    def _retry(self, delivery: Delivery, settlement: Settlement) -> None:
        self._to_tier(delivery, settlement, delivery.attempt + 1)

    def _defer(self, delivery: Delivery, settlement: Settlement) -> None:
        """A worker fault or a paused site: a fresh copy waits out a retry tier with the
        attempt header as it was (a new message, so neither redelivered nor counted by a
        quorum queue)."""
        self._to_tier(delivery, settlement, delivery.attempt)

    def _to_tier(self, delivery: Delivery, settlement: Settlement, attempt: int) -> None:
        """The smallest tier that covers the delay; a shard's copy comes back to its shard."""
        tier = tier_for(settlement.delay_s, self.cfg.queue.retry_delays_s)
        if self._shards is not None and delivery.origin != self.queue:
            self._forward(delivery, settlement, delivery.origin, attempt,
                          exchange=shard_retry_exchange(self.queue), extra={TIER_HEADER: tier_label(tier)})
            return
        self._forward(delivery, settlement, retry_queue_name(self.queue, tier), attempt)

    def _dead(self, delivery: Delivery, settlement: Settlement) -> None:
        self._forward(delivery, settlement, dead_queue_name(self.queue), delivery.attempt)

    def _forward(self, delivery: Delivery, settlement: Settlement, target: str, attempt: int,
                 exchange: str = "", extra: dict[str, Any] | None = None) -> None:
        """Publish a copy with our headers and a confirm; only then ack the original."""
        task_id = task_id_of(delivery, settlement)
        headers = {**delivery.headers, **forward_headers(delivery, settlement, attempt), **(extra or {})}
        try:
            self._pub.basic_publish(exchange, target, delivery.body, message_properties(task_id, headers),
                                    mandatory=True)
        except (pex.UnroutableError, pex.NackError) as exc:
            log.error("forward_failed", target=target, task_id=task_id, attempt=attempt,
                      error=repr(exc))
            self._requeue(delivery, settlement)
            return
        self._ack(delivery, settlement)

    def _nack(self, delivery: Delivery) -> None:
        try:
            self._ch.basic_nack(delivery.handle[1], requeue=True)
        except CONNECTION_ERRORS:
            pass


def _int_header(value: Any, default: int) -> int:
    try:
        return max(1, int(value))
    except (TypeError, ValueError):
        return default
