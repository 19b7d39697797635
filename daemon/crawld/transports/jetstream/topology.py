"""JetStream names and declarations: the work and dead streams and the durable consumer.

Create-or-bind, never replace: a differing existing config is reported as drift and kept,
because replacing a stream or consumer under running workers would lose their state.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Awaitable, Sequence, TypeVar

import nats.js.errors as jse
from nats.js import JetStreamContext
from nats.js.api import (AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, ReplayPolicy,
                         RetentionPolicy, StorageType, StreamConfig)

from crawld.config import Config
from crawld.task import safe_source
from crawld.transports.base import TopologyError
from crawld.transports.jetstream.connection import RETRYABLE, log

STREAM = "CRAWL"
DEAD_STREAM = "CRAWL_DEAD"
WORK_PREFIX = "crawl.url."
DEAD_PREFIX = "crawl.dead."
WORK_FILTER = WORK_PREFIX + ">"
DEAD_FILTER = DEAD_PREFIX + ">"
MSG_ID_HEADER = "Nats-Msg-Id"

# Safety nets, not the normal path: the work stream rejects new publishes when full
# (DiscardPolicy.NEW, so the publisher sees a failure and the outbox resends later)
# instead of silently dropping queued tasks; a task older than two weeks is expired and
# shows up as lost in reconciliation.
WORK_MAX_AGE_S = 14 * 86400.0
WORK_MAX_BYTES = 4 << 30
DEAD_MAX_AGE_S = 30 * 86400.0
DEAD_MAX_BYTES = 1 << 30

STREAM_DRIFT_FIELDS = ("subjects", "retention", "storage", "num_replicas", "duplicate_window",
                       "max_age", "max_bytes", "discard")
CONSUMER_DRIFT_FIELDS = ("filter_subject", "ack_policy", "ack_wait", "max_deliver",
                         "max_ack_pending", "deliver_policy")

T = TypeVar("T")


def work_subject(source: str) -> str:
    """Subjects carry the source, never the URL (URLs would break subject tokens)."""
    return WORK_PREFIX + safe_source(source)


def dead_subject(source: str) -> str:
    return DEAD_PREFIX + safe_source(source)


def work_stream_config(cfg: Config) -> StreamConfig:
    return StreamConfig(
        name=STREAM, subjects=[WORK_FILTER], retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE, num_replicas=cfg.queue.replicas,
        duplicate_window=cfg.queue.duplicate_window_s, max_age=WORK_MAX_AGE_S,
        max_bytes=WORK_MAX_BYTES, discard=DiscardPolicy.NEW)


def dead_stream_config(cfg: Config) -> StreamConfig:
    return StreamConfig(
        name=DEAD_STREAM, subjects=[DEAD_FILTER], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, num_replicas=cfg.queue.replicas,
        duplicate_window=min(cfg.queue.duplicate_window_s, DEAD_MAX_AGE_S),
        max_age=DEAD_MAX_AGE_S, max_bytes=DEAD_MAX_BYTES, discard=DiscardPolicy.OLD)


def max_ack_pending(cfg: Config) -> int:
    """Consumer-wide ceiling on unacked messages, shared by every worker on every host.

    Messages waiting out a ``nak(delay=...)`` retry count as ack-pending until they are
    redelivered, so this must leave room for all delayed retries; a small value stalls
    the whole consumer behind them. Each worker bounds its own share by queue.prefetch.
    """
    return max(cfg.queue.max_ack_pending, cfg.queue.prefetch)


def consumer_config(cfg: Config) -> ConsumerConfig:
    name = cfg.queue.name
    return ConsumerConfig(
        name=name, durable_name=name, filter_subject=WORK_FILTER,
        ack_policy=AckPolicy.EXPLICIT, ack_wait=float(cfg.queue.ack_wait_s),
        max_deliver=-1,   # see the module docstring: our code dead-letters at queue.max_deliver
        max_ack_pending=max_ack_pending(cfg), deliver_policy=DeliverPolicy.ALL,
        replay_policy=ReplayPolicy.INSTANT)



def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float):
        return round(value, 3)
    return value


def config_drift(have: Any, want: Any, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{field: {"have": ..., "want": ...}}`` for every field that differs."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        h, w = _plain(getattr(have, name, None)), _plain(getattr(want, name, None))
        if h != w:
            out[name] = {"have": h, "want": w}
    return out


async def ensure_stream(js: JetStreamContext, want: StreamConfig) -> None:
    """Create the stream, or bind to it and report (never replace) a differing config."""
    try:
        info = await js.stream_info(want.name)
    except jse.NotFoundError:
        try:
            await js.add_stream(want)
            log.info("jetstream_stream_created", stream=want.name, subjects=want.subjects,
                     replicas=want.num_replicas)
            return
        except jse.BadRequestError as exc:
            # Either another worker won a creation race (then it exists now), or the server
            # refuses it for good (e.g. another stream already owns the subjects).
            info = await _info_or_refuse(js.stream_info(want.name), f"stream {want.name}", exc)
    diffs = config_drift(info.config, want, STREAM_DRIFT_FIELDS)
    if diffs:
        log.warning("jetstream_stream_drift", stream=want.name, diffs=diffs,
                    hint="existing stream kept as is; update it deliberately to apply the config")


async def _info_or_refuse(lookup: Awaitable[T], what: str, exc: jse.APIError) -> T:
    try:
        return await lookup
    except jse.NotFoundError:
        raise TopologyError(f"{what} refused by the server: {exc.description} "
                            f"(err_code {exc.err_code})") from None


async def ensure_streams(js: JetStreamContext, cfg: Config) -> None:
    await ensure_stream(js, work_stream_config(cfg))
    await ensure_stream(js, dead_stream_config(cfg))


async def ensure_consumer(js: JetStreamContext, cfg: Config) -> dict[str, dict[str, Any]]:
    """Create-or-bind the durable; returns the drift (also logged as a warning)."""
    want = consumer_config(cfg)
    try:
        info = await js.consumer_info(STREAM, cfg.queue.name)
    except jse.NotFoundError:
        try:
            await js.add_consumer(STREAM, want)
            log.info("jetstream_consumer_created", stream=STREAM, consumer=cfg.queue.name,
                     ack_wait_s=want.ack_wait, max_ack_pending=want.max_ack_pending)
            return {}
        except jse.BadRequestError as exc:
            try:   # lost a creation race to another worker: bind to its consumer
                info = await js.consumer_info(STREAM, cfg.queue.name)
            except jse.NotFoundError:
                raise TopologyError(await _consumer_refusal(js, cfg, exc)) from None
    diffs = config_drift(info.config, want, CONSUMER_DRIFT_FIELDS)
    if diffs:
        log.warning("jetstream_consumer_drift", stream=STREAM, consumer=cfg.queue.name, diffs=diffs,
                    hint="existing consumer kept as is; delete or update it to apply the config")
    return diffs


async def _consumer_refusal(js: JetStreamContext, cfg: Config, exc: jse.APIError) -> str:
    """Name the consumers that already own the work queue: the usual cause is a renamed
    queue.name (a WorkQueue stream allows one consumer per subject)."""
    try:
        others = [c.name for c in await js.consumers_info(STREAM)]
    except RETRYABLE:
        others = []
    return (f"stream {STREAM} refused durable consumer {cfg.queue.name!r}: {exc.description} "
            f"(err_code {exc.err_code}). Existing consumers: {others or 'unknown'}. A WorkQueue "
            f"stream allows one consumer per subject: set queue.name to the existing one, or "
            f"delete that consumer deliberately.")

