"""Guarded urllib3 connections and pools: connect to exactly the address the guard checked.

The pool is keyed by the checked IP; the ``Host`` header, TLS SNI (``server_hostname``)
and the certificate check (``assert_hostname``) use the hostname. A guarded connection
refuses to connect to anything but an IP literal, so no second DNS lookup can happen
(DNS rebinding has nothing to rebind). Connections report to the request's deadline
scope (deadline.py) so its watchdog can cut them.

``GuardedPools`` finds a target's pool with one dict lookup: PoolManager.connection_from_host
builds a request context and a PoolKey and takes a lock on every call (~10 µs, as much as
parsing the response head), for the same few pools thousands of times a minute.
"""
from __future__ import annotations

import socket
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import NewConnectionError

from crawld.fetch.deadline import attach_current, detach
from crawld.fetch.netguard import Target
from crawld.fetch.responses import FastHeadersResponse
from crawld.fetch.urls import literal_ip


class _GuardedConnectionMixin:
    """Connect only to IP literals (the guard's choice) and report to the deadline scope."""

    def _new_conn(self) -> socket.socket:
        if literal_ip(self._dns_host) is None:  # type: ignore[attr-defined]
            raise NewConnectionError(self, f"refusing to resolve {self._dns_host!r}: "  # type: ignore[attr-defined]
                                     "only addresses checked by NetGuard are connected to")
        return super()._new_conn()  # type: ignore[misc]

    def connect(self) -> None:
        attach_current(self)
        super().connect()  # type: ignore[misc]

    def request(self, *args: Any, **kwargs: Any) -> None:
        attach_current(self)
        super().request(*args, **kwargs)  # type: ignore[misc]


class GuardedHTTPConnection(_GuardedConnectionMixin, HTTPConnection):
    response_class = FastHeadersResponse


class GuardedHTTPSConnection(_GuardedConnectionMixin, HTTPSConnection):
    response_class = FastHeadersResponse


class _DetachingPoolMixin:
    """Take a connection out of its deadline scope before the pool keeps it for reuse."""

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            detach(conn)
        super()._put_conn(conn)  # type: ignore[misc]


class GuardedHTTPConnectionPool(_DetachingPoolMixin, HTTPConnectionPool):
    ConnectionCls = GuardedHTTPConnection


class GuardedHTTPSConnectionPool(_DetachingPoolMixin, HTTPSConnectionPool):
    ConnectionCls = GuardedHTTPSConnection


def make_pool_manager(pool_size: int, **connection_kw: Any) -> urllib3.PoolManager:
    """One PoolManager per worker process, sized to its thread pool, guarded pools only.

    No proxy support on purpose: a proxy would resolve names itself, behind the guard.
    """
    manager = urllib3.PoolManager(num_pools=num_pools(pool_size), maxsize=pool_size,
                                  block=False, retries=False, **connection_kw)
    manager.pool_classes_by_scheme = {"http": GuardedHTTPConnectionPool,
                                      "https": GuardedHTTPSConnectionPool}
    return manager


def num_pools(pool_size: int) -> int:
    return max(64, 4 * pool_size)


def connection_pool(manager: urllib3.PoolManager, target: Target) -> HTTPConnectionPool:
    """The pool for ``target``'s checked IP; TLS names the host for SNI and the cert check."""
    kwargs: dict[str, Any] | None = None
    if target.scheme == "https":
        literal = literal_ip(target.host) is not None
        kwargs = {"server_hostname": None if literal else target.host,
                  "assert_hostname": target.host}
    return manager.connection_from_host(target.ip, target.port, target.scheme, pool_kwargs=kwargs)


class GuardedPools:
    """The worker's pools, by (scheme, checked IP, port, host). Thread-safe without a lock:
    a lost race only asks the manager twice for the same pool.

    The manager still creates and sizes the pools; a cached pool it has evicted from its
    LRU stays usable (urllib3 2 drops evicted pools without closing them), one closed
    since is asked for again, and the cache itself is bounded.
    """

    def __init__(self, pool_size: int, **connection_kw: Any) -> None:
        self.manager = make_pool_manager(pool_size, **connection_kw)
        self._limit = 2 * num_pools(pool_size)
        self._pools: dict[tuple[str, str, int, str], HTTPConnectionPool] = {}

    def get(self, target: Target) -> HTTPConnectionPool:
        key = (target.scheme, target.ip, target.port, target.host)
        pool = self._pools.get(key)
        if pool is None or pool.pool is None:       # close() sets .pool to None
            if len(self._pools) >= self._limit:
                self._pools.clear()
            pool = self._pools[key] = connection_pool(self.manager, target)
        return pool

    def clear(self) -> None:
        self._pools.clear()
        self.manager.clear()
