"""RabbitMQ consumer on pika's BlockingConnection.

One connection per worker process, owned by the worker's main thread. Channel 1
consumes with manual acks and an explicit prefetch; channel 2 publishes retries and
dead letters with publisher confirms + ``mandatory``. Pool threads never touch
either channel: ``settle`` hands the broker work to the connection with
``add_callback_threadsafe`` and it runs inside the next ``poll``.

Delivery tags are channel-scoped: every delivery remembers the connection
generation it came from, and a settle for an older generation is dropped (the
broker has already requeued that message) instead of raising
``PRECONDITION_FAILED - unknown delivery tag``.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

import pika
import pika.exceptions as pex

from crawld.config import Config, redact_url
from crawld.transports.amqp.connection import (CONNECTION_ERRORS, connect_with_backoff, log,
                                               message_properties)
from crawld.transports.amqp.topology import dead_queue_name, declare_topology, retry_queue_name
from crawld.transports.base import (ATTEMPT_HEADER, Action, Delivery, DeliveryCallback, Settlement,
                                    Transport, tier_for)
from crawld.transports.common import (Generations, PendingSettlements, complete, dispatch,
                                      forward_headers, task_id_of)

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
        self._generations = Generations(self)
        self._consumer_tag: str | None = None
        self._on_delivery: DeliveryCallback | None = None
        self._consuming = False
        self._pending = PendingSettlements(log, self.name)
        self._unsettled: dict[int, Delivery] = {}
        self._held: list[tuple[Delivery, Settlement]] | None = None
        self._handlers = complete({Action.ACK: self._ack, Action.SKIP: self._ack,
                                   Action.RELEASE: self._requeue, Action.RETRY: self._retry,
                                   Action.DEAD: self._dead, Action.DEFER: self._defer})
        self.reconnects = 0

    # connection life cycle
    def connect(self) -> None:
        conn = connect_with_backoff(self.cfg, self.should_stop, "consumer")
        if conn is None:
            return
        self._conn = conn
        generation = self._generations.advance()
        self._ch = conn.channel()
        declare_topology(self._ch, self.cfg)
        self._ch.basic_qos(prefetch_count=self.cfg.queue.prefetch)
        self._pub = conn.channel()
        self._pub.confirm_delivery()
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

    def _basic_consume(self) -> None:
        # Manual acks (pika's default): an ack only ever follows the store write.
        self._consumer_tag = self._ch.basic_consume(self.queue, self._on_message)

    def stop_consuming(self) -> None:
        self._consuming = False
        if self.connected and self._consumer_tag:
            try:
                self._close_prefetch_window()
                self._ch.basic_cancel(self._consumer_tag)
            except CONNECTION_ERRORS as exc:
                self._lost(exc)
            finally:
                self._release_held()
        self._consumer_tag = None

    def _close_prefetch_window(self, wait_s: float = 0.3) -> None:
        """Hold acks for a moment so the broker's prefetch window fills and nothing is on
        the wire when we cancel: pika rejects deliveries that arrive during a cancel, and
        the broker would redeliver them (a redelivery caused by a deploy)."""
        self._held = []
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and len(self._unsettled) < self.cfg.queue.prefetch:
            self._conn.process_data_events(time_limit=0.05)

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
            self._conn.process_data_events(time_limit=timeout)
            if self._ch is None:
                return          # a settle callback inside process_data_events found it lost
            if not self._ch.is_open:
                # process_data_events does not raise when only the channel was closed
                # (e.g. consumer_timeout): treat it as a lost connection.
                raise pex.ChannelClosed(0, "consumer channel closed by broker")
        except CONNECTION_ERRORS as exc:
            self._lost(exc)

    def _reconnect(self) -> None:
        self.reconnects += 1
        self.connect()

    def _lost(self, exc: BaseException) -> None:
        """Forget the dead connection; its unacked deliveries are already back in the queue."""
        log.warning("broker_connection_lost", transport="amqp", error=repr(exc),
                    unsettled=len(self._unsettled), generation=self._generations.current)
        self.gave_back(self._unsettled.values())
        self._unsettled.clear()
        self._consumer_tag = None
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
        self._conn = self._ch = self._pub = None

    # deliveries
    def _on_message(self, channel: Any, method: Any, props: Any, body: bytes) -> None:
        headers = dict(props.headers or {})
        attempt = _int_header(headers.get(ATTEMPT_HEADER), 1)
        # Quorum queues count for us. Only they: the broker overwrites x-delivery-count on
        # a quorum queue (0 on the first delivery on 3.10), but a classic queue passes a
        # client-supplied header through untouched, so on classic queues the header is
        # just publisher data (a plain client, or a copy forwarded from a quorum queue)
        # and must not count as crash redeliveries (the store counter does that there).
        broker_count = headers.get("x-delivery-count") if self.cfg.queue.type == "quorum" else None
        delivery = Delivery(body=body, message_id=props.message_id, attempt=attempt,
                            redelivered=bool(method.redelivered), origin=self.queue,
                            handle=(self._generations.current, method.delivery_tag), headers=headers,
                            broker_redeliveries=int(broker_count) if broker_count is not None else None)
        self._unsettled[method.delivery_tag] = delivery
        assert self._on_delivery is not None
        self._on_delivery(delivery)

    # settling
    def pending_settlements(self) -> int:
        return self._pending.count

    def settle(self, delivery: Delivery, settlement: Settlement) -> None:
        """Called from pool threads: queue the work on the connection's thread."""
        conn = self._conn

        def schedule() -> None:
            if conn is None:
                raise pex.ConnectionWrongStateError("not connected")
            conn.add_callback_threadsafe(partial(self._settle_now, delivery, settlement))

        self._pending.hand_off(schedule, delivery, settlement, HANDOFF_REFUSED, "connection gone")

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
        self._ch.basic_ack(delivery.handle[1])

    def _requeue(self, delivery: Delivery, settlement: Settlement) -> None:
        self._ch.basic_nack(delivery.handle[1], requeue=True)

    def _retry(self, delivery: Delivery, settlement: Settlement) -> None:
        tier = tier_for(settlement.delay_s, self.cfg.queue.retry_delays_s)
        self._forward(delivery, settlement, retry_queue_name(self.queue, tier), delivery.attempt + 1)

    def _defer(self, delivery: Delivery, settlement: Settlement) -> None:
        """A worker fault: a fresh copy waits out a retry tier with the attempt header as it
        was (a new message, so neither redelivered nor counted by a quorum queue)."""
        tier = tier_for(settlement.delay_s, self.cfg.queue.retry_delays_s)
        self._forward(delivery, settlement, retry_queue_name(self.queue, tier), delivery.attempt)

    def _dead(self, delivery: Delivery, settlement: Settlement) -> None:
        self._forward(delivery, settlement, dead_queue_name(self.queue), delivery.attempt)

    def _forward(self, delivery: Delivery, settlement: Settlement, target: str, attempt: int) -> None:
        """Publish a copy with our headers and a confirm; only then ack the original."""
        task_id = task_id_of(delivery, settlement)
        headers = {**delivery.headers, **forward_headers(delivery, settlement, attempt)}
        try:
            self._pub.basic_publish("", target, delivery.body, message_properties(task_id, headers),
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
