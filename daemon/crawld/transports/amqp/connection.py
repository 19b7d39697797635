"""pika connection settings, message properties and the consumer's connect loop."""
from __future__ import annotations

from typing import Any, Callable

import pika
import pika.exceptions as pex

from crawld.config import Config
from crawld.logs import get_logger
from crawld.transports.common import Backoff

log = get_logger("crawld.amqp")

CONNECTION_ERRORS = (pex.AMQPConnectionError, pex.ConnectionClosed, pex.ChannelClosed,
                     pex.StreamLostError, pex.ChannelWrongStateError, pex.ConnectionWrongStateError,
                     ConnectionError, OSError)


def connection_parameters(cfg: Config) -> pika.URLParameters:
    params = pika.URLParameters(cfg.broker.url)
    params.heartbeat = cfg.broker.heartbeat_s
    params.blocked_connection_timeout = max(60, cfg.broker.heartbeat_s * 4)
    params.connection_attempts = 1   # the backoff loop below owns retries and the stop check
    params.socket_timeout = 10
    params.client_properties = {"connection_name": "crawld"}
    return params


def message_properties(task_id: str, headers: dict[str, Any] | None = None) -> pika.BasicProperties:
    return pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent, message_id=task_id,
                                content_type="application/json", headers=headers or {})


def connect_with_backoff(cfg: Config, should_stop: Callable[[], bool],
                         what: str) -> pika.BlockingConnection | None:
    """A BlockingConnection, retried with backoff; None when told to stop first."""
    backoff = Backoff(cfg, should_stop, CONNECTION_ERRORS, log, "amqp", what)
    params = connection_parameters(cfg)
    return backoff.call(lambda: pika.BlockingConnection(params))
