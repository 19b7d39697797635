"""Broker transports behind one small interface (see base.py).

Only this module picks a transport by name; everything else talks to the interface.
"""
from __future__ import annotations

from typing import Any

from crawld.config import Config
from crawld.transports.base import Publisher, Transport


def make_transport(cfg: Config, worker_id: str) -> Transport:
    if cfg.broker.transport == "jetstream":
        from crawld.transports.jetstream import JetStreamTransport
        return JetStreamTransport(cfg, worker_id)
    from crawld.transports.amqp import AmqpTransport
    return AmqpTransport(cfg, worker_id)


def make_publisher(cfg: Config, **kwargs: Any) -> Publisher:
    if cfg.broker.transport == "jetstream":
        from crawld.transports.jetstream import JetStreamPublisher
        return JetStreamPublisher(cfg, **kwargs)
    from crawld.transports.amqp import AmqpPublisher
    return AmqpPublisher(cfg, **kwargs)


def broker_stats(cfg: Config) -> dict[str, Any]:
    """Queue/stream depths for `crawld status`; {"error": ...} when the broker is unreachable."""
    try:
        if cfg.broker.transport == "jetstream":
            from crawld.transports.jetstream import jetstream_stats
            return jetstream_stats(cfg)
        from crawld.transports.amqp import amqp_stats
        return amqp_stats(cfg)
    except Exception as exc:  # status must still print the store side
        return {"error": f"{type(exc).__name__}: {exc}"}
