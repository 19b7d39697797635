"""SSRF guard and guarded connections: decide on an address once, then connect to exactly it.

A crawler fetches URLs chosen by strangers (links, redirects), so every hop is checked
before any packet leaves:

* only ``http``/``https``;
* the host is resolved **once** here (DNS on a small thread pool so the task deadline
  bounds it), and every address is classified: loopback, RFC 1918 / ULA private,
  link-local (169.254.0.0/16 holds cloud metadata endpoints), CGNAT 100.64.0.0/10,
  multicast, unspecified, reserved/benchmark/documentation ranges, IPv4-mapped IPv6
  and IPv6 forms embedding a refused IPv4 (6to4, Teredo, NAT64) are refused;
* ``allow_networks`` (CIDRs) exempts named ranges -- tests and intranet crawls;
* the connection goes to the checked IP: the pool is keyed by that IP, the ``Host``
  header, TLS SNI (``server_hostname``) and certificate check (``assert_hostname``)
  use the hostname. :class:`GuardedHTTPConnection` refuses to connect to anything but an
  IP literal, so no second DNS lookup can happen (DNS rebinding has nothing to rebind).

When a name resolves to several addresses, the first acceptable one is used and the
others are ignored: as we only ever connect to the address we checked, a refused
sibling cannot be reached, and refusing the whole name would break ``localhost``
(``::1`` + ``127.0.0.1``) when only ``127.0.0.0/8`` is allowed.

The module also bounds the *total* time of a request: a task sets a
:func:`deadline_scope`; connections used inside it register with one watchdog thread
that shuts their socket down when the deadline passes. Socket timeouts alone only
bound each ``recv``, so a server dripping one byte per second (in the headers or the
body) would otherwise hold a thread for hours.
"""
from __future__ import annotations

import heapq
import ipaddress
import itertools
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Union
from urllib.parse import urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import NewConnectionError
from w3lib.url import safe_url_string

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Resolver = Callable[[str], list[str]]

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_HOST_OK = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*\.?$")
_LEGACY_IPV4 = re.compile(r"(0x[0-9a-f]*|\d+)(\.(0x[0-9a-f]*|\d+)){0,3}", re.IGNORECASE)
DEFAULT_PORTS = {"http": 80, "https": 443}


# --------------------------------------------------------------------------- decisions
@dataclass(frozen=True)
class Target:
    """A URL that passed the guard, pinned to the address it must be fetched from."""

    url: str            # normalised, without userinfo and fragment
    scheme: str
    host: str           # ASCII (IDNA), lower case, no brackets
    port: int
    ip: str             # the checked address; the only one we may connect to
    path: str           # path + query, what goes on the request line

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if DEFAULT_PORTS.get(self.scheme) == self.port else f"{host}:{self.port}"

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host_header}"


@dataclass(frozen=True)
class Refusal:
    """Why a URL may not be fetched; ``kind``/``reason`` follow FetchResult's table."""

    kind: str           # skipped | failed | error
    reason: str         # scheme | private_address | bad_url | dns
    detail: str = ""
    address_class: str = ""     # for private_address: loopback, private, link_local, ...


class BadURL(ValueError):
    pass


@dataclass(frozen=True)
class URLParts:
    url: str
    scheme: str
    host: str
    port: int
    path: str
    username: str | None
    password: str | None


def parse_url(url: str) -> URLParts:
    """Split and normalise a URL (IRI -> URI, IDNA host); raises BadURL."""
    try:
        safe = safe_url_string(url.strip())
        parts = urlsplit(safe)
        port = parts.port
    except (ValueError, UnicodeError) as exc:
        raise BadURL(str(exc)) from None
    scheme = parts.scheme.lower()
    if not scheme:
        raise BadURL("no scheme")
    if scheme not in DEFAULT_PORTS:     # kept as given: it will only be refused
        return URLParts(safe, scheme, parts.hostname or "", port or 0, parts.path, None, None)
    host = (parts.hostname or "").rstrip(".")
    _validate_host(host)
    port = port or DEFAULT_PORTS[scheme]
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    bracketed = f"[{host}]" if ":" in host else host
    netloc = bracketed if DEFAULT_PORTS.get(scheme) == port else f"{bracketed}:{port}"
    clean = f"{scheme}://{netloc}{path}"
    return URLParts(clean, scheme, host, port, path, parts.username, parts.password)


def _validate_host(host: str) -> None:
    if not host:
        raise BadURL("no host")
    if _literal_ip(host) is not None:
        return
    if len(host) > 253 or not _HOST_OK.match(host):
        raise BadURL(f"invalid host {host!r}")


