"""AMQP queue names and declarations: work queue, one retry queue per delay tier, dead queue.

Delayed retry happens outside the main queue: a retry tier is a queue with a queue-level
``x-message-ttl`` that dead-letters back to the work queue when the TTL runs out.
"""
from __future__ import annotations

from typing import Any

import pika.exceptions as pex

from crawld.config import Config
from crawld.transports.base import TopologyError


def retry_queue_name(queue: str, delay_s: float) -> str:
    return f"{queue}.retry.{delay_s:g}"


def dead_queue_name(queue: str) -> str:
    return f"{queue}.dead"


def work_queue_arguments(cfg: Config) -> dict[str, Any]:
    """Classic: no arguments, so a plain ``queue_declare(name, durable=True)`` interoperates."""
    if cfg.queue.type != "quorum":
        return {}
    return {"x-queue-type": "quorum",
            # Counts broker redeliveries (crashes); our own header counts retries. The
            # worker dead-letters at max_deliver (with a store row); this is the backstop
            # for a task that kills its worker before the worker can even look at it.
            "x-delivery-limit": cfg.queue.max_deliver + 2,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dead_queue_name(cfg.queue.name)}


def topology(cfg: Config) -> list[tuple[str, dict[str, Any]]]:
    """Every durable queue we use, with its arguments: work, one per retry tier, dead."""
    name = cfg.queue.name
    quorum = {"x-queue-type": "quorum"} if cfg.queue.type == "quorum" else {}
    queues = [(name, work_queue_arguments(cfg))]
    queues += [(retry_queue_name(name, delay), {**quorum, "x-message-ttl": int(delay * 1000),
                                                "x-dead-letter-exchange": "",
                                                "x-dead-letter-routing-key": name})
               for delay in cfg.queue.retry_delays_s]
    queues.append((dead_queue_name(name), dict(quorum)))
    return queues


def declare_topology(channel: Any, cfg: Config) -> None:
    try:
        for queue, arguments in topology(cfg):
            channel.queue_declare(queue, durable=True, arguments=arguments)
    except pex.ChannelClosedByBroker as exc:
        raise TopologyError(f"queue declaration refused by the broker ({exc.reply_code} "
                            f"{exc.reply_text}); queue.type or retry_delays_s differ from the "
                            f"existing queues") from None
