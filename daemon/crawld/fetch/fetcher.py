"""HTTP fetching: one shared urllib3 PoolManager per worker process, guarded and polite.

Contract used by the worker (keep it stable):
    fetcher = Fetcher(cfg.fetch, pool_size=threads, run_dir=..., stats=stats)
    result: FetchResult = fetcher.fetch(url)      # never raises for network problems
    fetcher.close()

``FetchResult.kind`` / ``.reason`` use the vocabulary of reasons.py (its table says which
reasons go with which kind). For a "response" (any HTTP status) redirects are already
followed: ``redirects`` = chain length, ``final_url`` = last URL, ``retry_after_s`` set for
429/503 (seconds or HTTP-date, capped by retry_after_max_s). An "error"/"politeness" means
no host slot within ``politeness_wait_s``; ``retry_after_s`` then carries the wait we know
of, if any. "failed"/"bad_encoding": the Content-Encoding could not be decoded.

What one ``fetch(url)`` does, per hop of the redirect chain:
  1. NetGuard: http(s) only, resolve once (resolver.py), refuse private/loopback/...
     (netguard.py), connect only to the checked address (pools.py);
  2. robots.txt of the hop's origin, RFC 9309 (robots.py), unless obey_robots is false;
  3. a host-wide politeness slot and start time (politeness.py);
  4. GET to the checked IP with Host/SNI = hostname; our code follows redirects (every
     hop goes through 1-3 again), drops credentials when the origin changes, stops loops;
  5. the body is streamed and decoded (gzip, deflate, br) with a cap on the *decoded*
     size: urllib3 >= 2.6 bounds each decompression step, so a bomb costs at most the cap.
``timeout_s`` is a wall-clock budget for the network work of the task (DNS, connect,
robots.txt, every hop, the body), enforced by a watchdog that cuts the socket
(deadline.py); time spent waiting for a politeness slot is bounded separately by
``politeness_wait_s``.
Counters use Scrapy's stat names (stats.py).
"""
from __future__ import annotations

import base64
import http.client
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urljoin

import urllib3
from urllib3.exceptions import HTTPError, IncompleteRead

from crawld.config import FetchConfig
from crawld.fetch.deadline import DeadlineScope, deadline_scope
from crawld.fetch.netguard import NetGuard, Refusal, Target
from crawld.fetch.politeness import HostLimiter, PolitenessTimeout
from crawld.fetch.sites import SiteLimiter
from crawld.fetch.pools import GuardedPools
from crawld.fetch.reasons import Kind, Reason
from crawld.fetch.resolver import DnsResolver, Resolver
from crawld.fetch.responses import (Hop, capture_hop, classify_exception, content_length,
                                    discard, finish, parse_retry_after)
from crawld.fetch.robots import MAX_ROBOTS_BYTES, RobotsCache
from crawld.fetch.urls import BadURL, parse_url
from crawld.stats import Stats

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# Answers that say the site could not be reached at all (a run of them pauses the site).
UNREACHABLE = frozenset({Reason.CONNECTION, Reason.TIMEOUT, Reason.DNS})
ROBOTS_MAX_REDIRECTS = 5            # RFC 9309: follow at least five
CHUNK = 64 * 1024
ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"   # Scrapy's default


@dataclass
class FetchResult:
    kind: str                                        # a reasons.Kind
    url: str
    final_url: str = ""
    http_status: int | None = None
    reason: str = ""                                 # a reasons.Reason
    error: str = ""
    content_type: str = ""
    body: bytes = b""
    redirects: int = 0
    retry_after_s: float | None = None
    elapsed_s: float = 0.0
    chain: list[str] = field(default_factory=list)   # every URL requested, in order
    peer_ip: str = ""                                # the address the last hop connected to
    hops: list[Hop] = field(default_factory=list)    # every exchange with a response, in order

    @property
    def headers(self) -> dict[str, str]:
        """The response's headers as a dict; built on demand, since most pages never ask."""
        if self.kind != Kind.RESPONSE or not self.hops:
            return {}
        return _header_dict(self.hops[-1].response_headers)


@dataclass
class _Task:
    """Mutable state of one fetch: its network deadline (monotonic)."""
    deadline: float


@dataclass
class _Redirect:
    status: int
    location: str
    hop: Hop


