"""The walking slice end to end: real broker, real `crawld` processes, real signals."""
from __future__ import annotations

import json
import signal
import time
import uuid

import pytest
from crawld_proc import Crawld
from harness import wait_until

TRANSPORTS = ["amqp", "jetstream"]


def _key() -> str:
    return uuid.uuid4().hex[:8]



@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("partition", ["none", "host"])
def test_500_urls_three_workers_all_stored(make_crawld, site, sites, transport, partition):
    """Unpartitioned, three workers share one site's URLs; partitioned (one owner per
    site), they share the sites."""
    daemon = make_crawld(transport, workers={"count": 3, "threads": 8},
                         queue={"prefetch": 8, "partition": partition})
    key = _key()
    hosts = [site] if partition == "none" else sites
    # Partitioned, the shards are spread within the first seconds: give the run that long.
    path = "/fast/" if partition == "none" else "/slow/0.2/"
    urls = [hosts[i % len(hosts)].url(f"{path}{key}-{i}") for i in range(500)]
    published = daemon.publish(urls)
    assert published.returncode == 0, published.stderr
    assert "confirmed 500" in published.stdout
    daemon.start()
    daemon.wait_finished(500, timeout=120)
    assert daemon.stop() == 0
    assert daemon.count("results") == 500
    assert daemon.count("results", "status = 'fetched'") == 500
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == [] and rec["done"] == 500
    workers = {row[0] for row in daemon.store.query("SELECT DISTINCT worker FROM results")}
    assert len(workers) == 3, "all three workers took part"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigterm_drains_inflight_then_no_redelivery(make_crawld, site, transport):
    daemon = make_crawld(transport, workers={"count": 1, "threads": 20, "drain_timeout_s": 15},
                         queue={"prefetch": 20, "ack_wait_s": 30})
    key = _key()
    urls = [site.url(f"/slow/2/{key}-{i}") for i in range(20)]
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    wait_until(lambda: site.total_hits(f"/slow/2/{key}") >= 20, 30, what="20 fetches in flight")
    assert daemon.finished() == 0
    started = time.monotonic()
    assert daemon.stop(signal.SIGTERM) == 0
    drain_s = time.monotonic() - started
    print(f"\nSIGTERM drain with 20 in-flight 2 s fetches ({transport}): {drain_s:.2f} s")
    assert drain_s < 15
    assert daemon.count("results") == 20
    assert daemon.count("results", "writes > 1") == 0
    drained = daemon.events("worker_drained")
    assert drained and drained[-1]["unfinished"] == 0 and drained[-1]["released"] == 0

    daemon.start()                   # after the restart nothing must come back
    daemon.wait_workers(1)
    time.sleep(3)
    assert daemon.stop() == 0
    assert daemon.events("duplicate_skipped") == []
    assert site.total_hits(f"/slow/2/{key}") == 20
    assert daemon.count("results", "writes > 1") == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkill_worker_midfetch_redelivered_and_respawned(make_crawld, site, transport):
    daemon = make_crawld(transport, workers={"count": 2, "threads": 8},
                         queue={"prefetch": 8, "ack_wait_s": 3})
    key = _key()
    urls = [site.url(f"/slow/1/{key}-{i}") for i in range(40)]
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    pids = daemon.wait_workers(2)
    wait_until(lambda: site.total_hits(f"/slow/1/{key}") >= 12, 30, what="fetches in flight")
    victim = daemon.busiest_worker()     # one site: only its shard's owner has work
    assert victim in pids
    import os
    os.kill(victim, signal.SIGKILL)
    daemon.wait_finished(40, timeout=90)
    wait_until(lambda: len(daemon.worker_pids()) == 2 and victim not in daemon.worker_pids(), 30,
               what="respawned worker")
    assert daemon.stop() == 0
    assert daemon.count("results") == 40, "every task exactly one row"
    assert daemon.count("results", "writes > 1") == 0
    assert daemon.count("dead") == 0
    # The victim's half-done fetches came back: fetched a second time, by another worker.
    assert site.total_hits(f"/slow/1/{key}") > 40, "no delivery of the victim was redone"
    drained = daemon.events("worker_drained")
    assert sum(e["redelivered"] for e in drained) >= 1, "the broker redelivered nothing"
    died = daemon.events("worker_died")
    assert [e["worker_pid"] for e in died] == [victim]
    assert len(daemon.events("worker_spawned")) == 3
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == []


def test_long_fetch_keeps_amqp_heartbeats(make_crawld, site):
    daemon = make_crawld("amqp", broker={"heartbeat_s": 5}, workers={"count": 1, "threads": 2},
                         fetch={"timeout_s": 60})
    key = _key()
    assert daemon.publish([site.url(f"/slow/30/{key}")]).returncode == 0
    daemon.start()
    daemon.wait_finished(1, timeout=80)
    assert daemon.stop() == 0
    assert daemon.events("broker_connection_lost") == []
    row = daemon.store.get_result(daemon.store.query("SELECT task_id FROM results")[0][0])
    assert row["status"] == "fetched" and row["attempts"] == 1 and row["writes"] == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_publish_twice_is_idempotent(make_crawld, site, transport, rabbit, nats):
    daemon = make_crawld(transport)
    key = _key()
    urls = [site.url(f"/fast/{key}-{i}") for i in range(50)]
    first = daemon.publish(urls)
    second = daemon.publish(urls + [u + "#fragment" for u in urls[:5]])  # same canonical URL
    assert first.returncode == 0 and second.returncode == 0
    assert "new 50" in first.stdout and "confirmed 50" in first.stdout
    assert "new 0" in second.stdout and "published 0" in second.stdout
    assert daemon.count("outbox") == 50
    if transport == "amqp":
        assert rabbit.work_depth(daemon_queue(daemon)) == 50
        assert _queued_urls(rabbit.url, daemon.work_queue_of(urls[0])) == urls, "published in the file's order"


def _queued_urls(amqp_url: str, queue: str) -> list[str]:
    """The URLs waiting in ``queue``, head first (read without consuming them)."""
    import pika
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        ch = conn.channel()
        bodies = []     # consumed, not got: shard queues have a single active consumer
        for method, _props, body in ch.consume(queue, inactivity_timeout=1.0):
            if method is None:
                break
            bodies.append(json.loads(body)["url"])
        return bodies           # unacked: back in the queue, in order, when the channel closes
    finally:
        conn.close()


def test_publish_to_missing_queue_stays_new(make_crawld, site):
    daemon = make_crawld("amqp")
    out = daemon.cli("publish", "--no-declare", str(_urls_file(daemon, [site.url("/fast/x")])))
    assert out.returncode == 1
    assert "confirmed 0" in out.stdout and "failed 1" in out.stdout
    assert "unroutable" in out.stdout
    assert daemon.count("outbox", "state = 'new'") == 1
    again = daemon.cli("publish", str(_urls_file(daemon, [])))    # declares, then resends
    assert again.returncode == 0 and "confirmed 1" in again.stdout
    assert daemon.count("outbox", "state = 'confirmed'") == 1


def daemon_queue(daemon: Crawld) -> str:
    from crawld.config import load_config
    return load_config(str(daemon.config_path)).queue.name


def _urls_file(daemon: Crawld, urls: list[str]):
    path = daemon.dir / f"u-{_key()}.txt"
    path.write_text("".join(u + "\n" for u in urls))
    return path
