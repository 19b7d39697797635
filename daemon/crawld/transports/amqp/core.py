"""RabbitMQ transport on pika's BlockingConnection.

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

import threading
import time
from functools import partial
from typing import Any, Callable, Sequence

import pika
import pika.exceptions as pex
from tenacity import RetryError, Retrying, retry_if_exception_type, wait_random_exponential

from crawld.config import Config, redact_url
from crawld.logs import get_logger
from crawld.task import Task
from crawld.transports.base import (ATTEMPT_HEADER, ERROR_HEADER, ORIGIN_HEADER, REASON_HEADER, Action, Delivery,
                   DeliveryCallback, ProgressCallback, PublishReport, Publisher, Settlement,
                   TopologyError, Transport, tier_for, truncate)

log = get_logger("crawld.amqp")

CONNECTION_ERRORS = (pex.AMQPConnectionError, pex.ConnectionClosed, pex.ChannelClosed,
                     pex.StreamLostError, pex.ChannelWrongStateError, pex.ConnectionWrongStateError,
                     ConnectionError, OSError)




# -- topology -----------------------------------------------------------------------
def retry_queue_name(queue: str, delay_s: float) -> str:
    return f"{queue}.retry.{delay_s:g}"


def dead_queue_name(queue: str) -> str:
    return f"{queue}.dead"


def work_queue_arguments(cfg: Config) -> dict[str, Any]:
    """Classic: no arguments, so a plain ``queue_declare(name, durable=True)`` interoperates."""
    if cfg.queue.type != "quorum":
        return {}
    return {"x-queue-type": "quorum",
            # Counts broker redeliveries (crashes); our own header counts retries. The
            # worker dead-letters at max_deliver (with a store row); this is the backstop
            # for a task that kills its worker before the worker can even look at it.
            "x-delivery-limit": cfg.queue.max_deliver + 2,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dead_queue_name(cfg.queue.name)}


def topology(cfg: Config) -> list[tuple[str, dict[str, Any]]]:
    """Every durable queue we use, with its arguments: work, one per retry tier, dead."""
    name = cfg.queue.name
    quorum = {"x-queue-type": "quorum"} if cfg.queue.type == "quorum" else {}
    queues = [(name, work_queue_arguments(cfg))]
    queues += [(retry_queue_name(name, delay), {**quorum, "x-message-ttl": int(delay * 1000),
                                                "x-dead-letter-exchange": "",
                                                "x-dead-letter-routing-key": name})
               for delay in cfg.queue.retry_delays_s]
    queues.append((dead_queue_name(name), dict(quorum)))
    return queues


def declare_topology(channel: Any, cfg: Config) -> None:
    try:
        for queue, arguments in topology(cfg):
            channel.queue_declare(queue, durable=True, arguments=arguments)
    except pex.ChannelClosedByBroker as exc:
        raise TopologyError(f"queue declaration refused by the broker ({exc.reply_code} "
                            f"{exc.reply_text}); queue.type or retry_delays_s differ from the "
                            f"existing queues") from None


def connection_parameters(cfg: Config) -> pika.URLParameters:
    params = pika.URLParameters(cfg.broker.url)
    params.heartbeat = cfg.broker.heartbeat_s
    params.blocked_connection_timeout = max(60, cfg.broker.heartbeat_s * 4)
    params.connection_attempts = 1
    params.socket_timeout = 10
    params.client_properties = {"connection_name": "crawld"}
    return params


def message_properties(task_id: str, headers: dict[str, Any] | None = None) -> pika.BasicProperties:
    return pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent, message_id=task_id,
                                content_type="application/json", headers=headers or {})


def connect_with_backoff(cfg: Config, should_stop: Callable[[], bool], what: str) -> pika.BlockingConnection:
    """Jittered exponential backoff, capped; every failed attempt is logged."""
    stop_event = threading.Event()

    def _sleep(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not should_stop():
            stop_event.wait(min(0.2, deadline - time.monotonic()))

    def _log_attempt(state: Any) -> None:
        log.warning("broker_connect_failed", what=what, broker_url=redact_url(cfg.broker.url),
                    attempt=state.attempt_number, error=str(state.outcome.exception()),
                    retry_in_s=round(state.next_action.sleep, 2))

    retrying = Retrying(
        retry=retry_if_exception_type(CONNECTION_ERRORS),
        wait=wait_random_exponential(multiplier=0.5, max=cfg.broker.reconnect_max_s),
        stop=lambda _state: should_stop(),
        sleep=_sleep, before_sleep=_log_attempt, reraise=True)
    return retrying(pika.BlockingConnection, connection_parameters(cfg))


# -- consumer -----------------------------------------------------------------------
class AmqpTransport(Transport):
    name = "amqp"
    counts_deliveries = False   # no delivery counter on classic queues: the worker counts

    def __init__(self, cfg: Config, worker_id: str, auto_ack: bool = False) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.queue = cfg.queue.name
        self._auto_ack = auto_ack          # test-only demonstration mode: loses tasks
        self._conn: pika.BlockingConnection | None = None
        self._ch: Any = None
        self._pub: Any = None
        self._generation = 0
        self._consumer_tag: str | None = None
        self._on_delivery: DeliveryCallback | None = None
        self._consuming = False
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._unsettled: dict[int, Delivery] = {}
        self._held: list[tuple[Delivery, Settlement]] | None = None
        self.reconnects = 0

    # connection life cycle
    def connect(self) -> None:
        try:
            conn = connect_with_backoff(self.cfg, self.should_stop, "consumer")
        except RetryError:
            return
        except CONNECTION_ERRORS:
            if self.should_stop():
                return
            raise
        self._conn = conn
        self._generation += 1
        self._ch = conn.channel()
        declare_topology(self._ch, self.cfg)
        self._ch.basic_qos(prefetch_count=self.cfg.queue.prefetch)
        self._pub = conn.channel()
        self._pub.confirm_delivery()
        log.info("broker_connected", transport="amqp", broker_url=redact_url(self.cfg.broker.url),
                 queue=self.queue, prefetch=self.cfg.queue.prefetch, generation=self._generation)
        if self._consuming:
            self._basic_consume()

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.is_open and self._ch is not None and self._ch.is_open

    def start_consuming(self, on_delivery: DeliveryCallback, free_slots: Callable[[], int]) -> None:
        self._on_delivery = on_delivery
        self._consuming = True
        if self.connected:
            self._basic_consume()

    def _basic_consume(self) -> None:
        self._consumer_tag = self._ch.basic_consume(self.queue, self._on_message, auto_ack=self._auto_ack)

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
                    unsettled=len(self._unsettled), generation=self._generation)
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
                            handle=(self._generation, method.delivery_tag), headers=headers,
                            broker_redeliveries=int(broker_count) if broker_count is not None else None)
        if not self._auto_ack:
            self._unsettled[method.delivery_tag] = delivery
        assert self._on_delivery is not None
        self._on_delivery(delivery)

    def pending_settlements(self) -> int:
        with self._pending_lock:
            return self._pending

    def settle(self, delivery: Delivery, settlement: Settlement) -> None:
        """Called from pool threads: queue the work on the connection's thread."""
        conn = self._conn
        with self._pending_lock:
            self._pending += 1
        try:
            if conn is None:
                raise pex.ConnectionWrongStateError("not connected")
            conn.add_callback_threadsafe(partial(self._settle_now, delivery, settlement))
        except (pex.ConnectionWrongStateError, AttributeError, ValueError, OSError) as exc:
            self._done_pending()
            log.warning("settle_dropped", reason="connection gone", error=repr(exc),
                        message_id=delivery.message_id, action=settlement.action.value)

    def _done_pending(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _settle_now(self, delivery: Delivery, settlement: Settlement, may_hold: bool = True) -> None:
        """Runs on the connection thread inside process_data_events."""
        if self._held is not None and may_hold:
            self._held.append((delivery, settlement))
            return
        try:
            generation, tag = delivery.handle
            if generation != self._generation or not self.connected:
                log.info("stale_delivery_tag_dropped", delivery_tag=tag, generation=generation,
                         current=self._generation, action=settlement.action.value,
                         task_id=delivery.message_id)
                return
            self._unsettled.pop(tag, None)
            if self._auto_ack:
                return
            self._apply(delivery, settlement, tag)
        except CONNECTION_ERRORS as exc:
            self._lost(exc)
        finally:
            self._done_pending()

    def _apply(self, delivery: Delivery, settlement: Settlement, tag: int) -> None:
        action = settlement.action
        if action in (Action.ACK, Action.SKIP):
            self._ch.basic_ack(tag)
        elif action is Action.RELEASE:
            self._ch.basic_nack(tag, requeue=True)
        elif action is Action.RETRY:
            target = retry_queue_name(self.queue, tier_for(settlement.delay_s, self.cfg.queue.retry_delays_s))
            self._forward(delivery, settlement, target, tag, delivery.attempt + 1)
        elif action is Action.DEAD:
            self._forward(delivery, settlement, dead_queue_name(self.queue), tag, delivery.attempt)

    def _forward(self, delivery: Delivery, settlement: Settlement, target: str, tag: int,
                 attempt: int) -> None:
        """Publish a copy with our headers and a confirm; only then ack the original."""
        task_id = settlement.task.task_id if settlement.task else (delivery.message_id or "")
        headers = {**delivery.headers, ATTEMPT_HEADER: attempt,
                   ERROR_HEADER: truncate(settlement.error), REASON_HEADER: settlement.reason,
                   ORIGIN_HEADER: delivery.origin}
        try:
            self._pub.basic_publish("", target, delivery.body, message_properties(task_id, headers),
                                    mandatory=True)
        except (pex.UnroutableError, pex.NackError) as exc:
            log.error("forward_failed", target=target, task_id=task_id, attempt=attempt,
                      error=repr(exc))
            self._ch.basic_nack(tag, requeue=True)
            return
        self._ch.basic_ack(tag)

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


# -- publisher ------------------------------------------------------------------------
class AmqpPublisher(Publisher):
    """Persistent, mandatory, confirmed publishes with a window of outstanding confirms.

    Uses pika's asynchronous SelectConnection so confirms are batched: a
    BlockingChannel waits for each confirm in turn (the reference's method), which
    caps throughput at one round trip per message.
    """

    def __init__(self, cfg: Config, window: int = 1000, timeout_s: float = 60.0,
                 declare: bool = True) -> None:
        self.cfg = cfg
        self.declare = declare
        self.window = window
        self.timeout_s = timeout_s

    def publish(self, tasks: Sequence[Task], progress: ProgressCallback | None = None,
                attempt_reset: bool = False, routing_key: str | None = None) -> PublishReport:
        if not tasks:
            return PublishReport()
        return _BatchPublish(self.cfg, list(tasks), routing_key or self.cfg.queue.name,
                             self.window, self.timeout_s, progress, self.declare,
                             attempt_reset).run()

    def close(self) -> None:
        pass


class _BatchPublish:
    """One publish run on a SelectConnection; its ioloop stops when every confirm is in."""

    def __init__(self, cfg: Config, tasks: list[Task], routing_key: str, window: int,
                 timeout_s: float, progress: ProgressCallback | None, declare: bool,
                 attempt_reset: bool) -> None:
        self.cfg = cfg
        self.tasks = tasks
        self.routing_key = routing_key
        self.window = window
        self.timeout_s = timeout_s
        self.progress = progress
        self.declare = declare
        self.headers = {ATTEMPT_HEADER: 1} if attempt_reset else {}
        self.report = PublishReport()
        self.next_index = 0
        self.seq = 0
        self.outstanding: dict[int, str] = {}      # delivery tag -> task id, in tag order
        self.returned: dict[str, str] = {}
        self.conn: Any = None
        self.channel: Any = None
        self.error = ""

    def run(self) -> PublishReport:
        self.conn = pika.SelectConnection(connection_parameters(self.cfg), on_open_callback=self._on_open,
                                          on_open_error_callback=self._on_open_error,
                                          on_close_callback=self._on_conn_closed)
        self.conn.ioloop.call_later(self.timeout_s, self._on_timeout)
        self.conn.ioloop.start()
        self._fail_rest(self.error or "no confirm")
        return self.report

    def _on_open(self, conn: Any) -> None:
        conn.channel(on_open_callback=self._on_channel)

    def _on_open_error(self, conn: Any, exc: BaseException) -> None:
        self.error = f"connect failed: {exc!r}"
        conn.ioloop.stop()

    def _on_conn_closed(self, conn: Any, reason: BaseException) -> None:
        if not self.error and self._remaining():
            self.error = f"connection closed: {reason!r}"
        conn.ioloop.stop()

    def _on_channel(self, channel: Any) -> None:
        self.channel = channel
        channel.add_on_return_callback(self._on_return)
        channel.add_on_close_callback(self._on_channel_closed)
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_select_ok)

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if not self.error and self._remaining():
            self.error = f"channel closed: {reason!r}"
        if self.conn.is_open:
            self.conn.close()

    def _on_select_ok(self, _frame: Any) -> None:
        if self.declare:
            self._declare_next(topology(self.cfg))
        else:
            self._pump()

    def _declare_next(self, remaining: list[tuple[str, dict[str, Any]]]) -> None:
        if not remaining:
            self._pump()
            return
        (queue, args), rest = remaining[0], remaining[1:]
        self.channel.queue_declare(queue, durable=True, arguments=args,
                                   callback=lambda _f: self._declare_next(rest))

    def _pump(self) -> None:
        while len(self.outstanding) < self.window and self.next_index < len(self.tasks):
            task = self.tasks[self.next_index]
            self.next_index += 1
            self.seq += 1
            self.outstanding[self.seq] = task.task_id
            self.channel.basic_publish("", self.routing_key, task.to_body(),
                                       message_properties(task.task_id, dict(self.headers)),
                                       mandatory=True)
        self._maybe_finish()

    def _on_return(self, channel: Any, method: Any, props: Any, body: bytes) -> None:
        self.returned[props.message_id] = f"unroutable: {method.reply_code} {method.reply_text}"

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        tags = [t for t in self.outstanding if t <= method.delivery_tag] if method.multiple else [method.delivery_tag]
        for tag in tags:
            task_id = self.outstanding.pop(tag, None)
            if task_id is None:
                continue
            if not acked:
                self.report.failed[task_id] = "nacked by broker"
            elif task_id in self.returned:
                self.report.failed[task_id] = self.returned.pop(task_id)
            else:
                self.report.confirmed.append(task_id)
        if self.progress:
            self.progress(len(self.report.confirmed) + len(self.report.failed), len(self.tasks))
        self._pump()

    def _remaining(self) -> int:
        return len(self.tasks) - len(self.report.confirmed) - len(self.report.failed)

    def _maybe_finish(self) -> None:
        if not self._remaining() and self.conn.is_open:
            self.conn.close()

    def _on_timeout(self) -> None:
        if self._remaining():
            self.error = f"timed out after {self.timeout_s:g}s waiting for confirms"
            if self.conn.is_open:
                self.conn.close()

    def _fail_rest(self, reason: str) -> None:
        done = set(self.report.confirmed) | set(self.report.failed)
        for task in self.tasks:
            if task.task_id not in done:
                self.report.failed[task.task_id] = reason


# -- status ---------------------------------------------------------------------------
def amqp_stats(cfg: Config) -> dict[str, Any]:
    """Depths by passive declare (no management plugin needed)."""
    conn = pika.BlockingConnection(connection_parameters(cfg))
    try:
        out: dict[str, Any] = {"transport": "amqp", "queue": cfg.queue.name, "retry_tiers": {}}
        for queue, _args in topology(cfg):
            channel = conn.channel()
            try:
                ok = channel.queue_declare(queue, passive=True).method
                depth, consumers = ok.message_count, ok.consumer_count
            except pex.ChannelClosedByBroker:
                depth, consumers = None, None
            if channel.is_open:
                channel.close()
            if queue == cfg.queue.name:
                out.update(depth=depth, consumers=consumers)
            elif queue == dead_queue_name(cfg.queue.name):
                out["dead_depth"] = depth
            else:
                out["retry_tiers"][queue] = depth
        return out
    finally:
        conn.close()
