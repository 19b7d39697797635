"""Is it the sites, or this host? A circuit breaker over the last fetch outcomes.

One site that stops answering is that site's problem: its tasks walk the retry tiers to
the dead letters. When most of the last ``fetch.breaker_window`` fetches of this worker
failed to reach their site at all (connect error, timeout, DNS failure other than
NXDOMAIN) and those failures are spread over at least ``fetch.breaker_min_sites``
distinct sites, it is this host's network or resolver: the failure says nothing about the
tasks, so the worker defers them (no attempt used) and pauses until a probe connects
again. Sites are origins (host and port): two services on one machine fail separately.

The defaults (20, 0.8, 3) and why: 20 outcomes is about one round of a 16-thread pool, so
a trip needs fresh evidence, not one unlucky burst; with 0.8, one fetch in five getting
through proves the network works and keeps the breaker shut; three unrelated sites all
unreachable together while nothing else answers is very unlikely to be the sites'.
"""
from __future__ import annotations

import socket
import threading
from collections import deque
from typing import Iterable
from urllib.parse import urlsplit

from crawld.fetch import FetchResult
from crawld.fetch.reasons import Kind, Reason

UNREACHABLE = frozenset({Reason.CONNECTION, Reason.TIMEOUT, Reason.DNS, Reason.ROBOTS_UNAVAILABLE})
DEFAULT_PORTS = {"http": 80, "https": 443}
PROBE_TARGETS = 5


class NetworkBreaker:
    """Thread-safe: pool threads ``record`` each fetch; the pause probe calls ``probe``."""

    def __init__(self, window: int, ratio: float, min_sites: int,
                 connect_timeout_s: float = 5.0) -> None:
        self.window = window
        self.ratio = ratio
        self.min_sites = min_sites
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._recent: deque[tuple[str, int] | None] = deque(maxlen=window)   # None: reached

    def record(self, result: FetchResult) -> bool:
        """Count one outcome; True when it is an unreachable site and the breaker is open."""
        site = unreachable_site(result)
        with self._lock:
            self._recent.append(site)
            return site is not None and self._open()

    def _open(self) -> bool:
        if len(self._recent) < self.window:
            return False
        failed = [site for site in self._recent if site is not None]
        return len(failed) >= self.ratio * self.window and len(set(failed)) >= self.min_sites

    def failing_sites(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(dict.fromkeys(site for site in self._recent if site is not None))

    def reset(self) -> None:
        """After the pause ends: judge the network again on fresh outcomes only."""
        with self._lock:
            self._recent.clear()

    def probe(self) -> None:
        """Raises unless a TCP connect to one of the recently failing sites succeeds."""
        sites = self.failing_sites()[:PROBE_TARGETS]
        errors = probe_connect(sites, self.connect_timeout_s)
        if len(errors) == len(sites):
            raise ConnectionError(f"no site reachable: {'; '.join(errors) or 'no site to probe'}")


def unreachable_site(result: FetchResult) -> tuple[str, int] | None:
    """The (host, port) a fetch could not reach at all, None for any other outcome."""
    if result.kind != Kind.ERROR or result.reason not in UNREACHABLE or result.http_status:
        return None
    if result.reason == Reason.DNS and "NXDOMAIN" in result.error:
        return None        # a real answer from a working resolver: the name does not exist
    parts = urlsplit(result.url)
    if not parts.hostname:
        return None
    try:
        port = parts.port or DEFAULT_PORTS.get(parts.scheme, 80)
    except ValueError:
        return None
    return parts.hostname, port


def probe_connect(sites: Iterable[tuple[str, int]], timeout_s: float) -> list[str]:
    """Try each site; return one error line per site that did not accept a connection."""
    errors = []
    for host, port in sites:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            errors.append(f"{host}:{port} {exc}")
    return errors
