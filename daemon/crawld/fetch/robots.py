"""robots.txt per origin, RFC 9309 semantics, parsed with protego.

How a robots.txt answer is read (RFC 9309 section 2.3.1):

=============================================  ===========================================
robots.txt fetch                               pages of that origin
=============================================  ===========================================
2xx                                            rules apply (first 500 KiB parsed)
4xx except 429 ("unavailable")                 everything allowed
3xx chains longer than 5, redirect loops,      everything allowed (RFC: "unavailable");
redirect to a non-http(s) or refused address   the target could never be fetched anyway
429, 5xx, timeout, connection/DNS/TLS error    everything **disallowed for now** ("unreachable"):
("unreachable")                                pages get ``error``/``robots_unavailable`` and the
                                               worker retries them; robots.txt is asked again
                                               after ``error_ttl_s``
=============================================  ===========================================

Scrapy fails open on a robots.txt download error; the RFC, and we, fail closed. 429 is
read as "unreachable" (as Google does): the server is asking us to slow down.

Answers are cached in-process per origin (scheme, host, port) for
``min(ttl_s, 24 h)`` -- the RFC's upper bound -- and one thread fetches while the others
for the same origin wait. Rules are matched for our product token: the first word of the
user agent before ``/`` (``crawld/0.1 (+url)`` -> ``crawld``). ``Crawl-delay`` and
``Request-rate`` become the minimum gap between requests to the host.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from protego import Protego

from crawld.fetch.reasons import Kind, Reason
from crawld.stats import Stats

MAX_ROBOTS_BYTES = 500 * 1024
MAX_TTL_S = 24 * 3600.0
# FetchResult reasons after which the robots target can never be fetched: "unavailable".
_UNAVAILABLE_REASONS = frozenset({Reason.SCHEME, Reason.PRIVATE_ADDRESS, Reason.OUT_OF_SCOPE,
                                  Reason.TOO_MANY_REDIRECTS, Reason.REDIRECT_LOOP, Reason.BAD_URL})


@dataclass(frozen=True)
class RobotsVerdict:
    allowed: bool
    unreachable: bool = False       # True: robots.txt could not be read, retry later
    crawl_delay_s: float | None = None
    detail: str = ""
    reason: str = Reason.ROBOTS_UNAVAILABLE     # the error reason when ``unreachable``


@dataclass
class _Entry:
    expires: float
    parser: Protego | None          # None: allow all (unavailable) or unreachable
    unreachable: bool
    detail: str
    reason: str = Reason.ROBOTS_UNAVAILABLE
    crawl_delay_s: float | None = None     # from the parser, worked out once per fetch of it
    allows_all: bool = False                # no rule for us disallows anything: skip can_fetch


def user_agent_token(user_agent: str) -> str:
    """RFC 9309 product token: ``crawld/0.1 (+url)`` -> ``crawld``."""
    first = user_agent.strip().split()[0] if user_agent.strip() else "*"
    return first.split("/", 1)[0] or "*"


class RobotsCache:
    """Thread-safe robots.txt cache; ``fetch(url, deadline)`` returns a FetchResult-like object.

    ``fetch`` must itself go through the SSRF guard and politeness (the Fetcher passes its
    own robots-free fetch path) and read at most ``MAX_ROBOTS_BYTES``.
    """

    def __init__(self, user_agent: str, fetch: Callable[[str, float], Any], *,
                 ttl_s: float = MAX_TTL_S, error_ttl_s: float = 30.0,
                 max_entries: int = 10_000, stats: Stats | None = None,
                 max_crawl_delay_s: float = 3600.0) -> None:
        self.token = user_agent_token(user_agent)
        self._fetch = fetch
        self.ttl_s = min(ttl_s, MAX_TTL_S)
        self.error_ttl_s = min(error_ttl_s, self.ttl_s)
        self.max_entries = max_entries
        self.max_crawl_delay_s = max_crawl_delay_s
        self.stats = stats or Stats()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._inflight: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def check(self, origin: str, url: str, deadline: float) -> RobotsVerdict:
        """May ``url`` (on ``origin``, e.g. ``https://example.com:8443``) be fetched?"""
        entry = self._entry(origin, deadline)
        if entry is None:
            return RobotsVerdict(False, True, detail="robots.txt fetch still running at deadline")
        if entry.unreachable:
            return RobotsVerdict(False, True, detail=entry.detail, reason=entry.reason)
        if entry.parser is None:
            return RobotsVerdict(True, detail=entry.detail)
        allowed = entry.allows_all or entry.parser.can_fetch(url, self.token)
        if not allowed:
            self.stats.inc("robotstxt/forbidden")
        return RobotsVerdict(allowed, crawl_delay_s=entry.crawl_delay_s)

    def forget_unreachable(self) -> int:
        """Drop the cached "unreachable" answers (how many): after an outage of this host's
        own network they were the network's, and each would fail its origin's pages, using
        an attempt, until ``error_ttl_s`` ran out."""
        with self._lock:
            stale = [origin for origin, entry in self._entries.items() if entry.unreachable]
            for origin in stale:
                del self._entries[origin]
        return len(stale)

    def crawl_delay(self, origin: str) -> float | None:
        """The cached Crawl-delay of ``origin`` (no fetch)."""
        with self._lock:
            entry = self._entries.get(origin)
        return entry.crawl_delay_s if entry else None

    # -- cache -------------------------------------------------------------------------
    def _entry(self, origin: str, deadline: float) -> _Entry | None:
        while True:
            with self._lock:
                entry = self._entries.get(origin)
                if entry is not None and entry.expires > time.monotonic():
                    self._entries.move_to_end(origin)
                    return entry
                event = self._inflight.get(origin)
                if event is None:
                    event = self._inflight[origin] = threading.Event()
                    break
            # Another thread is fetching this robots.txt: wait for it, not for a 2nd copy.
            if not event.wait(max(0.0, deadline - time.monotonic())):
                return None
        try:
            entry = self._load(origin, deadline)
            if entry.parser is not None:
                entry.crawl_delay_s = self._delay(entry.parser)
                entry.allows_all = allows_all(entry.parser, self.token)
            with self._lock:
                self._entries[origin] = entry
                self._entries.move_to_end(origin)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            return entry
        finally:
            with self._lock:
                self._inflight.pop(origin, None)
            event.set()

    def _load(self, origin: str, deadline: float) -> _Entry:
        self.stats.inc("robotstxt/request_count")
        result = self._fetch(f"{origin}/robots.txt", deadline)
        entry = self._interpret(result)
        if entry.unreachable and entry.reason == Reason.ROBOTS_UNAVAILABLE:
            self.stats.inc("robotstxt/unreachable")
        return entry

    def _interpret(self, result: Any) -> _Entry:
        now = time.monotonic()
        if result.kind == Kind.RESPONSE:
            status = int(result.http_status)
            self.stats.inc("robotstxt/response_count")
            self.stats.inc(f"robotstxt/response_status_count/{status}")
            if 200 <= status < 300:
                return _Entry(now + self.ttl_s, _parse(result.body), False, "")
            if 400 <= status < 500 and status != 429:
                return _Entry(now + self.ttl_s, None, False, f"robots.txt {status}: allow all")
            if 300 <= status < 400:
                return _Entry(now + self.ttl_s, None, False, f"robots.txt {status} without Location")
            return self._unreachable(now, f"robots.txt answered {status}")
        self.stats.inc(f"robotstxt/exception_count/{result.reason}")
        if result.reason == Reason.POLITENESS:
            # Our own queue for the host was full: says nothing about the site, so do not
            # cache it; the page is retried like any politeness wait.
            return _Entry(now, None, True, f"robots.txt: {result.error}", reason=Reason.POLITENESS)
        if result.kind in (Kind.SKIPPED, Kind.FAILED) and result.reason in _UNAVAILABLE_REASONS:
            return _Entry(now + self.ttl_s, None, False, f"robots.txt {result.reason}: allow all")
        return self._unreachable(now, f"robots.txt {result.reason}: {result.error}".rstrip(": "))

    def _unreachable(self, now: float, detail: str) -> _Entry:
        return _Entry(now + self.error_ttl_s, None, True, detail)

    def _delay(self, parser: Protego) -> float | None:
        delays = [parser.crawl_delay(self.token)]
        rate = parser.request_rate(self.token)
        if rate is not None and rate.requests:
            delays.append(rate.seconds / rate.requests)
        known = [float(d) for d in delays if d]
        return min(max(known), self.max_crawl_delay_s) if known else None


def allows_all(parser: Protego, token: str) -> bool:
    """True if no rule of the group that applies to ``token`` disallows anything (most
    sites' robots.txt for most crawlers): every check is then "allowed" without quoting
    and matching each URL. Reads Protego's parsed groups; False if their shape changes."""
    try:
        rules = parser._get_matching_rule_set(token)
        return rules is None or not any(rule.field == "disallow" for rule in rules._rules)
    except AttributeError:
        return False


def _parse(body: bytes) -> Protego:
    # RFC 9309: parse at least 500 KiB; the fetch already stopped reading there.
    text = body[:MAX_ROBOTS_BYTES].decode("utf-8", errors="replace").lstrip("\ufeff")
    return Protego.parse(text)
