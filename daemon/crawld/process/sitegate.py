"""Deliveries wait for their site here, without a thread, and free threads go to the
sites that have the fewest fetches running.

A shard owner holds every task of its sites, and politeness lets a site run only
``per_host_concurrency`` fetches at once. Handed straight to the pool, the rest of a site's
tasks would each take a thread only to wait for a slot, while other sites' tasks sit in the
pool's queue behind them (500 sites on 2 x 256 threads ran at 0.6 of the ideal for this).
Scrapy keeps one queue per download slot for the same reason.

So every delivery is parked under its site, and a thread that is free takes the oldest task
of the site with the fewest fetches running (below the limit). Sites progress evenly: with
more sites than threads each runs one fetch at a time, with fewer they use their whole
limit; none finishes early while another is left with a serial tail of its pages.

Not thread-safe on its own: the worker calls it under its lock. The limiter behind the
fetcher still decides when a request may start (delay, Crawl-delay, back-off); the gate only
keeps threads for deliveries that can start.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from crawld.transports.base import Delivery


class SiteGate:
    def __init__(self, limit: int, site_of: Callable[[Delivery], str | None]) -> None:
        self.limit = max(1, limit)
        self._site_of = site_of
        self._running: dict[str, int] = {}               # site -> deliveries handed to the pool
        self._parked: dict[str, deque[Delivery]] = {}
        # _ready[k]: sites with parked tasks and k fetches running (k < limit), oldest first
        self._ready: list[dict[str, None]] = [{}]
        self._site_by_id: dict[int, str] = {}             # id(delivery) -> site, while running
        self.parked = 0

    def park(self, delivery: Delivery) -> bool:
        """Queue ``delivery`` under its site; False for one without a site (malformed,
        say), which the caller hands to the pool at once: the handler judges it."""
        site = self._site_of(delivery)
        if site is None:
            return False
        queue = self._parked.get(site)
        if queue is None:
            queue = self._parked[site] = deque()
            self._file(site, self._running.get(site, 0))
        queue.append(delivery)
        self.parked += 1
        return True

    def next(self) -> Delivery | None:
        """For a free thread: the oldest task of the site with the fewest fetches running
        (below the limit), or None when every parked site is at its limit."""
        for running, sites in enumerate(self._ready):
            if sites:
                site = next(iter(sites))
                del sites[site]
                queue = self._parked[site]
                delivery = queue.popleft()
                self.parked -= 1
                self._running[site] = running + 1
                self._site_by_id[id(delivery)] = site
                if not queue:
                    del self._parked[site]
                else:
                    self._file(site, running + 1)
                return delivery
        return None

    def finished(self, delivery: Delivery) -> None:
        """``delivery`` left the pool: its site has one fetch less running."""
        site = self._site_by_id.pop(id(delivery), None)
        if site is None:
            return
        running = self._running[site]
        if running > 1:
            self._running[site] = running - 1
        else:
            del self._running[site]
        if site in self._parked:
            self._unfile(site, running)
            self._file(site, running - 1)

    def discard(self, matches: Callable[[Delivery], bool]) -> list[Delivery]:
        """Take the parked deliveries that ``matches`` out, unstarted (their connection is
        gone, or their shard is being handed over). Returns them, oldest first per site."""
        removed: list[Delivery] = []
        for site in list(self._parked):
            kept: deque[Delivery] = deque()
            for parked in self._parked[site]:
                (removed if matches(parked) else kept).append(parked)
            if not kept:
                del self._parked[site]
                self._unfile(site, self._running.get(site, 0))
            else:
                self._parked[site] = kept
        self.parked -= len(removed)
        return removed

    def take_parked(self) -> list[Delivery]:
        """Every parked delivery, oldest first per site, and none parked after (drain)."""
        parked = [d for queue in self._parked.values() for d in queue]
        self._parked.clear()
        self._ready = [{}]
        self.parked = 0
        return parked

    # -- the ready lists ------------------------------------------------------------------
    def _unfile(self, site: str, running: int) -> None:
        """Out of the ready list for ``running`` fetches (in none at the limit)."""
        if running < len(self._ready):
            self._ready[running].pop(site, None)

    def _file(self, site: str, running: int) -> None:
        if running >= self.limit:
            return                                      # back in a list when one finishes
        while len(self._ready) <= running:
            self._ready.append({})
        self._ready[running][site] = None
