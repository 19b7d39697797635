"""Prometheus metrics.

Workers are separate processes, so they use prometheus-client's multiprocess mode:
each writes its samples to files in ``PROMETHEUS_MULTIPROC_DIR`` and the supervisor
serves the aggregate on ``metrics.port``. The env var must be set before
prometheus_client is imported, hence the lazy imports here.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
FETCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60)


class Metrics:
    """The worker's counters; a no-op when metrics are off (no multiproc dir)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = bool(os.environ.get(MULTIPROC_ENV)) if enabled is None else enabled
        if not self.enabled:
            return
        from prometheus_client import Counter, Gauge, Histogram
        self.received = Counter("crawld_tasks_received", "Deliveries received from the broker")
        self.outcomes = Counter("crawld_tasks_settled", "Deliveries settled, by outcome", ["outcome"])
        self.retried = Counter("crawld_tasks_retried", "Tasks sent to a retry tier", ["reason"])
        self.dead = Counter("crawld_tasks_dead", "Tasks dead-lettered", ["reason"])
        self.redelivered = Counter("crawld_redeliveries", "Deliveries the broker marked as redelivered")
        self.duplicates = Counter("crawld_duplicates_skipped", "Deliveries whose task id already had a result")
        self.reconnects = Counter("crawld_reconnects", "Broker reconnects")
        self.fetch_seconds = Histogram("crawld_fetch_seconds", "Fetch wall time", buckets=FETCH_BUCKETS)
        self.inflight = Gauge("crawld_inflight", "Deliveries being processed", multiprocess_mode="livesum")
        self.http_status = Counter("crawld_http_responses", "HTTP responses by status", ["status"])
        self.paused = Gauge("crawld_paused", "Workers paused by a fault of their own, by reason",
                            ["reason"], multiprocess_mode="livesum")
        self.shards_owned = Gauge("crawld_shards_owned", "Shards served by this worker",
                                  multiprocess_mode="livesum")
        self.sites_paused = Gauge("crawld_sites_paused", "Sites paused after a 429/503 or failures",
                                  multiprocess_mode="livesum")
        self.handovers = Gauge("crawld_shard_handovers", "Shards handed to another worker",
                               multiprocess_mode="livesum")

    def on_received(self, redelivered: bool) -> None:
        if self.enabled:
            self.received.inc()
            if redelivered:
                self.redelivered.inc()

    def on_settled(self, outcome: str, reason: str = "") -> None:
        if not self.enabled:
            return
        self.outcomes.labels(outcome).inc()
        if outcome == "retry":
            self.retried.labels(reason or "unknown").inc()
        elif outcome == "dead":
            self.dead.labels(reason or "unknown").inc()
        elif outcome == "duplicate":
            self.duplicates.inc()

    def on_fetch(self, seconds: float, http_status: int | None) -> None:
        if self.enabled:
            self.fetch_seconds.observe(seconds)
            if http_status is not None:
                self.http_status.labels(str(http_status)).inc()

    def on_reconnect(self) -> None:
        if self.enabled:
            self.reconnects.inc()

    def set_paused(self, reason: str, paused: bool) -> None:
        if self.enabled:
            self.paused.labels(reason).set(1 if paused else 0)

    def set_inflight(self, value: int) -> None:
        if self.enabled:
            self.inflight.set(value)

    def set_fleet(self, shards_owned: int, sites_paused: int, handovers: int) -> None:
        if self.enabled:
            self.shards_owned.set(shards_owned)
            self.sites_paused.set(sites_paused)
            self.handovers.set(handovers)


def mark_worker_dead(pid: int) -> None:
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(pid)


def serve_aggregate(host: str, port: int, dead_last_minute: Callable[[], float]) -> Any:
    """Serve every worker's samples plus a live dead-letter rate gauge."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server
    from prometheus_client.core import GaugeMetricFamily

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)

    class DeadRate:
        def collect(self) -> Any:
            family = GaugeMetricFamily("crawld_dead_letters_per_minute",
                                       "Tasks dead-lettered in the last 60 s (alert on this rate)")
            try:
                family.add_metric([], dead_last_minute())
            except Exception:  # the store may be briefly unavailable; skip this scrape
                pass
            yield family

    registry.register(DeadRate())
    server, thread = start_http_server(port, addr=host, registry=registry)
    return server


def dead_rate_probe(store_factory: Callable[[], Any]) -> Callable[[], float]:
    store_holder: dict[str, Any] = {}

    def probe() -> float:
        if "store" not in store_holder:
            store_holder["store"] = store_factory()
        return float(store_holder["store"].dead_since(time.time() - 60))
    return probe
