"""nats-py connections: servers, reconnect policy, the connect loop, quiet close."""
from __future__ import annotations

import asyncio
import random
from typing import Any, Awaitable, Callable, TypeVar

import nats
import nats.errors
from nats.aio.client import Client

from crawld.config import Config
from crawld.logs import get_logger
from crawld.transports.common import Backoff

log = get_logger("crawld.jetstream")

API_TIMEOUT_S = 5.0          # JetStream API requests and dead-letter PubAcks
RECONNECT_BASE_S = 0.1       # first reconnect delay ceiling; doubles per failed attempt

RETRYABLE = (OSError, asyncio.TimeoutError, nats.errors.Error)

T = TypeVar("T")


def servers(cfg: Config) -> list[str]:
    """``broker.url`` may list several servers, comma-separated (a cluster)."""
    return [url.strip() for url in cfg.broker.url.split(",") if url.strip()]


def _reconnect_handler(cap_s: float) -> Callable[[list[Any], dict[str, Any]], tuple[Any, float]]:
    """nats-py's own reconnect waits a fixed time; we want capped, jittered exponential.

    nats-py calls this before each reconnect attempt with per-server attempt counts; we
    pick the least-tried server and a full-jitter delay.
    """
    def choose(servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        server = min(servers, key=lambda s: s.reconnects)
        ceiling = min(cap_s, RECONNECT_BASE_S * (2 ** min(server.reconnects, 20)))
        return server, random.uniform(0, ceiling)
    return choose


async def open_connection(cfg: Config, name: str, **callbacks: Any) -> Client:
    """One connection attempt (each server tried twice); never gives up once connected."""
    nc = await nats.connect(
        servers=servers(cfg), name=name, allow_reconnect=True,
        # Initial connect: fail fast so our tenacity loop owns the backoff and the stop check.
        max_reconnect_attempts=1, reconnect_time_wait=0.05, connect_timeout=2,
        ping_interval=cfg.broker.heartbeat_s or 120, max_outstanding_pings=2,
        reconnect_to_server_handler=_reconnect_handler(cfg.broker.reconnect_max_s), **callbacks)
    # Once connected, reconnect forever: a worker must not silently end up without a broker.
    nc.options["max_reconnect_attempts"] = -1
    return nc


async def retry_with_backoff(cfg: Config, should_stop: Callable[[], bool], what: str,
                             attempt: Callable[[], Awaitable[T]]) -> T | None:
    """Run ``attempt`` until it succeeds; jittered exponential waits, capped; None if stopped."""
    return await Backoff(cfg, should_stop, RETRYABLE, log, "jetstream", what).acall(attempt)


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """``event.wait()`` with a timeout, without the Task that ``asyncio.wait_for`` wraps
    around it (the publisher's PubAck window waits like this for every reply it needs)."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
        return True
    except TimeoutError:
        return False


async def close_quietly(nc: Client | None, timeout: float = 2.0) -> None:
    if nc is None or nc.is_closed:
        return
    try:
        if nc.is_connected:
            await nc.flush(timeout=timeout)   # acks/naks are fire-and-forget: push them out
    except RETRYABLE:
        pass
    try:
        await asyncio.wait_for(nc.close(), timeout)
    except RETRYABLE:
        pass


async def unsubscribe_quietly(sub: Any) -> None:
    try:
        await sub.unsubscribe()
    except (nats.errors.Error, OSError):   # the connection went with it
        pass
