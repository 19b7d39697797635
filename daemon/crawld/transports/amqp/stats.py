"""Queue depths for ``crawld status``."""
from __future__ import annotations

from typing import Any

import pika
import pika.exceptions as pex

from crawld.config import Config
from crawld.transports.amqp.connection import connection_parameters
from crawld.transports.amqp.topology import dead_queue_name, partitioned, shard_queue_names, topology


def amqp_stats(cfg: Config) -> dict[str, Any]:
    """Depths by passive declare (no management plugin needed)."""
    conn = pika.BlockingConnection(connection_parameters(cfg))
    try:
        out: dict[str, Any] = {"transport": "amqp", "queue": cfg.queue.name, "retry_tiers": {}}
        shards = set(shard_queue_names(cfg)) if partitioned(cfg) else set()
        shard_depths: list[int] = []
        for queue, _args in topology(cfg):
            depth, consumers = _passive_depth(conn, queue)
            if queue == cfg.queue.name:
                out.update(depth=depth, consumers=consumers)
            elif queue == dead_queue_name(cfg.queue.name):
                out["dead_depth"] = depth
            elif queue in shards:
                shard_depths.append(depth or 0)
            else:
                out["retry_tiers"][queue] = depth
        if shards:
            out.update(_shard_summary(out.get("depth"), shard_depths))
        return out
    finally:
        conn.close()


def _shard_summary(intake: int | None, depths: list[int]) -> dict[str, Any]:
    """``depth`` stays "tasks waiting" (intake + shards), so dashboards keep their meaning."""
    total = sum(depths)
    return {"intake_depth": intake, "shard_depth_total": total,
            "shard_depth_max": max(depths, default=0), "shards": len(depths),
            "depth": (intake or 0) + total}


def _passive_depth(conn: pika.BlockingConnection, queue: str) -> tuple[int | None, int | None]:
    """(messages, consumers), or (None, None) when the queue does not exist. A channel per
    queue: the broker closes the channel on a passive declare of a missing queue."""
    channel = conn.channel()
    try:
        ok = channel.queue_declare(queue, passive=True).method
        return ok.message_count, ok.consumer_count
    except pex.ChannelClosedByBroker:
        return None, None
    finally:
        if channel.is_open:
            channel.close()
