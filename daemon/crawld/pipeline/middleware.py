"""Named hooks around one worker's life and each delivery (``pipeline.middleware``).

Modelled on gunicorn's server hooks and dramatiq's middleware: a subclass overrides
only the hooks it needs; every hook of the base class does nothing. Entries of
``pipeline.middleware`` are ``"module:factory"`` strings; each factory is called once
at worker boot with no arguments and returns a ``Middleware``.

Hooks run inline on the thread that reaches them: ``after_worker_boot`` and
``on_tick`` on the worker's main (I/O) thread, the delivery hooks on a pool thread.
An exception in a delivery hook is an internal error of that delivery (dead row).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

from crawld.config import ConfigError
from crawld.task import Task
from crawld.transports.base import Delivery, Settlement

if TYPE_CHECKING:
    from crawld.process.worker import Worker

CONFIG_KEY = "pipeline.middleware"


class Middleware:
    """Base class: no-op hooks, called in the order the pipeline reaches them."""

    def after_worker_boot(self, worker: "Worker") -> None:
        """The worker is set up (store, fetcher, transport) but not yet connected."""

    def on_tick(self, worker: "Worker") -> None:
        """Each turn of the worker's main loop (about every 0.2 s) while it runs."""

    def before_fetch(self, delivery: Delivery, task: Task) -> None:
        """Parsed, not a duplicate, within the delivery limit; the fetch is next."""

    def before_store(self, delivery: Delivery, task: Task) -> None:
        """Fetched and classified as a result; the body is saved, the row not yet."""

    def after_store(self, delivery: Delivery, task: Task) -> None:
        """The result row is written; the broker has not been answered yet."""

    def before_settle(self, delivery: Delivery, settlement: Settlement) -> None:
        """The answer is decided and about to be handed to the transport."""


HOOKS = tuple(name for name in vars(Middleware) if not name.startswith("_"))


class MiddlewareChain(Middleware):
    """Several middlewares as one: each hook calls every member in config order.

    The hook methods are generated from HOOKS below, so a hook added to Middleware
    can never be forgotten here."""

    def __init__(self, members: Sequence[Middleware] = ()) -> None:
        self.members = tuple(members)


def _fan_out(name: str) -> Callable[..., None]:
    def hook(self: MiddlewareChain, *args: Any) -> None:
        for member in self.members:
            getattr(member, name)(*args)
    hook.__name__ = name
    hook.__qualname__ = f"MiddlewareChain.{name}"
    hook.__doc__ = getattr(Middleware, name).__doc__
    return hook


for _hook in HOOKS:
    setattr(MiddlewareChain, _hook, _fan_out(_hook))


def import_factory(spec: str, key: str = CONFIG_KEY) -> Callable[[], Any]:
    """Resolve ``"package.module:attr"``; a bad entry is a config error naming ``key``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {spec!r} is not of the form 'module:factory'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as exc:     # ImportError, AttributeError, or the module's own failure
        raise ConfigError(f"{key}: cannot import {spec!r} ({type(exc).__name__}: {exc})") from None
    if not callable(target):
        raise ConfigError(f"{key}: {spec!r} is not callable")
    return target


def load_middleware(specs: Sequence[str], key: str = CONFIG_KEY) -> MiddlewareChain:
    """Build the configured middlewares, once per worker process."""
    members = []
    for spec in specs:
        factory = import_factory(spec, key)
        try:
            made = factory()
        except Exception as exc:     # the factory itself failed: still the entry's fault
            raise ConfigError(f"{key}: {spec!r} failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(made, Middleware):
            raise ConfigError(f"{key}: {spec!r} returned {type(made).__name__}, not a Middleware")
        members.append(made)
    return MiddlewareChain(members)
