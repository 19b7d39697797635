"""Publishing tasks to the work stream with PubAcks, deduplicated by ``Nats-Msg-Id``.

A publish of FAST_BATCH_MIN tasks or more goes as one fast-ingest batch (fastbatch.py: one
flow ack per ``window`` tasks); smaller ones, and streams that do not allow fast batches,
get a PubAck per task through ``AckWindow``.

A partitioned fleet gets each task straight on its shard subject (``crawl.shard.<label>``):
the routing hop through intake is only for plain publishers that know nothing of shards.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Sequence

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import Header

from crawld.config import Config
from crawld.task import Task
from crawld.transports.base import ProgressCallback, PublishReport, Publisher, TopologyError
from crawld.transports.jetstream.connection import (API_TIMEOUT_S, RETRYABLE, close_quietly, log,
                                                    open_connection, unsubscribe_quietly, wait_set)
from crawld.transports.jetstream.fastbatch import FastBatch, rejection
from crawld.transports.jetstream.topology import MSG_ID_HEADER, ensure_streams, task_subject


NO_RESPONDERS = "503"         # the server's status when no stream takes the subject
# Below this a fast batch saves little: its first message waits alone for the server's
# go-ahead (one round trip), and a PubAck each also tells which tasks were duplicates.
FAST_BATCH_MIN = 100


class JetStreamPublisher(Publisher):
    """Publishes with ``Nats-Msg-Id`` = task id; ``window`` PubAcks outstanding at once, or
    in a fast batch one flow ack per ``window`` tasks.

    A PubAck or flow ack (duplicate or not) means the stream holds the task: confirmed.
    Timeouts and errors go to ``failed``; the outbox resends them later (the id makes that
    safe).
    """

    def __init__(self, cfg: Config, window: int = 500, timeout_s: float = 10.0,
                 declare: bool = True) -> None:
        self.cfg = cfg
        self.window = max(1, window)
        self.timeout_s = timeout_s
        self.declare = declare
        # PubAcks with duplicate=True in the last publish(); None when it went as one fast
        # batch (the server's flow acks do not say which tasks it already had).
        self.duplicates: int | None = 0
        self.acks_heard = 0          # answers (PubAcks, flow acks) the last publish() took
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
        self.duplicates, self.acks_heard = 0, 0
        try:
            await self._connect()
        except (*RETRYABLE, TopologyError) as exc:
            reason = f"connect failed: {exc!r}"
            report.failed.update({t.task_id: reason for t in tasks})
            return report
        # Replays need a fresh id, or the duplicate window would swallow them.
        suffix = f":replay:{int(time.time() * 1000)}" if attempt_reset else ""
        assert self._nc is not None
        items = [(task_subject(self.cfg, t), t, t.task_id + suffix) for t in tasks]
        done = 0
        if len(items) >= FAST_BATCH_MIN:
            batch = FastBatch(self._nc, self.window, self.timeout_s, report, progress, len(tasks))
            done = await batch.run(items)
            self.acks_heard += batch.acks_heard
            self.duplicates = None
        if done < len(items):        # small, or the stream does not take fast batches
            window = AckWindow(self._nc, self.window, self.timeout_s, report, progress, len(tasks),
                               answered=done)
            await window.run(items[done:])
            self.acks_heard += window.acks_heard
            self.duplicates = window.duplicates if done == 0 else None
        return report

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.run_until_complete(close_quietly(self._nc))
        self._loop.close()
        self._nc = self._js = None


class AckWindow:
    """Publishes with reply subjects under one inbox and takes the PubAcks back on one
    subscription, as nats.go's PublishAsync does: no future, task or timer per message
    (``js.publish`` is a request each), at most ``window`` unanswered at once. A window
    that hears nothing for ``timeout_s`` gives up: what is unanswered is reported failed
    (the outbox sends it again; ``Nats-Msg-Id`` makes that safe)."""

    def __init__(self, nc: Client, window: int, timeout_s: float, report: PublishReport,
                 progress: ProgressCallback | None, total: int, answered: int = 0) -> None:
        self.nc = nc
        self.window = window
        self.timeout_s = timeout_s
        self.report = report
        self.progress = progress
        self.total = total
        self.answered = answered     # of ``total``: a fast batch may have settled some
        self.acks_heard = 0
        self.duplicates = 0
        self.inbox = nc.new_inbox()
        self.waiting: dict[str, tuple[str, Task]] = {}      # reply token -> (subject, task)
        self.heard = asyncio.Event()                         # a PubAck came back

    async def run(self, items: list[tuple[str, Task, str]]) -> None:
        sub = await self.nc.subscribe(self.inbox + ".*", cb=self._on_reply)
        try:
            sent = await self._send_all(items)
            while self.waiting and await self._hear():
                pass
        finally:
            await unsubscribe_quietly(sub)
        for _, task in self.waiting.values():
            self.report.failed[task.task_id] = f"no PubAck within {self.timeout_s:g}s"
        for _, task, _ in items[sent:]:
            self.report.failed.setdefault(task.task_id, f"not sent: no PubAck within {self.timeout_s:g}s")

    async def _send_all(self, items: list[tuple[str, Task, str]]) -> int:
        """Publish in order while the window has room; returns how many were tried."""
        for i, (subject, task, msg_id) in enumerate(items):
            while len(self.waiting) >= self.window:
                if not await self._hear():
                    return i
            token = str(i)
            self.waiting[token] = (subject, task)
            try:
                await self.nc.publish(subject, task.to_body(), reply=f"{self.inbox}.{token}",
                                      headers={MSG_ID_HEADER: msg_id})
            except (nats.errors.Error, OSError) as exc:
                self.waiting.pop(token, None)
                self.report.failed[task.task_id] = repr(exc)
        return len(items)

    async def _hear(self) -> bool:
        """Wait for the next PubAck; False after ``timeout_s`` of silence."""
        self.heard.clear()
        return await wait_set(self.heard, self.timeout_s)

    async def _on_reply(self, msg: Msg) -> None:
        self.acks_heard += 1
        entry = self.waiting.pop(msg.subject.rsplit(".", 1)[-1], None)
        if entry is None:
            return                  # answered after we gave up on it: reported failed already
        subject, task = entry
        error, duplicate = pub_ack_outcome(msg, subject)
        if error is None:
            self.report.confirmed.append(task.task_id)
            self.duplicates += duplicate
        else:
            self.report.failed[task.task_id] = error
        self.answered += 1
        self.heard.set()
        if self.progress is not None and (self.answered % 200 == 0 or self.answered == self.total):
            self.progress(self.answered, self.total)


def pub_ack_outcome(msg: Msg, subject: str) -> tuple[str | None, bool]:
    """(error or None, duplicate) of one PubAck, as ``js.publish`` would judge it."""
    data = msg.data
    if data.startswith(b'{"stream":') and b'"error"' not in data and b'"duplicate"' not in data \
            and not msg.headers:
        return None, False      # the usual answer, without a JSON parse per message
    if is_no_stream(msg):
        return f"no stream for subject {subject}", False
    try:
        answer = json.loads(msg.data)
    except ValueError:
        return f"unreadable PubAck: {msg.data[:200]!r}", False
    if "error" in answer:
        return rejection(answer["error"]), False
    return None, bool(answer.get("duplicate"))


def is_no_stream(msg: Msg) -> bool:
    """The server's "no responders" status: no stream takes the subject."""
    return bool(msg.headers) and msg.headers.get(Header.STATUS.value) == NO_RESPONDERS
