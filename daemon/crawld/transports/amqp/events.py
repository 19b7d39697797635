"""Result events to the topic exchange ``crawl.events`` (routing key = status), confirmed.

pika connections are not thread-safe and pool threads finish concurrently, so one
events thread per worker owns an asynchronous ``SelectConnection``: pool threads queue
their event and wake the loop (``add_callback_threadsafe``); the loop publishes all
queued events back to back and the broker's (multiple-)acks confirm them in batches,
as the group commit does for rows. Each pool thread waits for its own outcome.

A lost connection puts the published-but-unconfirmed events back at the front of the
queue (resent after the reconnect: at least once, deduplicated by ``message_id``).
"""
from __future__ import annotations

import collections
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.spec

from crawld.config import Config
from crawld.logs import get_logger
from crawld.transports.amqp.connection import connection_parameters
from crawld.transports.base import EVENTS_EXCHANGE, EventPublisher, TopologyError

log = get_logger("crawld.amqp.events")

BOOT_WAIT_S = 15.0          # start(): how long to wait for the exchange to be declared
WINDOW = 1000               # published, unconfirmed events at most


@dataclass
class _Event:
    task_id: str
    routing_key: str
    body: bytes
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    abandoned: bool = False   # its pool thread stopped waiting: do not (re)send it

    def finish(self, error: str | None) -> None:
        self.error = error
        self.done.set()


class AmqpEventPublisher(EventPublisher):
    def __init__(self, cfg: Config, worker_id: str) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._queue: collections.deque[_Event] = collections.deque()
        self._outstanding: dict[int, _Event] = {}     # delivery tag -> event (this channel)
        self._next_tag = 0
        self._wake_pending = False     # a _pump is already on its way to the events thread
        self._conn: Any = None
        self._channel: Any = None
        self._ready = threading.Event()
        self._boot_error: str | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- pool-thread side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="crawld-events", daemon=True)
        self._thread.start()
        self._ready.wait(BOOT_WAIT_S)
        if self._boot_error is not None:
            raise TopologyError(self._boot_error)

    def publish(self, task_id: str, status: str, body: bytes, timeout_s: float) -> str | None:
        event = _Event(task_id, status, body)
        with self._lock:
            self._queue.append(event)
            wake, self._wake_pending = not self._wake_pending, True
        if wake:          # one wake-up (a pipe write and a loop turn) per burst of events
            self._wake()
        if not event.done.wait(timeout_s):
            event.abandoned = True
            return event.error or f"no confirm for the event within {timeout_s:g}s"
        return event.error

    def close(self) -> None:
        self._closing = True
        self._call(self._close_connection)
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            left = list(self._queue) + list(self._outstanding.values())
            self._queue.clear()
            self._outstanding.clear()
        for event in left:
            event.finish("event publisher closed")

    def _wake(self) -> None:
        self._call(self._pump)

    def _call(self, callback: Any) -> None:
        conn = self._conn
        if conn is None:
            return            # not connected: the queue is pumped when the channel opens
        try:
            conn.ioloop.add_callback_threadsafe(callback)
        except Exception:     # the loop is gone (closed connection): same as above
            pass

    # -- events thread -------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self._closing:
            opened_at = time.monotonic()
            self._conn = pika.SelectConnection(
                connection_parameters(self.cfg), on_open_callback=self._on_open,
                on_open_error_callback=self._on_open_error, on_close_callback=self._on_closed)
            self._conn.ioloop.start()
            self._conn = self._channel = None
            self._requeue_outstanding()
            if self._closing or self._boot_error is not None:
                return
            failures = 0 if time.monotonic() - opened_at > 10 else failures + 1
            # full jitter, capped: many workers must not reconnect in lockstep
            time.sleep(random.uniform(0, min(self.cfg.broker.reconnect_max_s, 0.2 * 2 ** failures)))

    def _on_open(self, conn: Any) -> None:
        conn.channel(on_open_callback=self._on_channel)

    def _on_open_error(self, conn: Any, exc: BaseException) -> None:
        log.warning("events_connect_failed", transport="amqp", error=repr(exc))
        conn.ioloop.stop()

    def _on_closed(self, conn: Any, reason: BaseException) -> None:
        if not self._closing:
            log.warning("events_connection_lost", transport="amqp", error=repr(reason))
        conn.ioloop.stop()

    def _on_channel(self, channel: Any) -> None:
        channel.add_on_close_callback(self._on_channel_closed)
        channel.exchange_declare(EVENTS_EXCHANGE, exchange_type="topic", durable=True,
                                 callback=lambda _f: channel.confirm_delivery(
                                     ack_nack_callback=self._on_confirm,
                                     callback=lambda _f2: self._on_ready(channel)))

    def _on_ready(self, channel: Any) -> None:
        self._channel = channel
        self._ready.set()
        self._pump()

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        code = getattr(reason, "reply_code", 0)
        if code == 406 and not self._ready.is_set():   # PRECONDITION_FAILED on declare
            self._boot_error = (f"exchange {EVENTS_EXCHANGE!r} refused by the broker ({reason}); "
                                "it exists with another type or durability")
            self._ready.set()
        elif not self._closing:
            log.warning("events_channel_closed", transport="amqp", error=repr(reason))
        if self._conn is not None and self._conn.is_open:
            self._conn.close()

    def _pump(self) -> None:
        with self._lock:
            self._wake_pending = False
        channel = self._channel
        if channel is None or not channel.is_open:
            return
        while True:
            with self._lock:
                if not self._queue or len(self._outstanding) >= WINDOW:
                    return
                event = self._queue.popleft()
                if event.abandoned:
                    continue
                self._next_tag += 1
                tag = self._next_tag      # pika numbers a confirm channel's publishes from 1
                self._outstanding[tag] = event
            channel.basic_publish(
                EVENTS_EXCHANGE, event.routing_key, event.body,
                pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent,
                                     message_id=event.task_id, content_type="application/json",
                                     type="crawl.result", app_id="crawld"))

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        with self._lock:
            if method.multiple:
                tags = [t for t in self._outstanding if t <= method.delivery_tag]
            else:
                tags = [method.delivery_tag]
            events = [self._outstanding.pop(t) for t in tags if t in self._outstanding]
        for event in events:
            event.finish(None if acked else "event nacked by the broker")
        self._pump()

    def _requeue_outstanding(self) -> None:
        """Unconfirmed events of a dead channel are resent on the next one (tags restart)."""
        with self._lock:
            unconfirmed = [self._outstanding[t] for t in sorted(self._outstanding)]
            self._outstanding.clear()
            self._next_tag = 0
            self._queue.extendleft(reversed([e for e in unconfirmed if not e.abandoned]))

    def _close_connection(self) -> None:
        if self._conn is not None and self._conn.is_open:
            self._conn.close()