class Fetcher:
    """Thread-safe: one per worker process, shared by its thread pool."""

    def __init__(self, cfg: FetchConfig, pool_size: int = 16, run_dir: str = "", *,
                 stats: Stats | None = None, politeness_wait_s: float | None = None,
                 robots_error_ttl_s: float = 30.0, resolver: Resolver | None = None,
                 ca_certs: str | None = None, limiter: SiteLimiter | None = None) -> None:
        self.cfg = cfg
        self.stats = stats if stats is not None else Stats()
        resolver = resolver or DnsResolver(cfg.dns_servers, timeout_s=cfg.connect_timeout_s)
        self.guard = NetGuard(cfg.allow_networks, resolver=resolver,
                              dns_timeout_s=cfg.connect_timeout_s)
        self.pools = GuardedPools(pool_size, **({"ca_certs": ca_certs} if ca_certs else {}))
        # A shard owner keeps its sites' politeness in memory (sites.py); without partitioning,
        # the workers of one machine share flock files (politeness.py).
        self.limiter: SiteLimiter | HostLimiter = limiter or HostLimiter(
            run_dir, cfg.per_host_concurrency, cfg.per_host_delay_s, max_not_before_s=cfg.retry_after_max_s)
        self.politeness_wait_s = (min(cfg.timeout_s, 30.0) if politeness_wait_s is None
                                  else politeness_wait_s)
        self.robots: RobotsCache | None = None
        if cfg.obey_robots:
            self.robots = RobotsCache(cfg.user_agent, self._fetch_robots, ttl_s=cfg.robots_cache_s,
                                      error_ttl_s=robots_error_ttl_s, stats=self.stats,
                                      max_crawl_delay_s=cfg.retry_after_max_s)
        self.headers = {"User-Agent": cfg.user_agent, "Accept": ACCEPT, "Accept-Language": "en",
                        "Accept-Encoding": urllib3.util.make_headers(accept_encoding=True)["accept-encoding"]}

    # -- public ------------------------------------------------------------------------
    def fetch(self, url: str) -> FetchResult:
        """Fetch ``url`` following redirects; never raises for network or policy problems."""
        started = time.monotonic()
        result = self._follow(url, _Task(started + self.cfg.timeout_s), obey_robots=self.robots is not None,
                              max_redirects=self.cfg.max_redirects,
                              max_bytes=self.cfg.max_body_bytes, truncate=False)
        result.elapsed_s = time.monotonic() - started
        self.stats.inc(f"fetch/result_count/{result.kind}")
        if result.reason:
            self.stats.inc(f"fetch/reason_count/{result.reason}")
        return result

    def network_back(self) -> int:
        """This host's network works again: forget robots.txt failures met while it was
        down (how many)."""
        return self.robots.forget_unreachable() if self.robots is not None else 0

    def close(self) -> None:
        self.pools.clear()
        self.guard.close()
        self.limiter.close()

    # -- the redirect chain --------------------------------------------------------------
    def _follow(self, url: str, task: _Task, *, obey_robots: bool, max_redirects: int,
                max_bytes: int, truncate: bool) -> FetchResult:
        chain: list[str] = []
        hops: list[Hop] = []
        auth = _basic_auth(url)
        current = url
        while True:
            target = self.guard.check(current, task.deadline)
            if isinstance(target, Refusal):
                return self._refused(url, current, target, chain)
            chain.append(target.url)
            if auth and auth[0] != target.origin:
                auth = None             # credentials never leave the origin they were given for
            outcome = self._visit(target, task, obey_robots, auth[1] if auth else None,
                                  max_bytes, truncate)
            if isinstance(outcome, FetchResult):
                outcome.url, outcome.final_url, outcome.redirects = url, target.url, len(chain) - 1
                outcome.chain = chain
                outcome.hops[:0] = hops
                return outcome
            hops.append(outcome.hop)
            nxt = self._next_hop(url, target, outcome, chain, max_redirects)
            if isinstance(nxt, FetchResult):
                nxt.hops = hops
                return nxt
            current = nxt

    def _next_hop(self, url: str, target: Target, redirect: _Redirect, chain: list[str],
                  max_redirects: int) -> str | FetchResult:
        hops = len(chain) - 1
        location = urljoin(target.url, redirect.location.strip())

        def failed(reason: str, error: str) -> FetchResult:
            return FetchResult(Kind.FAILED, url, final_url=target.url, http_status=redirect.status,
                               reason=reason, error=error, redirects=hops, chain=chain)
        try:
            normalised = parse_url(location).url
        except BadURL as exc:
            return failed(Reason.BAD_URL, f"redirect to {location!r}: {exc}")
        if normalised in chain:
            return failed(Reason.REDIRECT_LOOP, f"{target.url} redirects back to {normalised} "
                          f"after {hops + 1} redirect(s)")
        if hops >= max_redirects:
            return failed(Reason.TOO_MANY_REDIRECTS, f"more than {max_redirects} redirects "
                          f"(next: {normalised})")
        return location

    def _refused(self, url: str, current: str, refusal: Refusal, chain: list[str]) -> FetchResult:
        if refusal.kind == Kind.SKIPPED:
            self.stats.inc(f"netguard/refused/{refusal.reason}")
        if refusal.address_class:
            self.stats.inc(f"netguard/address_class_count/{refusal.address_class}")
        return FetchResult(refusal.kind, url, final_url=current, reason=refusal.reason,
                           error=refusal.detail, redirects=len(chain), chain=list(chain))

    # -- one hop -------------------------------------------------------------------------
    def _visit(self, target: Target, task: _Task, obey_robots: bool, auth: str | None,
               max_bytes: int, truncate: bool) -> FetchResult | _Redirect:
        delay = None
        if obey_robots and self.robots is not None:
            verdict = self.robots.check(target.origin, target.url, task.deadline)
            if verdict.unreachable:
                return FetchResult(Kind.ERROR, target.url, reason=verdict.reason, error=verdict.detail)
            if not verdict.allowed:
                return FetchResult(Kind.SKIPPED, target.url, reason=Reason.ROBOTS,
                                   error=f"disallowed by {target.origin}/robots.txt")
            delay = verdict.crawl_delay_s
        elif self.robots is not None:       # robots.txt itself keeps to the site's known delay
            delay = self.robots.crawl_delay(target.origin)
        if time.monotonic() >= task.deadline:
            return self._timeout(target, "deadline reached before the request")
        try:
            slot = self.limiter.acquire(target.host, wait_s=self.politeness_wait_s,
                                        min_delay_s=delay or 0.0)
        except PolitenessTimeout as exc:
            self.stats.inc("politeness/timeout")
            return FetchResult(Kind.ERROR, target.url, reason=Reason.POLITENESS, error=str(exc),
                               retry_after_s=exc.retry_in_s)
        task.deadline += slot.waited_s  # waiting for our turn is not network time
        try:
            outcome = self._exchange(target, task, auth, max_bytes, truncate)
            # Judged before the slot goes: a half-open site's next request waits for it.
            if self.limiter.record(target.host, unreachable=isinstance(outcome, FetchResult)
                                   and outcome.kind == Kind.ERROR and outcome.reason in UNREACHABLE):
                self.stats.inc("politeness/site_paused")
        finally:
            slot.release()
        return outcome

    def _exchange(self, target: Target, task: _Task, auth: str | None, max_bytes: int,
                  truncate: bool) -> FetchResult | _Redirect:
        headers = dict(self.headers, Host=target.host_header)
        if auth:
            headers["Authorization"] = auth
        remaining = max(0.001, task.deadline - time.monotonic())
        timeout = urllib3.Timeout(connect=min(self.cfg.connect_timeout_s, remaining), read=remaining)
        self.stats.inc("downloader/request_count")
        self.stats.inc("downloader/request_method_count/GET")
        with deadline_scope(task.deadline) as scope:
            resp = None
            try:
                resp = self.pools.get(target).urlopen(
                    "GET", target.path, headers=headers, redirect=False, retries=False,
                    preload_content=False, decode_content=True, assert_same_host=False,
                    release_conn=False, timeout=timeout)
                return self._handle(resp, target, scope, max_bytes, truncate,
                                    capture_hop(resp, target.url, target.ip, headers))
            except (HTTPError, OSError, http.client.HTTPException) as exc:
                return self._network_error(exc, target, scope)
            finally:
                if resp is not None:
                    finish(resp)

    def _handle(self, resp: Any, target: Target, scope: DeadlineScope, max_bytes: int,
                truncate: bool, hop: Hop) -> FetchResult | _Redirect:
        status = resp.status
        self.stats.inc("downloader/response_count")
        self.stats.inc(f"downloader/response_status_count/{status}")
        location = resp.headers.get("Location")
        if status in REDIRECT_STATUSES and location:
            discard(resp)
            return _Redirect(status, location, hop)
        retry_after = None
        if status in (429, 503):
            retry_after = parse_retry_after(resp.headers.get("Retry-After"), self.cfg.retry_after_max_s)
            self.limiter.backoff(target.host, retry_after)
            self.stats.inc("politeness/backoff")
        body, too_large = self._read_body(resp, max_bytes, truncate)
        if scope.fired:     # the watchdog cut the socket: any body we have may be partial
            return self._timeout(target, f"total deadline of {self.cfg.timeout_s:g}s exceeded")
        hop.body, hop.truncated = body, too_large or (truncate and len(body) >= max_bytes)
        content_type = resp.headers.get("Content-Type", "")
        if too_large:       # the archive keeps the part we read (WARC-Truncated: length)
            return FetchResult(Kind.FAILED, target.url, http_status=status, reason=Reason.TOO_LARGE,
                               error=f"body larger than {max_bytes} bytes (decoded)",
                               content_type=content_type, peer_ip=target.ip, hops=[hop])
        return FetchResult(Kind.RESPONSE, target.url, http_status=status,
                           content_type=content_type, body=body,
                           retry_after_s=retry_after, peer_ip=target.ip, hops=[hop])

    def _read_body(self, resp: Any, max_bytes: int, truncate: bool) -> tuple[bytes, bool]:
        """Stream and decode at most ``max_bytes``; (body, too_large). ``truncate``: cut, no error.
        When too large, ``body`` is the first ``max_bytes`` read (empty if rejected early)."""
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
        declared = content_length(resp)
        identity = encoding in ("", "identity")
        if not truncate and identity and declared is not None and declared > max_bytes:
            return b"", True        # early reject: do not download what we would throw away
        if identity and declared is not None and declared <= max_bytes:
            # The common page: one read of what it declared.
            body = resp.read(declared) if declared else b""
            if len(body) < declared:        # the connection ended early: what the loop's
                raise IncompleteRead(len(body), declared - len(body))   # next read raises
            self.stats.inc("downloader/response_bytes", len(body))
            return body, False
        buf = bytearray()
        while True:
            # read(amt, decode_content=True) returns at most amt *decoded* bytes and
            # decompresses incrementally, so memory stays ~ max_bytes + CHUNK.
            chunk = resp.read(min(CHUNK, max_bytes + 1 - len(buf)), decode_content=True)
            if not chunk:
                break
            buf += chunk
            if len(buf) > max_bytes:
                del buf[max_bytes:]
                if not truncate:
                    return bytes(buf), True
                break
        self.stats.inc("downloader/response_bytes", len(buf))
        if encoding not in ("", "identity"):
            self.stats.inc("httpcompression/response_count")
            self.stats.inc("httpcompression/response_bytes", len(buf))
        return bytes(buf), False

    # -- errors --------------------------------------------------------------------------
    def _network_error(self, exc: BaseException, target: Target, scope: DeadlineScope) -> FetchResult:
        self.stats.inc("downloader/exception_count")
        self.stats.inc(f"downloader/exception_type_count/{type(exc).__module__}.{type(exc).__qualname__}")
        if scope.fired:
            return self._timeout(target, f"total deadline of {self.cfg.timeout_s:g}s exceeded ({exc})")
        kind, reason = classify_exception(exc)
        return FetchResult(kind, target.url, reason=reason, error=str(exc), peer_ip=target.ip)

    def _timeout(self, target: Target, error: str) -> FetchResult:
        return FetchResult(Kind.ERROR, target.url, reason=Reason.TIMEOUT, error=error, peer_ip=target.ip)

    # -- robots.txt ----------------------------------------------------------------------
    def _fetch_robots(self, url: str, deadline: float) -> FetchResult:
        """robots.txt through the same guard, pool and politeness; first 500 KiB only."""
        return self._follow(url, _Task(deadline), obey_robots=False,
                            max_redirects=ROBOTS_MAX_REDIRECTS, max_bytes=MAX_ROBOTS_BYTES,
                            truncate=True)


def _header_dict(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """What dict(urllib3's HTTPHeaderDict) gives (first spelling of a name, repeats joined
    with ", "), from the wire-order list the hop already holds, at a fraction of the cost."""
    out: dict[str, str] = {}
    names: dict[str, str] = {}
    for name, value in pairs:
        key = names.setdefault(name.lower(), name)
        out[key] = f"{out[key]}, {value}" if key in out else value
    return out


def _basic_auth(url: str) -> tuple[str, str] | None:
    """(origin, Authorization header) from userinfo in ``url``, if any."""
    if "@" not in url:
        return None             # the common case, without a second parse
    try:
        parts = parse_url(url)
    except BadURL:
        return None
    if parts.username is None:
        return None
    user, password = unquote(parts.username), unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    origin = parts.url[: len(parts.url) - len(parts.path)]
    return origin, f"Basic {token}"
