"""Per-site politeness held in memory by the owner of the site's shard.

With ``queue.partition = "host" | "domain"`` every URL of a site reaches one worker
process in the whole fleet (its shard's single owner), so concurrency, spacing, Crawl-delay
and back-off are plain in-process state: no lock files, no syscalls on the hot path, and
the limit holds for the fleet, not per machine (the flock limiter in politeness.py stays
for ``partition = "none"``).

Same contract as :class:`~crawld.fetch.politeness.HostLimiter` (``acquire`` / ``backoff``),
plus the site's **adaptive pause** (Nutch's per-queue exception delay, Heritrix's delay
factor): a 429/503, a Retry-After, or a run of unreachable answers pauses the whole site
with capped exponential back-off. The handler asks :meth:`paused_for` before it starts a
task and puts the task back with that delay (no attempt used) instead of parking a thread.
When a pause for unreachable answers ends, the site is half-open: one request tests it and
the site's other tasks are put back until that one is answered (a burst of every waiting
task would use an attempt of each against a site that may still be down).

Handover: a site this process has not seen yet starts with ``last_start = now``, and so do
the known sites of a shard that (re)joins this worker (:meth:`shard_acquired`), so the first
request after a handover waits one delay: a shard that moved here from another owner
(rebalance, drain, failover) never gets two requests closer than the delay from the two
owners combined.
"""
from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from crawld.fetch.politeness import MAX_BACKOFF_S, PolitenessTimeout

FAILURE_RUN = 3              # consecutive unreachable answers that pause a site
MAX_SITES = 100_000          # idle sites beyond this are forgotten, least recently used first
IDLE_FORGET_S = 600.0


@dataclass
class _Site:
    last_start: float
    shard: int | None = None
    active: int = 0
    waiting: int = 0
    not_before: float = 0.0
    backoff_s: float = 0.0
    backoff_until: float = 0.0
    failures: int = 0
    last_used: float = 0.0
    unreachable: bool = False     # paused for a run of unreachable answers, none since
    probing: bool = False         # half-open: the one request that tests it is in flight