def _literal_ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    if _LEGACY_IPV4.fullmatch(host):
        # "2130706433", "0x7f.1", "0177.0.0.1": getaddrinfo (and browsers) read these as
        # IPv4 without DNS; classify them as the address they are.
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def address_problem(ip: IPAddress) -> str | None:
    """Why ``ip`` must not be contacted, or None if it is a public unicast address."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return "ipv4_mapped"     # dual-stack sockets would reach the IPv4 host
        embedded = _embedded_ipv4(ip)
        if embedded is not None and address_problem(embedded):
            return "embedded_ipv4"
    checks = (("loopback", ip.is_loopback), ("link_local", ip.is_link_local),
              ("multicast", ip.is_multicast), ("unspecified", ip.is_unspecified),
              ("cgnat", ip in _CGNAT), ("reserved", ip.is_reserved),
              ("private", ip.is_private), ("not_global", not ip.is_global))
    for name, hit in checks:
        if hit:
            return name
    return None


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def system_resolver(host: str) -> list[str]:
    """All addresses of ``host`` in getaddrinfo's preference order, duplicates removed."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


# --------------------------------------------------------------------------- the guard
class NetGuard:
    """Checks URLs and pins them to an address. Thread-safe; one per Fetcher."""

    def __init__(self, allow_networks: Iterable[str] = (), *, resolver: Resolver | None = None,
                 dns_timeout_s: float = 10.0, dns_cache_s: float = 60.0,
                 dns_threads: int = 8) -> None:
        self.allowed = [ipaddress.ip_network(c, strict=False) for c in allow_networks]
        self._resolver = resolver or system_resolver
        self.dns_timeout_s = dns_timeout_s
        self.dns_cache_s = dns_cache_s
        self._dns_threads = dns_threads
        self._executor: ThreadPoolExecutor | None = None
        self._cache: dict[str, tuple[float, list[str]]] = {}
        self._lock = threading.Lock()

    def is_allowed(self, ip: IPAddress) -> bool:
        """True if the allow-list names ``ip`` (or the IPv4 inside an IPv4-mapped address)."""
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return any(ip in net or (mapped is not None and mapped in net) for net in self.allowed)

    def problem(self, ip: IPAddress) -> str | None:
        return None if self.is_allowed(ip) else address_problem(ip)

    def check(self, url: str, deadline: float | None = None) -> Target | Refusal:
        """Parse, scheme-check, resolve once and classify ``url`` -- never connects."""
        try:
            parts = parse_url(url)
        except BadURL as exc:
            return Refusal("failed", "bad_url", str(exc))
        if parts.scheme not in DEFAULT_PORTS:
            return Refusal("skipped", "scheme", f"scheme {parts.scheme!r} is not http(s)")
        addresses = self.resolve(parts.host, deadline)
        if isinstance(addresses, Refusal):
            return addresses
        ip, problems = self._pick(addresses)
        if ip is None:
            detail = ", ".join(f"{addr}: {why}" for addr, why in problems)
            return Refusal("skipped", "private_address", f"{parts.host} -> {detail}",
                           problems[0][1] if problems else "")
        return Target(parts.url, parts.scheme, parts.host, parts.port, ip, parts.path)

    def _pick(self, addresses: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
        """The first acceptable address, else None and (address, problem) for each."""
        problems = []
        for text in addresses:
            try:
                ip = ipaddress.ip_address(text.split("%", 1)[0])
            except ValueError:
                problems.append((text, "unparsable"))
                continue
            why = self.problem(ip)
            if why is None:
                return str(ip), []
            problems.append((str(ip), why))
        return None, problems

    def resolve(self, host: str, deadline: float | None = None) -> list[str] | Refusal:
        """Addresses for ``host`` (literal, cached, or one lookup bounded by the deadline)."""
        literal = _literal_ip(host)
        if literal is not None:
            return [str(literal)]
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(host)
        if hit and hit[0] > now:
            return hit[1]
        timeout = self.dns_timeout_s if deadline is None else min(self.dns_timeout_s, deadline - now)
        addresses = self._lookup(host, max(0.0, timeout))
        if isinstance(addresses, list):
            self._remember(host, addresses, now)
        return addresses

    def _lookup(self, host: str, timeout: float) -> list[str] | Refusal:
        future = self._pool().submit(self._resolver, host)
        try:
            addresses = future.result(timeout=timeout)
        except FutureTimeout:
            future.cancel()
            return Refusal("error", "dns", f"resolving {host} timed out after {timeout:.1f}s")
        except (OSError, UnicodeError) as exc:
            return Refusal("error", "dns", f"resolving {host}: {exc}")
        return list(addresses) if addresses else Refusal("error", "dns", f"{host}: no address")

    def _remember(self, host: str, addresses: list[str], now: float) -> None:
        if self.dns_cache_s <= 0:
            return
        with self._lock:
            if len(self._cache) > 10_000:    # bounded; a crawl touches millions of hosts
                self._cache.clear()
            self._cache[host] = (now + self.dns_cache_s, addresses)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._dns_threads, thread_name_prefix="crawld-dns")
            return self._executor

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- deadlines
class DeadlineScope:
    """One request's wall-clock deadline and the connections it is using."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.fired = False
        self.done = False
        self._conns: set[Any] = set()
        self._lock = threading.Lock()

    def attach(self, conn: Any) -> None:
        with self._lock:
            conn._crawld_scope = self
            if self.fired:
                _shutdown(conn)
            else:
                self._conns.add(conn)

    def detach(self, conn: Any) -> None:
        # Runs before a connection goes back to the pool: if the watchdog already shut
        # it down, close it here so the next task does not inherit a dead socket.
        with self._lock:
            self._conns.discard(conn)
            conn._crawld_scope = None
            fired = self.fired
        if fired:
            conn.close()

    def fire(self) -> None:
        with self._lock:
            if self.done:
                return
            self.fired = True
            for conn in self._conns:
                _shutdown(conn)

    def close(self) -> None:
        with self._lock:
            self.done = True


def _shutdown(conn: Any) -> None:
    sock = getattr(conn, "sock", None)
    if isinstance(sock, socket.socket):
        try:
            # The plain-socket shutdown, also for an SSLSocket: wakes the reader blocked
            # in recv without touching TLS state that thread is using.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass


class _Watchdog:
    """One thread per process; a heap of deadlines; fires expired scopes."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, DeadlineScope]] = []
        self._seq = itertools.count()
        self._stale = 0
        self._thread: threading.Thread | None = None

    def add(self, scope: DeadlineScope) -> None:
        with self._cv:
            heapq.heappush(self._heap, (scope.deadline, next(self._seq), scope))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="crawld-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][2] is scope:
                self._cv.notify()

    def finished(self, scope: DeadlineScope) -> None:
        scope.close()
        with self._cv:
            self._stale += 1
            # Most scopes end long before their deadline: compact so the heap stays
            # proportional to the requests in flight, not to the request rate.
            if self._stale > 1024 and self._stale * 2 > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].done]
                heapq.heapify(self._heap)
                self._stale = 0

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, scope = heapq.heappop(self._heap)
                if scope.done:
                    self._stale = max(0, self._stale - 1)
            scope.fire()

    def reset_after_fork(self) -> None:
        self.__init__()  # type: ignore[misc]


