"""``crawld_reconnects_total`` counts real broker restarts (it used to stay 0 forever).

Real supervisor, real workers, real RabbitMQ and nats-server, scraped on the supervisor's
aggregate metrics endpoint like Prometheus would.
"""
from __future__ import annotations

import urllib.error
import urllib.request
import uuid

from crawld_proc import Crawld
from harness import free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

WORKERS = 2


def scrape(port: int) -> dict[str, float]:
    """Every sample on the endpoint, by name (label sets summed: one series per worker)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def reconnects(port: int) -> float:
    return scrape(port)["crawld_reconnects_total"]


def serving(port: int) -> bool:
    try:
        return "crawld_reconnects_total" in scrape(port)
    except (urllib.error.URLError, OSError):
        return False


def start_with_metrics(daemon: Crawld, port: int) -> None:
    daemon.start()
    daemon.wait_workers(WORKERS)
    wait_until(lambda: serving(port), 30, what="the reconnect counter on the metrics endpoint")


def still_fetches(daemon: Crawld, site: object) -> None:
    """After the restart the workers are consuming again, not just counted."""
    key = uuid.uuid4().hex[:8]
    assert daemon.publish([site.url(f"/fast/{key}-{i}") for i in range(20)]).returncode == 0
    daemon.wait_finished(20, timeout=60)


def test_rabbitmq_restart_counts_one_reconnect_per_worker(make_crawld, rabbit, site) -> None:
    port = free_port()
    daemon = make_crawld("amqp", workers={"count": WORKERS}, metrics={"port": port},
                         broker={"reconnect_max_s": 1})
    start_with_metrics(daemon, port)
    assert reconnects(port) == 0
    rabbit.restart()
    wait_until(lambda: reconnects(port) >= WORKERS, 60, what="every worker reconnected")
    still_fetches(daemon, site)
    assert reconnects(port) >= WORKERS
    assert daemon.stop() == 0


def test_nats_server_restart_counts_one_reconnect_per_worker(make_crawld, js_server, site) -> None:
    port = free_port()
    daemon = make_crawld("jetstream", broker_url=js_server.url, workers={"count": WORKERS},
                         metrics={"port": port}, broker={"reconnect_max_s": 1})
    start_with_metrics(daemon, port)
    assert reconnects(port) == 0
    js_server.restart()
    wait_until(lambda: reconnects(port) >= WORKERS, 60, what="every worker reconnected")
    still_fetches(daemon, site)
    assert reconnects(port) >= WORKERS
    assert daemon.stop() == 0
