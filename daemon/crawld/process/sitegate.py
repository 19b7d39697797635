"""Deliveries wait for their site here, without a thread.

A shard owner holds every task of its sites, and politeness lets a site run only
``per_host_concurrency`` fetches at once. Handed straight to the pool, the rest of that
site's tasks would each take a thread only to wait for a slot, while other sites' tasks sit
in the pool's queue behind them (500 sites on 2 x 256 threads ran at 0.6 of the ideal for
this). Scrapy keeps one queue per download slot for the same reason. The gate hands a
delivery to the pool only while its site has a free slot, and parks the rest per site; a
finished delivery passes its slot to the next parked one of the same site.

Not thread-safe on its own: the worker calls it under its lock. The limiter behind the
fetcher still decides when a request may start (delay, Crawl-delay, back-off); the gate
only keeps threads for deliveries that can start.
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
        self._site_by_id: dict[int, str] = {}             # id(delivery) -> site, while running
        self.parked = 0

    def admit(self, delivery: Delivery) -> bool:
        """True: hand it to the pool now. False: parked until a slot of its site frees. A
        delivery without a site (malformed, say) always goes on: the handler judges it."""
        site = self._site_of(delivery)
        if site is None:
            return True
        running = self._running.get(site, 0)
        if running < self.limit:
            self._running[site] = running + 1
            self._site_by_id[id(delivery)] = site
            return True
        self._parked.setdefault(site, deque()).append(delivery)
        self.parked += 1
        return False

    def finished(self, delivery: Delivery, pass_on: bool = True) -> Delivery | None:
        """``delivery`` left the pool: the parked delivery that takes its slot, if any
        (none when ``pass_on`` is False: a draining worker starts nothing new)."""
        site = self._site_by_id.pop(id(delivery), None)
        if site is None:
            return None
        queue = self._parked.get(site) if pass_on else None
        if queue:
            successor = queue.popleft()
            self.parked -= 1
            if not queue:
                del self._parked[site]
            self._site_by_id[id(successor)] = site      # the slot passes on: count unchanged
            return successor
        running = self._running[site] - 1
        if running:
            self._running[site] = running
        else:
            del self._running[site]
        return None

    def discard(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Take these out if parked (the connection that brought them is gone: the broker
        delivers them again). Returns the ones that were parked."""
        ids = {id(d) for d in deliveries}
        removed: list[Delivery] = []
        for site in list(self._parked):
            kept = deque()
            for parked in self._parked[site]:
                (removed if id(parked) in ids else kept).append(parked)
            if kept:
                self._parked[site] = kept
            else:
                del self._parked[site]
        self.parked -= len(removed)
        return removed

    def take_parked(self) -> list[Delivery]:
        """Every parked delivery, oldest first per site, and none parked after (drain)."""
        parked = [d for queue in self._parked.values() for d in queue]
        self._parked.clear()
        self.parked = 0
        return parked
