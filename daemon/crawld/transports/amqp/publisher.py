"""Publishing tasks to the work queue: persistent, mandatory, confirmed, windowed."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import pika

from crawld.config import Config
from crawld.task import Task
from crawld.transports.amqp.connection import CONNECTION_ERRORS, connection_parameters, message_properties
from crawld.transports.amqp.topology import declare_topology, route_for
from crawld.transports.base import ATTEMPT_HEADER, ProgressCallback, PublishReport, Publisher


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
        """Each task goes straight to its shard queue (or ``routing_key`` when given)."""
        if not tasks:
            return PublishReport()
        if self.declare:
            self._declare()
        route = (lambda task: routing_key) if routing_key else (lambda task: route_for(self.cfg, task.url))
        return _BatchPublish(self.cfg, list(tasks), route, self.window, self.timeout_s, progress,
                             attempt_reset).run()

    def _declare(self) -> None:
        """Queues, exchange and bindings on a short blocking connection (idempotent);
        a connect failure here is reported per task by the publish run that follows."""
        try:
            conn = pika.BlockingConnection(connection_parameters(self.cfg))
        except CONNECTION_ERRORS:
            return
        try:
            declare_topology(conn.channel(), self.cfg)
            self.declare = False
        finally:
            if conn.is_open:
                conn.close()

    def close(self) -> None:
        pass


class _BatchPublish:
    """One publish run on a SelectConnection; its ioloop stops when every confirm is in."""

    def __init__(self, cfg: Config, tasks: list[Task], route: Callable[[Task], str], window: int,
                 timeout_s: float, progress: ProgressCallback | None, attempt_reset: bool) -> None:
        self.cfg = cfg
        self.tasks = tasks
        self.route = route
        self.window = window
        self.timeout_s = timeout_s
        self.progress = progress
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
        self._pump()

    def _pump(self) -> None:
        while len(self.outstanding) < self.window and self.next_index < len(self.tasks):
            task = self.tasks[self.next_index]
            self.next_index += 1
            self.seq += 1
            self.outstanding[self.seq] = task.task_id
            self.channel.basic_publish("", self.route(task), task.to_body(),
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