class SiteSlot:
    """A held concurrency slot; release it (or use ``with``) when the request is done.

    ``start`` is the monotonic time reserved for this request: the spacing holds between
    reserved starts (a thread the OS wakes late starts late, never early)."""

    def __init__(self, limiter: "SiteLimiter", host: str, start: float, waited_s: float) -> None:
        self._limiter: SiteLimiter | None = limiter
        self._host = host
        self.start = start
        self.waited_s = waited_s

    def release(self) -> None:
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter._release(self._host)

    def __enter__(self) -> "SiteSlot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SiteLimiter:
    """Thread-safe; one per worker process. Times are ``time.monotonic()``."""

    def __init__(self, concurrency: int, delay_s: float = 0.0, *, max_waiting: int = 4,
                 max_not_before_s: float = 3600.0, max_backoff_s: float = MAX_BACKOFF_S,
                 shard_of: Callable[[str], int | None] = lambda host: None) -> None:
        self.shard_of = shard_of
        self.concurrency = max(1, concurrency)
        self.delay_s = delay_s
        self.max_waiting = max(1, max_waiting)
        self.max_not_before_s = max_not_before_s
        self.max_backoff_s = max_backoff_s
        self._sites: OrderedDict[str, _Site] = OrderedDict()
        self._cv = threading.Condition()

    # -- the fetch path ------------------------------------------------------------------
    def acquire(self, host: str, *, wait_s: float, min_delay_s: float = 0.0) -> SiteSlot:
        """A slot and a start time for ``host``; PolitenessTimeout when either is further
        away than ``wait_s``, or when enough threads already wait for this site (the rest
        of the pool must stay free for other sites: no head-of-line blocking)."""
        started = time.monotonic()
        give_up = started + wait_s
        with self._cv:
            site = self._site(host, started)
            if site.waiting >= self.max_waiting:
                raise PolitenessTimeout(host, 0.0, retry_in_s=self._eta(site, started, min_delay_s))
            site.waiting += 1
            try:
                start = self._wait_for_turn(host, site, started, give_up, min_delay_s)
            finally:
                site.waiting -= 1
            site.active += 1
            site.last_start = start
        pause = start - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        return SiteSlot(self, host, start, time.monotonic() - started)

    def _wait_for_turn(self, host: str, site: _Site, started: float, give_up: float,
                       min_delay_s: float) -> float:
        """Under the condition: wait for a free slot, then reserve the next polite start."""
        gap = self._gap(site, time.monotonic(), min_delay_s)    # drawn once per request
        while True:
            now = time.monotonic()
            if site.not_before > now:     # the site asked us to wait: put the task back
                raise PolitenessTimeout(host, now - started, retry_in_s=site.not_before - now)
            if site.probing:     # one request tests a site that was unreachable; not a burst
                raise PolitenessTimeout(host, now - started, retry_in_s=max(site.backoff_s, 0.5))
            if site.active < self.concurrency:
                start = max(now, site.last_start + gap, site.not_before)
                if start <= give_up:
                    site.probing = site.unreachable
                    return start
                raise PolitenessTimeout(host, now - started, retry_in_s=start - now)
            if now >= give_up:
                raise PolitenessTimeout(host, now - started)
            self._cv.wait(give_up - now)

    def _gap(self, site: _Site, now: float, min_delay_s: float) -> float:
        # Randomised like Scrapy's RANDOMIZE_DOWNLOAD_DELAY, but narrower (0.6-1.4): no two
        # starts closer than 0.6 x the delay even with network jitter. Crawl-delay is a floor.
        gap = max(self.delay_s * random.uniform(0.6, 1.4), min_delay_s)
        if site.backoff_until > now:
            gap = max(gap, site.backoff_s)
        return gap

    def _eta(self, site: _Site, now: float, min_delay_s: float) -> float:
        backlog = site.waiting + site.active
        return max(site.not_before - now, 0.0) + backlog * max(self.delay_s, min_delay_s, 0.05)

    def _release(self, host: str) -> None:
        with self._cv:
            site = self._sites.get(host)
            if site is not None:
                site.active = max(0, site.active - 1)
                site.probing = False
            self._cv.notify_all()

    # -- what the site told us ----------------------------------------------------------
    def backoff(self, host: str, retry_after_s: float | None = None) -> float:
        """A 429/503 (with Retry-After, if any): pause the whole site; returns the pause."""
        now = time.monotonic()
        with self._cv:
            site = self._site(host, now)
            pause = self._escalate(site, now)
            if retry_after_s is not None:
                pause = max(pause, min(retry_after_s, self.max_not_before_s))
            site.not_before = max(site.not_before, now + pause)
            site.failures = 0
            site.unreachable = False   # it answered
            self._cv.notify_all()      # threads waiting for this site give their tasks back
        return pause

    def record(self, host: str, unreachable: bool) -> float:
        """One answer (or none) from ``host``. A run of FAILURE_RUN unreachable answers
        pauses the site like a 429 does; any answer ends the run. Returns the new pause."""
        if not unreachable:
            site = self._sites.get(host)
            if site is not None and not site.failures and not site.unreachable:
                return 0.0      # the common answer changes nothing: no lock, no clock
        now = time.monotonic()
        with self._cv:
            site = self._site(host, now)
            if not unreachable:
                site.failures = 0
                site.unreachable = False
                return 0.0
            site.failures += 1
            # A site that already failed lately is paused again at its first new failure:
            # one probe per pause, not another run of attempts.
            if site.failures < FAILURE_RUN and site.backoff_until <= now:
                return 0.0
            site.failures = 0
            site.unreachable = True
            pause = self._escalate(site, now)
            site.not_before = max(site.not_before, now + pause)
            self._cv.notify_all()
            return pause

    def _escalate(self, site: _Site, now: float) -> float:
        """Capped exponential: 1 s, doubling while the site keeps failing within the window."""
        repeated = site.backoff_until > now
        site.backoff_s = min(self.max_backoff_s, site.backoff_s * 2 if repeated else 1.0)
        site.backoff_until = now + max(60.0, site.backoff_s * 2)
        return site.backoff_s

    def paused_for(self, host: str) -> float:
        """Seconds until ``host`` may be contacted again because it asked us to wait or
        kept failing (0 when it is not paused). Ordinary spacing is not a pause."""
        with self._cv:
            site = self._sites.get(host)
            if site is None:
                return 0.0
            return max(0.0, site.not_before - time.monotonic())

    def unreachable(self, host: str) -> bool:
        """True while ``host`` is paused, or half-open, after a run of unreachable answers."""
        with self._cv:
            site = self._sites.get(host)
            return site is not None and site.unreachable

    def close(self) -> None:
        """Nothing to let go: its state is in memory."""

    def shard_acquired(self, shard: int) -> None:
        """The shard starts delivering here (again): another owner may have served its sites
        a moment ago, so each of them waits one delay before its next request."""
        now = time.monotonic()
        with self._cv:
            for site in self._sites.values():
                if site.shard == shard:
                    site.last_start = max(site.last_start, now)

    def paused_sites(self) -> dict[str, float]:
        """Every paused site and its remaining pause, for status and metrics."""
        now = time.monotonic()
        with self._cv:
            return {h: round(s.not_before - now, 3) for h, s in self._sites.items() if s.not_before > now}

    # -- bookkeeping ------------------------------------------------------------------
    def _site(self, host: str, now: float) -> _Site:
        site = self._sites.get(host)
        if site is None:
            site = self._sites[host] = _Site(last_start=now, shard=self.shard_of(host))   # waits one delay
            self._forget_idle(now)
        else:
            self._sites.move_to_end(host)
        site.last_used = now
        return site

    def _forget_idle(self, now: float) -> None:
        while len(self._sites) > MAX_SITES:
            host, oldest = next(iter(self._sites.items()))
            if oldest.active or oldest.waiting or now - oldest.last_used < IDLE_FORGET_S:
                return
            del self._sites[host]

