"""Thread-safe, in-process crawl counters with Scrapy's stat names.

Operators coming from Scrapy read ``downloader/response_status_count/404`` or
``robotstxt/forbidden`` without a glossary, so the fetcher uses Scrapy's names
where Scrapy has one, and the same ``area/what[/detail]`` shape where it has not:

    downloader/request_count, downloader/request_method_count/GET
    downloader/response_count, downloader/response_status_count/<code>
    downloader/response_bytes          decoded body bytes kept
    downloader/exception_count, downloader/exception_type_count/<exception class>
    httpcompression/response_count, httpcompression/response_bytes
    robotstxt/request_count, robotstxt/response_count,
    robotstxt/response_status_count/<code>, robotstxt/exception_count/<reason>
    robotstxt/forbidden                pages refused by robots.txt
    robotstxt/unreachable              robots.txt 5xx/429/network error (RFC 9309: disallow)
    fetch/result_count/<kind>, fetch/reason_count/<reason>   (crawld's outcome table)
    netguard/refused/<reason>          SSRF guard refusals (private_address, scheme)
    netguard/address_class_count/<c>   what the refused address was (loopback, private, cgnat, ...)
    politeness/timeout, politeness/backoff

The worker owns the retry names and increments them on the same object:
``retry/count``, ``retry/reason_count/<reason>``, ``retry/max_reached``.

The worker process exports ``snapshot()``; counters are per process (summing
across workers is the exporter's job, as with Scrapy's per-crawler stats).
"""
from __future__ import annotations

import threading

# Threads that count in a table of their own; any beyond (short-lived threads come and
# go) share one table behind a lock, so the tables stay bounded.
MAX_THREAD_COUNTERS = 256


class Stats:
    """Counters that threads increment without a lock: each thread writes only its own
    table (a dict copy under the GIL is atomic, so readers sum consistent tables).

    A fetch increments a dozen counters; with one shared lock, 16 fetch threads
    contend for it a dozen times per page."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._tables: list[dict[str, float]] = []
        self._shared: dict[str, float] = {}

    def inc(self, key: str, n: float = 1) -> None:
        try:
            values = self._local.values
        except AttributeError:
            values = self._register()
        if values is None:
            with self._lock:
                self._shared[key] = self._shared.get(key, 0) + n
        else:
            values[key] = values.get(key, 0) + n

    def get(self, key: str, default: float = 0) -> float:
        snapshot = self.snapshot()
        return snapshot.get(key, default)

    def snapshot(self) -> dict[str, float]:
        """A sum over the threads' tables, safe to serialise while fetches keep counting."""
        with self._lock:
            tables = [dict(t) for t in self._tables] + [dict(self._shared)]
        total: dict[str, float] = {}
        for table in tables:
            for key, value in table.items():
                total[key] = total.get(key, 0) + value
        return total

    def _register(self) -> dict[str, float] | None:
        with self._lock:
            values: dict[str, float] | None = None
            if len(self._tables) < MAX_THREAD_COUNTERS:
                values = {}
                self._tables.append(values)
        self._local.values = values
        return values
