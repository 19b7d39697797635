"""Stream and consumer numbers for ``crawld status``."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
import nats.js.errors as jse
from nats.js import JetStreamContext

from crawld.config import Config, redact_url
from crawld.transports.jetstream.connection import (API_TIMEOUT_S, RETRYABLE, close_quietly, log,
                                                    servers)
from crawld.transports.jetstream.topology import DEAD_STREAM, STREAM


def jetstream_stats(cfg: Config, timeout_s: float = API_TIMEOUT_S) -> dict[str, Any]:
    """Numbers for ``crawld status``; raises ConnectionError if the server is unreachable."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_stats(cfg, timeout_s))
    finally:
        loop.close()


async def _stats(cfg: Config, timeout_s: float) -> dict[str, Any]:
    try:
        # max_reconnect_attempts=1: nats-py's initial connect otherwise retries a dead
        # server 60 times, 2 s apart, even with allow_reconnect=False.
        nc = await nats.connect(servers=servers(cfg), name="crawld-status", allow_reconnect=False,
                                max_reconnect_attempts=1, reconnect_time_wait=0.05,
                                connect_timeout=2, error_cb=_quiet_error)
    except RETRYABLE as exc:
        raise ConnectionError(f"cannot reach NATS at {redact_url(cfg.broker.url)}: {exc!r}") from None
    try:
        js = nc.jetstream(timeout=timeout_s)
        out: dict[str, Any] = {"transport": "jetstream", "stream": STREAM, "consumer": cfg.queue.name,
                               "dead_stream": DEAD_STREAM}
        out.update(await _stream_stats(js))
        out.update(await _consumer_stats(js, cfg.queue.name))
        out.update(await _dead_stats(js))
        return out
    finally:
        await close_quietly(nc)


async def _quiet_error(exc: Exception) -> None:
    log.debug("broker_error", transport="jetstream", role="status", error=repr(exc))


async def _stream_stats(js: JetStreamContext) -> dict[str, Any]:
    try:
        info = await js.stream_info(STREAM)
    except jse.NotFoundError:
        return {"stream_exists": False, "messages": 0, "depth": 0, "bytes": 0, "oldest_waiting_s": None}
    state = info.state
    out = {"stream_exists": True, "messages": state.messages, "depth": state.messages,
           "bytes": state.bytes, "first_seq": state.first_seq, "last_seq": state.last_seq,
           "consumers": state.consumer_count, "oldest_waiting_s": None}
    if state.messages:
        try:   # the first message still in a WorkQueue stream is the oldest unfinished task
            first = await js.get_msg(STREAM, state.first_seq)
            if first.time is not None:
                out["oldest_waiting_s"] = round(max(0.0, time.time() - first.time.timestamp()), 3)
        except (jse.NotFoundError, asyncio.TimeoutError):
            pass   # acked in between: not worth a retry for a status line
    return out


async def _consumer_stats(js: JetStreamContext, name: str) -> dict[str, Any]:
    try:
        info = await js.consumer_info(STREAM, name)
    except jse.NotFoundError:
        return {"consumer_exists": False}
    return {"consumer_exists": True, "num_pending": info.num_pending,
            "num_ack_pending": info.num_ack_pending, "num_redelivered": info.num_redelivered,
            "num_waiting": info.num_waiting,
            "delivered_consumer_seq": info.delivered.consumer_seq if info.delivered else 0,
            "delivered_stream_seq": info.delivered.stream_seq if info.delivered else 0,
            "ack_floor_consumer_seq": info.ack_floor.consumer_seq if info.ack_floor else 0,
            "ack_floor_stream_seq": info.ack_floor.stream_seq if info.ack_floor else 0,
            "ack_wait_s": info.config.ack_wait, "max_ack_pending": info.config.max_ack_pending}


async def _dead_stats(js: JetStreamContext) -> dict[str, Any]:
    try:
        info = await js.stream_info(DEAD_STREAM)
    except jse.NotFoundError:
        return {"dead_messages": 0, "dead_bytes": 0}
    return {"dead_messages": info.state.messages, "dead_bytes": info.state.bytes}
