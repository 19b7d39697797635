"""Result events to the stream ``CRAWL_EVENTS`` (subject ``crawl.event.<status>``), PubAcked,
on the consumer's own connection.

The settle task of a delivery whose settlement carries an event publishes it and acks
only after the PubAck (settle.py): the loop multiplexes the publishes of every pending
settlement, so the events of a burst are confirmed in one round trip's time, and no
pool thread waits. ``Nats-Msg-Id`` = task id: a resend inside the duplicate window is
dropped by the server, and a consumer outside it deduplicates by ``task_id``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from crawld.config import Config
from crawld.task import safe_source
from crawld.transports.base import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX, ResultEvent, TopologyError
from crawld.transports.jetstream.connection import API_TIMEOUT_S, RETRYABLE
from crawld.transports.jetstream.publisher import is_no_stream, pub_ack_outcome
from crawld.transports.jetstream.topology import MSG_ID_HEADER, ensure_stream

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


Request = Callable[[str, bytes, float, dict[str, Any]], Awaitable[Msg]]


async def publish_event(js: JetStreamContext, request: Request, cfg: Config, event: ResultEvent,
                        timeout_s: float) -> str | None:
    """None once PubAcked, else why not after ``timeout_s`` of tries (nats-py reconnects
    underneath; a deleted stream is declared again). ``request`` sends it (replies.py)."""
    deadline = time.monotonic() + timeout_s
    subject = event_subject(event.status)
    error = "deadline passed before the first publish"
    while time.monotonic() < deadline:
        remaining = deadline - time.monotonic()
        try:
            answer = await request(subject, event.body, max(0.05, min(API_TIMEOUT_S, remaining)),
                                   {MSG_ID_HEADER: event.task_id})
            error, _duplicate = pub_ack_outcome(answer, subject)
            if error is None:
                return None
            if is_no_stream(answer):
                await ensure_stream(js, events_stream_config(cfg))
        except TopologyError as exc:
            return str(exc)
        except asyncio.TimeoutError:
            error = f"no PubAck for the event within {API_TIMEOUT_S:g}s"
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
