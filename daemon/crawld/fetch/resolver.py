"""Name resolution for the guard: real DNS through dnspython, /etc/hosts through the system.

Why dnspython rather than getaddrinfo: it can be pointed at given servers
(``fetch.dns_servers``, e.g. a local caching resolver, or a test server) and its answers
carry TTLs, so the cache honours them instead of keeping every name for a fixed time.

* ``fetch.dns_servers = []`` -- the system's /etc/resolv.conf (servers, search list,
  options); with no usable server there, 127.0.0.1, as glibc does;
* entries ``"IP"`` or ``"IP:PORT"`` (``"[v6]:PORT"``) -- exactly those servers;
* names listed in /etc/hosts (``localhost``, the machine's own names) are answered by
  getaddrinfo exactly as before: dnspython does not read that file, and these names must
  not leak to a DNS server that may answer them differently;
* answers are cached for their TTL, at most ``max_ttl_s``, in a bounded LRU.

A failed lookup raises :class:`ResolveError` (an ``OSError``, like getaddrinfo's
``gaierror``), so the guard turns every failure into the same ``error``/``dns`` refusal.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from typing import Any, Callable, Sequence

import dns.exception
import dns.nameserver
import dns.resolver

Resolver = Callable[[str], list[str]]

HOSTS_PATH = "/etc/hosts"
DNS_PORT = 53


class ResolveError(OSError):
    """The name has no usable answer (NXDOMAIN, no server answered, timeout, ...)."""


def system_resolver(host: str) -> list[str]:
    """All addresses of ``host`` in getaddrinfo's preference order, duplicates removed."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def parse_nameserver(entry: str) -> tuple[str, int]:
    """``"IP"``, ``"IP:PORT"`` or ``"[IPv6]:PORT"`` -> (ip, port); raises ValueError."""
    text = entry.strip()
    host, port = text, DNS_PORT
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            port = _port(rest.removeprefix(":"), entry)
    elif text.count(":") == 1:
        host, _, rest = text.partition(":")
        port = _port(rest, entry)
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        raise ValueError(f"{entry!r} is not IP or IP:PORT") from None


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{entry!r}: bad port {text!r}")
    return int(text)


class HostsFile:
    """The names /etc/hosts lists, re-read when the file changes (as glibc does)."""

    def __init__(self, path: str = HOSTS_PATH) -> None:
        self.path = path
        self._names: frozenset[str] = frozenset()
        self._stamp: tuple[int, int, int] | None = None
        self._lock = threading.Lock()

    def __contains__(self, host: str) -> bool:
        self._refresh()
        return host.lower().rstrip(".") in self._names

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = (0, 0, 0)
        with self._lock:
            if stamp != self._stamp:
                self._names, self._stamp = _read_hosts(self.path), stamp


def _read_hosts(path: str) -> frozenset[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return frozenset()
    names = set()
    for line in lines:
        fields = line.split("#", 1)[0].split()
        names.update(name.lower().rstrip(".") for name in fields[1:])
    return frozenset(names)


class _CappedLRUCache(dns.resolver.LRUCache):
    """dnspython's TTL cache, but no answer is kept longer than ``max_ttl_s``."""

    def __init__(self, max_size: int, max_ttl_s: float) -> None:
        super().__init__(max_size)
        self.max_ttl_s = max_ttl_s

    def put(self, key: Any, value: dns.resolver.Answer) -> None:
        # A long TTL must not pin a crawler to an address for a day after the site moved.
        value.expiration = min(value.expiration, time.time() + self.max_ttl_s)
        super().put(key, value)


class DnsResolver:
    """``resolver(host) -> [address, ...]``; thread-safe, one per NetGuard."""

    def __init__(self, servers: Sequence[str] = (), *, timeout_s: float = 10.0,
                 max_ttl_s: float = 60.0, cache_size: int = 10_000,
                 hosts: HostsFile | None = None) -> None:
        self.timeout_s = timeout_s
        self.hosts = hosts if hosts is not None else HostsFile()
        self._dns = _make_dns_resolver(servers)
        self._dns.cache = _CappedLRUCache(cache_size, max_ttl_s) if max_ttl_s > 0 else None
        self.max_ttl_s = max_ttl_s
        self.cache_size = cache_size
        # host -> (addresses, monotonic expiry): the answers dnspython's cache holds, found
        # without a lookup thread or a query object (cached() is asked on every fetch).
        self._fresh: dict[str, tuple[list[str], float]] = {}

    def __call__(self, host: str) -> list[str]:
        if host in self.hosts:
            return system_resolver(host)
        return self._query(host)

    def cached(self, host: str) -> list[str] | None:
        """The DNS answer for ``host`` while its TTL runs, else None (no I/O, no wait)."""
        hit = self._fresh.get(host)
        if hit is None or hit[1] <= time.monotonic():
            return None
        return None if host in self.hosts else hit[0]

    def _remember(self, host: str, addresses: list[str], ttl_s: float) -> None:
        if self.max_ttl_s <= 0 or ttl_s <= 0 or not addresses:
            return
        if len(self._fresh) >= self.cache_size:
            self._fresh.clear()
        self._fresh[host] = (addresses, time.monotonic() + min(ttl_s, self.max_ttl_s))

    def _query(self, host: str) -> list[str]:
        expires = time.monotonic() + self.timeout_s
        addresses: list[str] = []
        ttl_s = self.max_ttl_s
        # IPv4 first: what getaddrinfo prefers on hosts without a global IPv6 route; the
        # guard checks every address anyway and connects only to the first acceptable one.
        for rdtype in ("A", "AAAA"):
            lifetime = max(0.001, expires - time.monotonic())
            try:
                answer = self._dns.resolve(host, rdtype, search=True, lifetime=lifetime)
            except dns.resolver.NoAnswer:
                continue
            except dns.resolver.NXDOMAIN:
                raise ResolveError(f"no such name {host} (NXDOMAIN)") from None
            except dns.exception.DNSException as exc:
                raise ResolveError(str(exc) or type(exc).__name__) from None
            addresses.extend(str(rdata.address) for rdata in answer)  # type: ignore[attr-defined]
            ttl_s = min(ttl_s, answer.expiration - time.time())
        unique = list(dict.fromkeys(addresses))
        self._remember(host, unique, ttl_s)
        return unique


def _make_dns_resolver(servers: Sequence[str]) -> dns.resolver.Resolver:
    if not servers:
        try:
            return dns.resolver.Resolver(configure=True)
        except dns.resolver.NoResolverConfiguration:
            servers = ["127.0.0.1"]          # glibc's default when resolv.conf names none
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [dns.nameserver.Do53Nameserver(*parse_nameserver(s)) for s in servers]
    return resolver
