"""JetStream names and declarations: the work and dead streams and the durable consumers.

Create-or-bind, never replace: a differing existing config is reported as drift and kept,
because replacing a stream or consumer under running workers would lose their state. The
one exception is additive: subjects missing from the work stream are added (an existing
deployment gains ``crawl.shard.>`` when it upgrades) and fast-ingest batches are allowed
on it (``allow_batched``, for the publisher's one-ack-per-flow batches, fastbatch.py);
nothing is ever removed.

Partitioned fleets (``queue.partition`` host / domain) keep the intake durable
``<queue.name>`` on ``crawl.url.>`` for plain publishers and add one durable per shard,
``<queue.name>_shard_<label>`` on ``crawl.shard.<label>``: every URL of a site lands in one
shard, and one worker at a time owns a shard (leases.py).
"""
from __future__ import annotations

import asyncio
import functools
import time
from enum import Enum
from typing import Any, Awaitable, Sequence, TypeVar

import nats.js.errors as jse
from nats.js import JetStreamContext
from nats.js.api import (AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy, DiscardPolicy, ReplayPolicy,
                         RetentionPolicy, StorageType, StreamConfig)

from crawld.config import Config
from crawld.fleet.partition import shard_label, shard_of
from crawld.task import Task, safe_source
from crawld.transports.base import TopologyError
from crawld.transports.jetstream.connection import RETRYABLE, log

STREAM = "CRAWL"
DEAD_STREAM = "CRAWL_DEAD"
WORK_PREFIX = "crawl.url."
DEAD_PREFIX = "crawl.dead."
WORK_FILTER = WORK_PREFIX + ">"
SHARD_PREFIX = "crawl.shard."
SHARD_FILTER = SHARD_PREFIX + ">"
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

# A cluster that has just formed, or has a node down, refuses a new replicated stream until
# enough of its servers are current (JSClusterNoPeersErr). Crawler hosts and NATS nodes
# often boot together: wait that out, bounded, rather than fail the boot (which halts the
# supervisor) or every publish.
NO_PLACEMENT_ERR = 10005
PLACEMENT_WAIT_S = 30.0
PLACEMENT_RETRY_MAX_S = 2.0

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


def partitioned(cfg: Config) -> bool:
    return cfg.queue.partition != "none"


@functools.lru_cache(maxsize=4096)
def shard_subject(shard: int, shards: int) -> str:
    return SHARD_PREFIX + shard_label(shard, shards)


@functools.lru_cache(maxsize=4096)     # asked per held delivery on every slot allocation
def shard_of_subject(subject: str, shards: int) -> int | None:
    """The shard a delivery came from (None: intake or anything else)."""
    if not subject.startswith(SHARD_PREFIX):
        return None
    token = subject[len(SHARD_PREFIX):]
    return int(token) if token.isdigit() and int(token) < shards else None


def shard_consumer_name(cfg: Config, shard: int) -> str:
    return f"{cfg.queue.name}_shard_{shard_label(shard, cfg.queue.shards)}"


def task_subject(cfg: Config, task: Task) -> str:
    """Where a publisher sends a task: straight to its shard when the fleet is partitioned
    (no routing hop), else the intake subject of its source, as plain publishers do."""
    shard = shard_of(task.url, cfg.queue.partition, cfg.queue.shards)
    return work_subject(task.source) if shard is None else shard_subject(shard, cfg.queue.shards)


def work_stream_config(cfg: Config) -> StreamConfig:
    return StreamConfig(
        name=STREAM, subjects=[WORK_FILTER, SHARD_FILTER], retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE, num_replicas=cfg.queue.replicas,
        duplicate_window=cfg.queue.duplicate_window_s, max_age=WORK_MAX_AGE_S,
        max_bytes=WORK_MAX_BYTES, discard=DiscardPolicy.NEW, allow_batched=True)


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
    """The intake durable (the only one with ``queue.partition = "none"``)."""
    return _durable(cfg, cfg.queue.name, WORK_FILTER)


def shard_consumer_config(cfg: Config, shard: int) -> ConsumerConfig:
    return _durable(cfg, shard_consumer_name(cfg, shard), shard_subject(shard, cfg.queue.shards))


