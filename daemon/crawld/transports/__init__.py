"""Broker transports behind one small interface (see base.py).

Only this module picks a transport by name; everything else talks to the interface.
"""
from __future__ import annotations

from typing import Any

from ..config import Config
from .base import Publisher, Transport


def make_transport(cfg: Config, worker_id: str, **kwargs: Any) -> Transport:
    if cfg.broker.transport == "jetstream":
        from .jetstream import JetStreamTransport
        return JetStreamTransport(cfg, worker_id, **kwargs)
    from .amqp import AmqpTransport
    return AmqpTransport(cfg, worker_id, **kwargs)


def make_publisher(cfg: Config, **kwargs: Any) -> Publisher:
    if cfg.broker.transport == "jetstream":
        from .jetstream import JetStreamPublisher
        return JetStreamPublisher(cfg, **kwargs)
    from .amqp import AmqpPublisher
    return AmqpPublisher(cfg, **kwargs)


def broker_stats(cfg: Config) -> dict[str, Any]:
    """Queue/stream depths for `crawld status`; {"error": ...} when the broker is unreachable."""
    try:
        if cfg.broker.transport == "jetstream":
            from .jetstream import jetstream_stats
            return jetstream_stats(cfg)
        from .amqp import amqp_stats
        return amqp_stats(cfg)
    except Exception as exc:  # status must still print the store side
        return {"error": f"{type(exc).__name__}: {exc}"}
