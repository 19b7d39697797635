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


class Stats:
    """A dict of counters behind one lock (increments are far cheaper than a fetch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def inc(self, key: str, n: float = 1) -> None:
        with self._lock:
            self._values[key] = self._values.get(key, 0) + n

    def get(self, key: str, default: float = 0) -> float:
        with self._lock:
            return self._values.get(key, default)

    def snapshot(self) -> dict[str, float]:
        """A copy, safe to serialise while fetches keep counting."""
        with self._lock:
            return dict(self._values)
