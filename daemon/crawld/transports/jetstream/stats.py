"""Stream and consumer numbers for ``crawld status``.

Partitioned fleets: the top-level ``num_pending`` / ``num_ack_pending`` / ``num_redelivered``
/ ``num_waiting`` / ``delivered_consumer_seq`` count the whole job (intake plus every shard
durable), ``delivered_stream_seq`` is the highest any of them delivered (ack floors stay
the intake durable's), ``intake`` holds the intake durable's
own numbers, ``shard_depths`` each shard's (num_pending + num_ack_pending), and ``leases``
who owns which shard (from the ``CRAWL_SHARDS`` bucket).
"""
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
from crawld.fleet.partition import shard_label
from crawld.transports.jetstream.leases import BUCKET, ShardLeases
from crawld.transports.jetstream.topology import (DEAD_STREAM, STREAM, partitioned,
                                                  shard_consumer_name)

SUMMED = ("num_pending", "num_ack_pending", "num_redelivered", "num_waiting")


def jetstream_stats(cfg: Config, timeout_s: float = API_TIMEOUT_S) -> dict[str, Any]:
    """Numbers for ``crawld status``; raises ConnectionError if the server is unreachable."""
    loop = asyncio.new_event_loop()
    try:
        try:
            return loop.run_until_complete(_stats(cfg, timeout_s))
        except asyncio.TimeoutError as exc:      # nats.errors.TimeoutError too
            # A cluster that just lost a node answers again once its leaders are re-elected.
            log.info("status_retry", error=repr(exc))
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
        if partitioned(cfg):
            out.update(await _shard_stats(js, cfg, out))
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


async def _shard_stats(js: JetStreamContext, cfg: Config, intake: dict[str, Any]) -> dict[str, Any]:
    """Intake depth, per-shard depths (max / total) and the lease table."""
    shards = cfg.queue.shards
    names = {shard_consumer_name(cfg, i): shard_label(i, shards) for i in range(shards)}
    depths: dict[str, int] = {}
    sums = {key: 0 for key in (*SUMMED, "delivered_consumer_seq")}
    last_delivered = intake.get("delivered_stream_seq") or 0
    for info in await _all_consumers(js):
        label = names.get(info.name)
        if label is None:
            continue
        depths[label] = (info.num_pending or 0) + (info.num_ack_pending or 0)
        for key in SUMMED:
            sums[key] += getattr(info, key, 0) or 0
        sums["delivered_consumer_seq"] += info.delivered.consumer_seq if info.delivered else 0
        last_delivered = max(last_delivered, info.delivered.stream_seq if info.delivered else 0)
    out: dict[str, Any] = {"partition": cfg.queue.partition, "shards": shards,
                           "intake": {k: intake.get(k) for k in ("consumer_exists", *SUMMED)},
                           "intake_depth": (intake.get("num_pending") or 0) + (intake.get("num_ack_pending") or 0),
                           "shard_depths": {k: v for k, v in sorted(depths.items()) if v},
                           "shard_depth_max": max(depths.values(), default=0),
                           "shard_depth_total": sum(depths.values())}
    for key in sums:   # the job as a whole: what is still to do anywhere, deliveries made
        out[key] = (intake.get(key) or 0) + sums[key]
    out["delivered_stream_seq"] = last_delivered     # the last stream message any of them delivered
    try:
        out.update(await _lease_table(js, cfg))
    except RETRYABLE as exc:   # status still shows the depths
        out["leases_error"] = repr(exc)
    return out


async def _all_consumers(js: JetStreamContext) -> list[Any]:
    """Every consumer of CRAWL, 256 per page."""
    out: list[Any] = []
    try:
        while True:
            page = await js.consumers_info(STREAM, offset=len(out) or None)
            out.extend(page)
            if len(page) < 256:
                return out
    except jse.NotFoundError:
        return out


async def _lease_table(js: JetStreamContext, cfg: Config) -> dict[str, Any]:
    try:
        kv = await js.key_value(BUCKET)
    except jse.BucketNotFoundError:
        return {"leases": {}, "live_workers": [], "shards_unowned": cfg.queue.shards}
    table = await ShardLeases(kv, "crawld-status", cfg.queue.shards).snapshot()
    now = time.time()
    leases = {shard_label(i, cfg.queue.shards): {"owner": e.owner, "expires_in_s": round(e.expires - now, 1)}
              for i, e in sorted(table.shards.items()) if not e.free(now)}
    live = sorted(e.owner for e in table.workers.values() if not e.free(now))
    owned: dict[str, int] = {}
    for lease in leases.values():
        owned[lease["owner"]] = owned.get(lease["owner"], 0) + 1
    return {"leases": leases, "live_workers": live, "shards_owned": owned,
            "shards_unowned": cfg.queue.shards - len(leases)}
