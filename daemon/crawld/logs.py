"""structlog setup: JSON lines under a service manager, readable console on a TTY.

Every event carries the process id and role; failure events add task_id, url and
attempt at the call site. Credentials are scrubbed from any ``*url*`` field.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

from crawld.config import LogConfig, redact_url

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def _scrub_urls(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in event.items():
        if isinstance(value, str) and "url" in key and "@" in value:
            event[key] = redact_url(value)
    return event


def setup_logging(cfg: LogConfig, role: str, stream: Any = None) -> None:
    stream = stream or sys.stderr
    use_console = cfg.format == "console" or (cfg.format == "auto" and stream.isatty())
    renderer = (structlog.dev.ConsoleRenderer(colors=stream.isatty()) if use_console
                else structlog.processors.JSONRenderer(sort_keys=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _scrub_urls,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[cfg.level.lower()]),
        logger_factory=structlog.WriteLoggerFactory(file=stream),   # one write per line: several processes share the stream
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(pid=os.getpid(), role=role)
    # Libraries (pika, nats) log through stdlib logging: keep their warnings, drop chatter.
    logging.basicConfig(level=logging.WARNING, stream=stream, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pika").setLevel(logging.CRITICAL)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