def _durable(cfg: Config, name: str, filter_subject: str) -> ConsumerConfig:
    return ConsumerConfig(
        name=name, durable_name=name, filter_subject=filter_subject,
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


async def ensure_stream(js: JetStreamContext, want: StreamConfig, upgrade: bool = False) -> None:
    """Create the stream, or bind to it and report (never replace) a differing config;
    with ``upgrade``, subjects the existing stream lacks are added to it and the fast
    batches it allows are turned on."""
    try:
        info = await js.stream_info(want.name)
    except jse.NotFoundError:
        try:
            await add_stream_when_placed(js, want)
            log.info("jetstream_stream_created", stream=want.name, subjects=want.subjects,
                     replicas=want.num_replicas)
            return
        except jse.BadRequestError as exc:
            # Either another worker won a creation race (then it exists now), or the server
            # refuses it for good (e.g. another stream already owns the subjects).
            info = await _info_or_refuse(js.stream_info(want.name), f"stream {want.name}", exc)
    if upgrade:
        info = await _upgrade_in_place(js, info, want)
    diffs = config_drift(info.config, want, STREAM_DRIFT_FIELDS)
    if diffs:
        log.warning("jetstream_stream_drift", stream=want.name, diffs=diffs,
                    hint="existing stream kept as is; update it deliberately to apply the config")


async def add_stream_when_placed(js: JetStreamContext, want: StreamConfig,
                                 wait_s: float = PLACEMENT_WAIT_S) -> None:
    """``add_stream``, retried while the cluster has too few current servers for the
    replicas; past ``wait_s`` the refusal names the setting to check."""
    deadline = time.monotonic() + wait_s
    delay = 0.25
    while True:
        try:
            await js.add_stream(want)
            return
        except jse.APIError as exc:
            if exc.err_code != NO_PLACEMENT_ERR:
                raise
            if time.monotonic() + delay > deadline:
                raise TopologyError(
                    f"stream {want.name} refused by the server: {exc.description} "
                    f"(err_code {exc.err_code}) for {wait_s:.0f}s: queue.replicas = "
                    f"{want.num_replicas} needs that many JetStream servers up and current "
                    f"in the cluster") from None
            log.warning("jetstream_stream_placement_wait", stream=want.name,
                        replicas=want.num_replicas, error=exc.description, retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, PLACEMENT_RETRY_MAX_S)


async def _upgrade_in_place(js: JetStreamContext, info: Any, want: StreamConfig) -> Any:
    """Append the subjects that are missing and allow fast batches; keep everything else."""
    have = list(info.config.subjects or [])
    missing = [s for s in want.subjects or [] if s not in have]
    batched = bool(want.allow_batched) and not info.config.allow_batched
    if not missing and not batched:
        return info
    config = info.config
    config.subjects = have + missing
    config.allow_batched = config.allow_batched or want.allow_batched
    try:
        info = await js.update_stream(config)
    except jse.BadRequestError as exc:   # e.g. another stream already owns crawl.shard.>
        raise TopologyError(f"stream {want.name}: cannot upgrade it (add subjects {missing}, "
                            f"allow_batched {batched}): {exc.description} "
                            f"(err_code {exc.err_code})") from None
    log.info("jetstream_stream_upgraded", stream=want.name, added=missing,
             subjects=info.config.subjects, allow_batched=info.config.allow_batched)
    return info


async def _info_or_refuse(lookup: Awaitable[T], what: str, exc: jse.APIError) -> T:
    try:
        return await lookup
    except jse.NotFoundError:
        raise TopologyError(f"{what} refused by the server: {exc.description} "
                            f"(err_code {exc.err_code})") from None


async def ensure_streams(js: JetStreamContext, cfg: Config) -> None:
    await ensure_stream(js, work_stream_config(cfg), upgrade=True)
    await ensure_stream(js, dead_stream_config(cfg))


async def ensure_consumer(js: JetStreamContext, cfg: Config,
                          want: ConsumerConfig | None = None) -> dict[str, dict[str, Any]]:
    """Create-or-bind a durable (default: the intake one); returns the drift (also logged
    as a warning)."""
    return (await ensure_consumer_info(js, cfg, want))[1]


async def ensure_consumer_info(js: JetStreamContext, cfg: Config, want: ConsumerConfig | None = None
                               ) -> tuple[ConsumerInfo, dict[str, dict[str, Any]]]:
    """``ensure_consumer``, plus the consumer's info (its num_pending saves a request)."""
    want = want or consumer_config(cfg)
    name = want.durable_name or cfg.queue.name
    try:
        info = await js.consumer_info(STREAM, name)
    except jse.NotFoundError:
        try:
            info = await js.add_consumer(STREAM, want)
            log.info("jetstream_consumer_created", stream=STREAM, consumer=name,
                     filter_subject=want.filter_subject, ack_wait_s=want.ack_wait,
                     max_ack_pending=want.max_ack_pending)
            return info, {}
        except jse.BadRequestError as exc:
            try:   # lost a creation race to another worker: bind to its consumer
                info = await js.consumer_info(STREAM, name)
            except jse.NotFoundError:
                raise TopologyError(await _consumer_refusal(js, name, exc)) from None
    diffs = config_drift(info.config, want, CONSUMER_DRIFT_FIELDS)
    if diffs:
        log.warning("jetstream_consumer_drift", stream=STREAM, consumer=name, diffs=diffs,
                    hint="existing consumer kept as is; delete or update it to apply the config")
    return info, diffs


async def _consumer_refusal(js: JetStreamContext, name: str, exc: jse.APIError) -> str:
    """Name the consumers that already own the work queue: the usual cause is a renamed
    queue.name (a WorkQueue stream allows one consumer per subject)."""
    try:
        others = [c.name for c in await js.consumers_info(STREAM)]
    except RETRYABLE:
        others = []
    return (f"stream {STREAM} refused durable consumer {name!r}: {exc.description} "
            f"(err_code {exc.err_code}). Existing consumers: {others or 'unknown'}. A WorkQueue "
            f"stream allows one consumer per subject: set queue.name to the existing one, or "
            f"delete that consumer deliberately.")