_WATCHDOG = _Watchdog()
_current = threading.local()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG.reset_after_fork)


@contextmanager
def deadline_scope(deadline: float) -> Iterator[DeadlineScope]:
    """Connections used by this thread inside the block are cut at ``deadline`` (monotonic)."""
    scope = DeadlineScope(deadline)
    _WATCHDOG.add(scope)
    previous = getattr(_current, "scope", None)
    _current.scope = scope
    try:
        yield scope
    finally:
        _current.scope = previous
        _WATCHDOG.finished(scope)


def _attach_current(conn: Any) -> None:
    scope = getattr(_current, "scope", None)
    if scope is not None:
        scope.attach(conn)


def _detach(conn: Any) -> None:
    scope = getattr(conn, "_crawld_scope", None)
    if scope is not None:
        scope.detach(conn)


# --------------------------------------------------------------------------- connections
class _GuardedMixin:
    """Connect only to IP literals (the guard's choice) and report to the deadline scope."""

    def _new_conn(self) -> socket.socket:
        if _literal_ip(self._dns_host) is None:  # type: ignore[attr-defined]
            raise NewConnectionError(self, f"refusing to resolve {self._dns_host!r}: "  # type: ignore[attr-defined]
                                     "only addresses checked by NetGuard are connected to")
        return super()._new_conn()  # type: ignore[misc]

    def connect(self) -> None:
        _attach_current(self)
        super().connect()  # type: ignore[misc]

    def request(self, *args: Any, **kwargs: Any) -> None:
        _attach_current(self)
        super().request(*args, **kwargs)  # type: ignore[misc]


class GuardedHTTPConnection(_GuardedMixin, HTTPConnection):
    pass


class GuardedHTTPSConnection(_GuardedMixin, HTTPSConnection):
    pass


class GuardedHTTPConnectionPool(HTTPConnectionPool):
    ConnectionCls = GuardedHTTPConnection

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            _detach(conn)
        super()._put_conn(conn)


class GuardedHTTPSConnectionPool(HTTPSConnectionPool):
    ConnectionCls = GuardedHTTPSConnection

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            _detach(conn)
        super()._put_conn(conn)


def make_pool_manager(pool_size: int, **connection_kw: Any) -> urllib3.PoolManager:
    """One PoolManager per worker process, sized to its thread pool, guarded pools only.

    No proxy support on purpose: a proxy would resolve names itself, behind the guard.
    """
    manager = urllib3.PoolManager(num_pools=max(64, 4 * pool_size), maxsize=pool_size,
                                  block=False, retries=False, **connection_kw)
    manager.pool_classes_by_scheme = {"http": GuardedHTTPConnectionPool,
                                      "https": GuardedHTTPSConnectionPool}
    return manager


def connection_pool(manager: urllib3.PoolManager, target: Target) -> HTTPConnectionPool:
    """The pool for ``target``'s checked IP; TLS names the host for SNI and the cert check."""
    kwargs: dict[str, Any] | None = None
    if target.scheme == "https":
        literal = _literal_ip(target.host) is not None
        kwargs = {"server_hostname": None if literal else target.host,
                  "assert_hostname": target.host}
    return manager.connection_from_host(target.ip, target.port, target.scheme, pool_kwargs=kwargs)
