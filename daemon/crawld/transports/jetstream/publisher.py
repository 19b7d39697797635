"""Publishing tasks to the work stream with PubAcks, deduplicated by ``Nats-Msg-Id``.

A partitioned fleet gets each task straight on its shard subject (``crawl.shard.<label>``):
the routing hop through intake is only for plain publishers that know nothing of shards.
"""
from __future__ import annotations

import asyncio
import time
from typing import Sequence

import nats.errors
import nats.js.errors as jse
from nats.aio.client import Client
from nats.js import JetStreamContext

from crawld.config import Config
from crawld.task import Task
from crawld.transports.base import ProgressCallback, PublishReport, Publisher, TopologyError
from crawld.transports.jetstream.connection import (API_TIMEOUT_S, RETRYABLE, close_quietly, log,
                                                    open_connection)
from crawld.transports.jetstream.topology import MSG_ID_HEADER, ensure_streams, task_subject


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
        subject = task_subject(self.cfg, task)
        try:
            ack = await js.publish(subject, task.to_body(), timeout=self.timeout_s,
                                   headers={MSG_ID_HEADER: msg_id})
        except asyncio.TimeoutError:
            report.failed[task.task_id] = f"no PubAck within {self.timeout_s:g}s"
        except jse.NoStreamResponseError:
            report.failed[task.task_id] = f"no stream for subject {subject}"
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
        self._loop.run_until_complete(close_quietly(self._nc))
        self._loop.close()
        self._nc = self._js = None
