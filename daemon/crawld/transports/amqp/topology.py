"""AMQP queue names and declarations: work queue, one retry queue per delay tier, dead queue.

Delayed retry happens outside the main queue: a retry tier is a queue with a queue-level
``x-message-ttl`` that dead-letters back to the work queue when the TTL runs out.

Partitioned (``queue.partition`` = host | domain), the work queue stays the **intake**
that plain publishers use, and the work itself lives in ``queue.shards`` shard queues
``<name>.shard.<NN>`` declared with ``x-single-active-consumer``: every worker subscribes
to every shard and the broker lets exactly one consumer per shard receive, handing the
shard to the next one when its owner's channel closes. A shard's retry tiers must bring a
message back to *its* shard: copies are published to the headers exchange
``<name>.shard-retry`` with routing key = the shard queue and ``crawld-retry-tier`` = the tier;
the tier queue ``<name>.shard-retry.<d>`` dead-letters through the default exchange with
the message's own routing key, i.e. straight back into its shard queue.
"""
from __future__ import annotations

from typing import Any

import pika.exceptions as pex

from crawld.config import Config
from crawld.fleet.partition import shard_label, shard_of
from crawld.transports.base import TopologyError


def retry_queue_name(queue: str, delay_s: float) -> str:
    return f"{queue}.retry.{delay_s:g}"


def dead_queue_name(queue: str) -> str:
    return f"{queue}.dead"


# Not "x-...": RabbitMQ's headers exchange ignores x- headers when it matches bindings.
TIER_HEADER = "crawld-retry-tier"


def partitioned(cfg: Config) -> bool:
    return cfg.queue.partition != "none"


def shard_queue_name(queue: str, shard: int, shards: int) -> str:
    return f"{queue}.shard.{shard_label(shard, shards)}"


def shard_queue_names(cfg: Config) -> list[str]:
    return [shard_queue_name(cfg.queue.name, i, cfg.queue.shards) for i in range(cfg.queue.shards)]


def shard_retry_exchange(queue: str) -> str:
    return f"{queue}.shard-retry"


def shard_retry_queue_name(queue: str, delay_s: float) -> str:
    return f"{queue}.shard-retry.{delay_s:g}"


def tier_label(delay_s: float) -> str:
    return f"{delay_s:g}"


def route_for(cfg: Config, url: str) -> str:
    """The queue a task is published to: its shard's, or the work queue when unpartitioned."""
    shard = shard_of(url, cfg.queue.partition, cfg.queue.shards)
    return cfg.queue.name if shard is None else shard_queue_name(cfg.queue.name, shard, cfg.queue.shards)


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


def shard_queue_arguments(cfg: Config) -> dict[str, Any]:
    """Quorum queues with a single active consumer, whatever ``queue.type`` says: a classic
    queue's single active consumer is broken on RabbitMQ 3.10/3.11 (rabbitmq-server#5460:
    when the active consumer goes away holding unacked messages, the next one is never
    activated, and the next publish crashes the queue process). Quorum queues hand over
    correctly and count redeliveries (x-delivery-count); with ``queue.type = "quorum"`` they
    also dead-letter past the limit, like the work queue."""
    sac = {"x-queue-type": "quorum", "x-single-active-consumer": True}
    if cfg.queue.type != "quorum":
        return sac      # no broker-side delivery limit unless asked for, as on a classic queue
    return {**work_queue_arguments(cfg), **sac}


def topology(cfg: Config) -> list[tuple[str, dict[str, Any]]]:
    """Every durable queue we use, with its arguments: work, one per retry tier, dead;
    partitioned, also the shard queues and their retry tiers."""
    name = cfg.queue.name
    quorum = {"x-queue-type": "quorum"} if cfg.queue.type == "quorum" else {}
    queues = [(name, work_queue_arguments(cfg))]
    queues += [(retry_queue_name(name, delay), {**quorum, "x-message-ttl": int(delay * 1000),
                                                "x-dead-letter-exchange": "",
                                                "x-dead-letter-routing-key": name})
               for delay in cfg.queue.retry_delays_s]
    queues.append((dead_queue_name(name), dict(quorum)))
    if partitioned(cfg):
        queues += [(shard, shard_queue_arguments(cfg)) for shard in shard_queue_names(cfg)]
        # No x-dead-letter-routing-key: the copy keeps its routing key, its shard queue.
        queues += [(shard_retry_queue_name(name, delay), {**quorum, "x-message-ttl": int(delay * 1000),
                                                          "x-dead-letter-exchange": ""})
                   for delay in cfg.queue.retry_delays_s]
    return queues


def tier_bindings(cfg: Config) -> list[tuple[str, dict[str, Any]]]:
    """(tier queue, headers-exchange binding arguments) of the shard retry tiers."""
    if not partitioned(cfg):
        return []
    return [(shard_retry_queue_name(cfg.queue.name, delay),
             {"x-match": "all", TIER_HEADER: tier_label(delay)}) for delay in cfg.queue.retry_delays_s]


def declare_topology(channel: Any, cfg: Config) -> None:
    """Blocking channel: every queue, exchange and binding (idempotent)."""
    try:
        for queue, arguments in topology(cfg):
            channel.queue_declare(queue, durable=True, arguments=arguments)
        bindings = tier_bindings(cfg)
        if bindings:
            exchange = shard_retry_exchange(cfg.queue.name)
            channel.exchange_declare(exchange, exchange_type="headers", durable=True)
            for queue, arguments in bindings:
                channel.queue_bind(queue, exchange, routing_key="", arguments=arguments)
    except pex.ChannelClosedByBroker as exc:
        raise TopologyError(f"queue declaration refused by the broker ({exc.reply_code} "
                            f"{exc.reply_text}); queue.type or retry_delays_s differ from the "
                            f"existing queues") from None
