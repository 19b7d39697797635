"""Result events to the topic exchange ``crawl.events`` (routing key = status), confirmed,
on the consumer's own connection.

The consumer's connection thread publishes a settlement's event and acks the delivery
when the broker's (multiple-)ack for it comes back, in a later poll: no thread, no
second connection, no pool thread waiting. pika's BlockingChannel would wait for every
confirm in turn, so the events channel is driven through the channel object under it
(``_impl``, pika's asynchronous Channel): ``basic_publish`` only buffers the frames, and
the confirms arrive through ``ack_nack_callback`` while the connection is polled.

A lost connection takes the unconfirmed events with it: their deliveries were never
acked, so the broker redelivers them and the duplicates announce the stored rows again
(at least once, deduplicated by ``message_id`` = task id).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import pika
import pika.exceptions as pex
import pika.spec

from crawld.transports.amqp.frames import PublishFrames
from crawld.transports.base import EVENT_TIMEOUT_S, EVENTS_EXCHANGE, Delivery, Settlement, TopologyError

SETUP_TIMEOUT_S = 10.0
EVENT_PROPERTIES = {"content_type": "application/json", "type_": "crawl.result", "app_id": "crawld"}

# (delivery, its settlement with the event, None once confirmed or why it was not)
Outcome = tuple[Delivery, Settlement, "str | None"]


class EventChannel:
    """One confirm-mode channel for the events of one connection (its thread only)."""

    def __init__(self, conn: pika.BlockingConnection, on_outcomes: Callable[[list[Outcome]], None],
                 timeout_s: float = EVENT_TIMEOUT_S) -> None:
        self.on_outcomes = on_outcomes
        self.timeout_s = timeout_s
        channel = conn.channel()
        try:
            channel.exchange_declare(EVENTS_EXCHANGE, exchange_type="topic", durable=True)
        except pex.ChannelClosedByBroker as exc:
            raise TopologyError(f"exchange {EVENTS_EXCHANGE!r} refused by the broker ({exc.reply_code} "
                                f"{exc.reply_text}); it exists with another type or durability") from None
        self._channel = channel
        self._impl: Any = channel._impl     # see the module docstring
        self._frames = PublishFrames(self._impl.channel_number, self._impl.connection._body_max_length,
                                     EVENTS_EXCHANGE, **EVENT_PROPERTIES)
        self._outstanding: dict[int, tuple[Delivery, Settlement, float]] = {}
        self._published = 0     # pika numbers a confirm channel's publishes from 1
        ready: list[bool] = []
        self._impl.confirm_delivery(ack_nack_callback=self._on_confirm,
                                    callback=lambda _frame: ready.append(True))
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while not ready:
            if time.monotonic() > deadline:
                raise pex.AMQPChannelError("no Confirm.SelectOk for the events channel")
            conn.process_data_events(time_limit=0.05)

    @property
    def is_open(self) -> bool:
        return bool(self._channel.is_open)

    def publish(self, delivery: Delivery, settlement: Settlement) -> None:
        """Buffered; sent with the rest of the burst when the connection is next polled."""
        event = settlement.event
        assert event is not None
        self._impl._raise_if_not_open()     # what basic_publish checks before it sends
        self._impl.connection._output_marshaled_frames(
            [self._frames.encode(event.status, event.task_id, event.body)])
        self._published += 1
        self._outstanding[self._published] = (delivery, settlement, time.monotonic())

    def expire(self) -> None:
        """Events the broker has not confirmed within ``timeout_s``: given up on (a late
        confirm for one of them is ignored)."""
        cutoff = time.monotonic() - self.timeout_s
        late = []
        for tag, (_, _, sent) in self._outstanding.items():    # oldest first
            if sent >= cutoff:
                break
            late.append(tag)
        if late:
            error = f"no confirm for the event within {self.timeout_s:g}s"
            self.on_outcomes([self._outstanding.pop(tag)[:2] + (error,) for tag in late])

    def drop(self) -> list[tuple[Delivery, Settlement]]:
        """The connection is gone: what was waiting for a confirm (the broker requeued it)."""
        dropped = [entry[:2] for entry in self._outstanding.values()]
        self._outstanding.clear()
        return dropped

    def _on_confirm(self, frame: Any) -> None:
        """pika calls this inside process_data_events: hand the outcomes on, settle later."""
        method = frame.method
        if method.multiple:
            tags = [tag for tag in self._outstanding if tag <= method.delivery_tag]
        else:
            tags = [method.delivery_tag] if method.delivery_tag in self._outstanding else []
        error = None if isinstance(method, pika.spec.Basic.Ack) else "event nacked by the broker"
        if tags:
            self.on_outcomes([self._outstanding.pop(tag)[:2] + (error,) for tag in tags])
