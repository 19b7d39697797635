"""SSRF guard: decide on one address per URL before any packet leaves.

A crawler fetches URLs chosen by strangers (links, redirects), so every hop is checked:

* only ``http``/``https``;
* the host is resolved **once** here (resolver.py; on a small thread pool so the task
  deadline bounds it), and every address is classified: loopback, RFC 1918 / ULA
  private, link-local (169.254.0.0/16 holds cloud metadata endpoints), CGNAT
  100.64.0.0/10, multicast, unspecified, reserved/benchmark/documentation ranges,
  IPv4-mapped IPv6 and IPv6 forms embedding a refused IPv4 (6to4, Teredo, NAT64) are
  refused;
* ``allow_networks`` (CIDRs) exempts named ranges -- tests and intranet crawls;
* the fetch then connects to the checked IP only (pools.py), so no second lookup can
  happen (DNS rebinding has nothing to rebind).

When a name resolves to several addresses, the first acceptable one is used and the
others are ignored: as we only ever connect to the address we checked, a refused
sibling cannot be reached, and refusing the whole name would break ``localhost``
(``::1`` + ``127.0.0.1``) when only ``127.0.0.0/8`` is allowed.
"""
from __future__ import annotations

import functools
import ipaddress
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Iterable

from crawld.fetch.reasons import Kind, Reason
from crawld.fetch.resolver import DnsResolver, Resolver
from crawld.fetch.urls import DEFAULT_PORTS, BadURL, IPAddress, literal_ip, netloc, parse_url

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
VERDICT_CACHE_SIZE = 65536      # distinct DNS answers remembered (then forgotten all at once)


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
        return netloc(self.scheme, self.host, self.port)

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host_header}"


@dataclass(frozen=True)
class Refusal:
    """Why a URL may not be fetched; ``kind``/``reason`` are FetchResult's (reasons.py)."""

    kind: str           # skipped | failed | error
    reason: str         # scheme | private_address | bad_url | dns
    detail: str = ""
    address_class: str = ""     # for private_address: loopback, private, link_local, ...


# --------------------------------------------------------------------------- address policy
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


@functools.lru_cache(maxsize=4096)
def _literal_answer(host: str) -> tuple[str] | None:
    """The answer for a host that is an IP literal (str() of an address is not free)."""
    literal = literal_ip(host)
    return (str(literal),) if literal is not None else None


# --------------------------------------------------------------------------- the guard
class NetGuard:
    """Checks URLs and pins them to an address. Thread-safe; one per Fetcher.

    Caching names is the resolver's job (the default one honours DNS TTLs); the guard
    remembers only its verdict on each answer, which depends on nothing but the addresses
    and its own allow-list.
    """

    def __init__(self, allow_networks: Iterable[str] = (), *, resolver: Resolver | None = None,
                 dns_timeout_s: float = 10.0, dns_threads: int = 8) -> None:
        self.allowed = [ipaddress.ip_network(c, strict=False) for c in allow_networks]
        self._resolver = resolver or DnsResolver(timeout_s=dns_timeout_s)
        # A resolver that can answer from its cache without blocking spares each fetch of a
        # known site the hand-off to a lookup thread.
        self._cached = getattr(self._resolver, "cached", None)
        self.dns_timeout_s = dns_timeout_s
        self._dns_threads = dns_threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._verdicts: dict[tuple[str, ...], tuple[str | None, list[tuple[str, str]]]] = {}

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
            return Refusal(Kind.FAILED, Reason.BAD_URL, str(exc))
        if parts.scheme not in DEFAULT_PORTS:
            return Refusal(Kind.SKIPPED, Reason.SCHEME, f"scheme {parts.scheme!r} is not http(s)")
        addresses = self.resolve(parts.host, deadline)
        if isinstance(addresses, Refusal):
            return addresses
        ip, problems = self._pick(addresses)
        if ip is None:
            detail = ", ".join(f"{addr}: {why}" for addr, why in problems)
            return Refusal(Kind.SKIPPED, Reason.PRIVATE_ADDRESS, f"{parts.host} -> {detail}",
                           problems[0][1] if problems else "")
        return Target(parts.url, parts.scheme, parts.host, parts.port, ip, parts.path)

    def _pick(self, addresses: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
        """The first acceptable address, else None and (address, problem) for each.
        Remembered per answer: the same few addresses come back for every URL of a site,
        and classifying one costs more than the rest of the check."""
        key = tuple(addresses)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._classify(addresses)
            if len(self._verdicts) >= VERDICT_CACHE_SIZE:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict

    def _classify(self, addresses: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
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
        """Addresses for ``host``: a literal as is, else one lookup bounded by the deadline."""
        literal = _literal_answer(host)
        if literal is not None:
            return list(literal)
        cached = self._cached(host) if self._cached is not None else None
        if cached:
            return list(cached)
        now = time.monotonic()
        timeout = self.dns_timeout_s if deadline is None else min(self.dns_timeout_s, deadline - now)
        return self._lookup(host, max(0.0, timeout))

    def _lookup(self, host: str, timeout: float) -> list[str] | Refusal:
        future = self._pool().submit(self._resolver, host)
        try:
            addresses = future.result(timeout=timeout)
        except FutureTimeout:
            future.cancel()
            return Refusal(Kind.ERROR, Reason.DNS, f"resolving {host} timed out after {timeout:.1f}s")
        except (OSError, UnicodeError) as exc:
            return Refusal(Kind.ERROR, Reason.DNS, f"resolving {host}: {exc}")
        return list(addresses) if addresses else Refusal(Kind.ERROR, Reason.DNS, f"{host}: no address")

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
