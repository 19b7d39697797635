"""Result events to the stream ``CRAWL_EVENTS`` (subject ``crawl.event.<status>``), PubAcked.

One events thread per worker runs an asyncio loop with its own NATS connection; pool
threads hand their event to it (``run_coroutine_threadsafe``) and wait for the PubAck.
nats-py multiplexes the publishes, so the events of every pool thread are in flight
together and confirmed in one round trip's time (the PubAck batching of the work
publisher). ``Nats-Msg-Id`` = task id: a resend inside the duplicate window is dropped by
the server, and a consumer outside it deduplicates by ``task_id``.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import TimeoutError as FutureTimeout

import nats.js.errors as jse
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from crawld.config import Config
from crawld.task import safe_source
from crawld.transports.base import (EVENTS_STREAM, EVENTS_SUBJECT_PREFIX, EventPublisher,
                                    TopologyError)
from crawld.transports.jetstream.connection import (API_TIMEOUT_S, RETRYABLE, close_quietly, log,
                                                    open_connection)
from crawld.transports.jetstream.topology import MSG_ID_HEADER, ensure_stream

BOOT_WAIT_S = 15.0
EVENTS_MAX_AGE_S = 7 * 86400.0     # consumers are expected to keep up; a week of slack
EVENTS_MAX_BYTES = 4 << 30
RESEND_PAUSE_S = 0.25


def events_stream_config(cfg: Config) -> StreamConfig:
    """A limits stream: publishes never fail because it is full, the oldest events go."""
    return StreamConfig(
        name=EVENTS_STREAM, subjects=[EVENTS_SUBJECT_PREFIX + ">"],
        retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
        num_replicas=cfg.queue.replicas, duplicate_window=cfg.queue.duplicate_window_s,
        max_age=EVENTS_MAX_AGE_S, max_bytes=EVENTS_MAX_BYTES, discard=DiscardPolicy.OLD)


def event_subject(status: str) -> str:
    return EVENTS_SUBJECT_PREFIX + safe_source(status)


class JetStreamEventPublisher(EventPublisher):
    def __init__(self, cfg: Config, worker_id: str) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._connecting: asyncio.Lock | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop.run_forever, name="crawld-events",
                                        daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._context(), self._loop)
        try:
            future.result(BOOT_WAIT_S)
        except TopologyError:
            raise
        except (FutureTimeout, *RETRYABLE) as exc:
            # the broker is not there yet: each publish connects and retries on its own
            log.warning("events_connect_failed", transport="jetstream", error=repr(exc))

    def publish(self, task_id: str, status: str, body: bytes, timeout_s: float) -> str | None:
        if not self._loop.is_running():
            return "event publisher closed"
        deadline = time.monotonic() + timeout_s
        future = asyncio.run_coroutine_threadsafe(
            self._publish(event_subject(status), body, task_id, deadline), self._loop)
        try:
            return future.result(timeout_s + 1.0)
        except FutureTimeout:
            future.cancel()
            return f"no PubAck for the event within {timeout_s:g}s"
        except FutureCancelled:
            # The publish ended cancelled: the stored row's event is unconfirmed, never
            # a failed task.
            return "event publish cancelled"

    def close(self) -> None:
        if self._thread is None or self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(close_quietly(self._nc), self._loop).result(5.0)
        except (FutureTimeout, *RETRYABLE):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)

    # -- on the events loop ----------------------------------------------------------------
    async def _context(self) -> JetStreamContext:
        """The connection, opened (and the stream declared) by the first caller that needs it."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._js is None or self._nc is None or self._nc.is_closed:
                await close_quietly(self._nc)
                self._nc = await open_connection(self.cfg, f"crawld-events-{self.worker_id}",
                                                 error_cb=self._on_error)
                js = self._nc.jetstream(timeout=API_TIMEOUT_S)
                await ensure_stream(js, events_stream_config(self.cfg))
                self._js = js
            return self._js

    async def _on_error(self, exc: Exception) -> None:
        log.warning("broker_error", transport="jetstream", role="events", error=repr(exc))

    async def _publish(self, subject: str, body: bytes, task_id: str, deadline: float) -> str | None:
        """Publish until PubAcked or the deadline; nats-py reconnects underneath."""
        error = "deadline passed before the first publish"
        while time.monotonic() < deadline:
            remaining = deadline - time.monotonic()
            try:
                js = await asyncio.wait_for(self._context(), remaining)
                await js.publish(subject, body, timeout=max(0.05, min(API_TIMEOUT_S, remaining)),
                                 headers={MSG_ID_HEADER: task_id})
                return None
            except jse.NoStreamResponseError:   # e.g. the stream was deleted: declare again
                self._js = None
                error = f"no stream for {subject}"
            except TopologyError as exc:
                return str(exc)
            except RETRYABLE as exc:
                error = repr(exc)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise           # we are being cancelled ourselves: let it end
                # Something underneath cancelled the PubAck wait (seen once while a broker
                # restart tore the connection down): one more failed try, not our end.
                error = "the PubAck wait was cancelled"
            await asyncio.sleep(min(RESEND_PAUSE_S, max(0.0, deadline - time.monotonic())))
        return error
