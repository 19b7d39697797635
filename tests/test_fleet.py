"""The polite fleet on RabbitMQ and JetStream: shards with one owner each, fleet-wide politeness,
failover, intake routing, per-site pauses and rebalancing (issue 13). Real RabbitMQ,
PostgreSQL, nats-server, test sites on ten loopback addresses and `crawld run` processes."""
from __future__ import annotations

import json
import signal
import time
import tomllib
import uuid
from typing import Any, Iterator

import pika
import pytest
from crawld_proc import Crawld
from harness import NatsServer, make_config, running_rabbit, toml_dumps, wait_until
from test_cluster import kill_host, make_host, pg_url, worker_pids_seen  # noqa: F401 (fixtures)
from test_deploy import Supervisord, _clean_env

DELAY_S = 0.2
TRANSPORTS = ["amqp", "jetstream"]


@pytest.fixture(autouse=True)
def partitioned_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every crawld of these tests (and the configs read here) runs the partitioned fleet,
    ``queue.partition = "host"``, through the env override every process inherits."""
    monkeypatch.setenv("CRAWLD_QUEUE_PARTITION", "host")


@pytest.fixture
def rabbit() -> Iterator[Any]:
    """A fresh RabbitMQ node per test, not the session's: a shared node collecting the
    shard queues of many partitioned tests stopped answering (`rabbitmqctl status` hanging).
    Cause: its open-files limit of 1024 (the wrapper's su resets it) ran its file handle
    cache out, so new connections waited forever; see deploy/cluster/README.md. Test nodes
    now raise that limit (servers.RAISE_NOFILE); the per-test node stays for isolation."""
    with running_rabbit() as node:
        yield node


def _key() -> str:
    return uuid.uuid4().hex[:8]


def _log(message: str) -> None:
    print(f"\n[fleet] {message}")


def _queue(daemon: Crawld) -> str:
    from crawld.config import load_config
    return load_config(str(daemon.config_path)).queue.name


def wait_for_status(daemon: Crawld, predicate, timeout: float = 20) -> dict:
    """`crawld status --json` until ``predicate(report)`` holds; returns that report."""
    seen: list[dict] = []

    def ok() -> bool:
        out = daemon.cli("status", "--json")
        if out.returncode != 0:
            return False
        report = json.loads(out.stdout)
        if report.get("supervisor") and predicate(report):
            seen.append(report)
            return True
        return False
    wait_until(ok, timeout, interval=0.2, what="crawld status showing it")
    return seen[-1]


def _stored_by(daemon: Crawld, pids: set[int]) -> int:
    """Result rows written by the workers with these pids (the ``worker`` column ends in one)."""
    rows = daemon.store.query("SELECT worker, COUNT(*) FROM results GROUP BY worker")
    return sum(int(n) for w, n in rows if int(w.rsplit(":", 1)[1]) in pids)


def _gaps(starts: list[float]) -> list[float]:
    return [b - a for a, b in zip(starts, starts[1:])]


def _assert_polite(sites, prefix: str) -> float:
    """At most one request in flight per site, starts never closer than half the delay;
    returns the smallest gap seen."""
    smallest = float("inf")
    for site in sites:
        assert site.max_concurrent(prefix) <= 1, (site.base_url, site.max_concurrent(prefix))
        gaps = _gaps(site.start_times(prefix))
        if gaps:
            smallest = min(smallest, min(gaps))
    assert smallest >= 0.5 * DELAY_S, smallest
    return smallest


@pytest.fixture
def broker_url(request, transport: str) -> Iterator[str]:
    """The session RabbitMQ, or a nats-server of this test's own."""
    if transport == "amqp":
        yield request.getfixturevalue("rabbit").url
        return
    server = NatsServer()
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_hosts_one_request_per_site_and_failover_after_sigkill(make_host, transport, broker_url,
                                                                    sites, pg_url):
    """Two hosts, per_host_concurrency 1 and a 0.2 s delay: each site sees one request at a
    time fleet-wide; SIGKILL of host A's process group hands its shards to host B (JetStream:
    when A's leases expire, and A's pulled messages after ack_wait_s)."""
    common = dict(broker_url=broker_url, transport=transport, store_url=pg_url,
                  workers={"count": 2, "threads": 4}, queue={"prefetch": 4, "ack_wait_s": 3},
                  fetch={"per_host_concurrency": 1, "per_host_delay_s": DELAY_S,
                         "allow_networks": ["127.0.0.0/8"]})
    host_a = make_host("host-a", **common)
    host_b = make_host("host-b", **common)
    key = _key()
    prefix = f"/fast/{key}"
    urls = [sites[i % len(sites)].url(f"{prefix}-{i}") for i in range(240)]
    assert host_a.publish(urls).returncode == 0
    host_a.start()
    host_b.start()
    # Host A must own shards when it is killed: which host's workers subscribe first is a
    # race, and a fleet where host B took every shard has no failover to show.
    wait_until(lambda: host_a.finished() >= 80 and _stored_by(host_a, worker_pids_seen(host_a)) > 0,
               60, interval=0.1, what="a third done, some of it by host A")
    owners_a = worker_pids_seen(host_a)
    killed_at = time.monotonic()
    kill_host(host_a)
    # Every site keeps being served: its next request after the kill, per site.
    wait_until(lambda: all(any(t > killed_at for t in s.start_times(prefix)) for s in sites)
               or host_b.finished() >= 240, 60, what="every site served again")
    resumed = [min((t for t in s.start_times(prefix) if t > killed_at), default=killed_at) - killed_at
               for s in sites]
    host_b.wait_finished(240, timeout=90)
    assert host_b.stop() == 0
    rc, rec = host_b.reconcile()
    assert rc == 0 and rec["lost"] == [] and rec["done"] == 240, rec
    assert host_b.count("dead") == 0
    assert _stored_by(host_b, owners_a) > 0, "host A served shards"
    smallest = _assert_polite(sites, prefix)
    _log(f"two hosts ({transport}), {len(sites)} sites, concurrency 1, delay {DELAY_S}s: "
         f"smallest gap {smallest:.3f}s; "
         f"after SIGKILL of host A every site served again within {max(resumed):.2f}s "
         f"(per site: {', '.join(f'{r:.2f}' for r in resumed)})")


def test_plain_pika_publisher_to_the_intake_queue(make_crawld, rabbit, sites):
    """The reference article's publisher: default exchange, routing key = queue name. Workers
    route each message to its shard (confirmed) and ack the intake copy."""
    daemon = make_crawld("amqp", workers={"count": 2, "threads": 4})
    queue = _queue(daemon)
    key = _key()
    urls = [sites[i % len(sites)].url(f"/fast/{key}-{i}") for i in range(60)]
    conn = pika.BlockingConnection(pika.URLParameters(rabbit.url))
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()
    for i, url in enumerate(urls):
        props = pika.BasicProperties(delivery_mode=2, message_id=f"plain-{key}-{i}" if i % 2 else None)
        ch.basic_publish("", queue, json.dumps({"url": url}).encode(), props, mandatory=True)
    ch.basic_publish("", queue, b"not json at all", pika.BasicProperties(delivery_mode=2), mandatory=True)
    conn.close()
    daemon.start()
    daemon.wait_finished(60, timeout=60)
    wait_until(lambda: daemon.count("dead") == 1, 20, what="the malformed message dead")
    assert daemon.stop() == 0
    assert daemon.count("results") == 60
    assert daemon.store.query("SELECT reason FROM dead")[0][0] == "malformed:not_json"
    assert rabbit.queue_depth(queue) == 0
    assert len(daemon.events("intake_route_failed")) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_429_with_retry_after_pauses_the_site_while_others_flow(make_crawld, sites, transport):
    """A 429 with Retry-After: 3 pauses every task of that site for 3 s, without using
    their attempts; the other sites keep being fetched meanwhile."""
    daemon = make_crawld(transport, workers={"count": 1, "threads": 8},
                         queue={"prefetch": 8, "retry_delays_s": [1.0, 2.0, 4.0]},
                         fetch={"per_host_concurrency": 1, "allow_networks": ["127.0.0.0/8"]})
    key = _key()
    slow_site, others = sites[0], sites[1:6]
    first = [slow_site.url(f"/retry-after/3/{key}")]
    rest = [slow_site.url(f"/slow/0.05/{key}-s{i}") for i in range(20)]
    rest += [o.url(f"/slow/0.05/{key}-o{i}") for o in others for i in range(30)]
    # Two publishes: one publish sends in task id order, and the 429 must come before most
    # of its site (had it come last, no task of the site would have been paused).
    assert daemon.publish(first).returncode == 0
    assert daemon.publish(rest).returncode == 0
    urls = first + rest
    daemon.start()
    paused = wait_for_status(daemon, lambda r: any(
        slow_site.host in (w.get("paused_sites") or {}) for w in r["supervisor"]["workers"]))
    text = daemon.cli("status")
    assert text.returncode == 0 and f"site paused: {slow_site.host}" in text.stdout, text.stdout
    daemon.wait_finished(len(urls), timeout=90)
    assert daemon.stop() == 0
    assert daemon.count("dead") == 0
    assert "intake_depth" in paused["broker"] and "shard_depth_max" in paused["broker"]
    assert sum(len(w["shards"]) for w in paused["supervisor"]["workers"]) >= 1
    first_429 = slow_site.start_times(f"/retry-after/3/{key}")[0]
    after = [t for t in slow_site.start_times("/") if t > first_429 + 0.001]
    assert after and min(after) - first_429 >= 2.9, min(after) - first_429
    meanwhile = sum(1 for o in others for t in o.start_times(f"/slow/0.05/{key}")
                    if first_429 < t < first_429 + 2.9)
    assert meanwhile >= 10, meanwhile
    attempts = dict(daemon.store.query("SELECT url, attempts FROM results"))
    assert all(n == 1 for url, n in attempts.items() if "/retry-after/" not in url), attempts
    assert len(daemon.events("task_postponed")) >= 1
    _log(f"429 Retry-After 3 ({transport}): the site's next request {min(after) - first_429:.2f}s later; "
         f"{meanwhile} requests to other sites meanwhile")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_site_with_90_percent_of_the_urls_does_not_stall_the_rest(make_crawld, sites, transport):
    daemon = make_crawld(transport, workers={"count": 1, "threads": 8}, queue={"prefetch": 8},
                         fetch={"per_host_concurrency": 1, "allow_networks": ["127.0.0.0/8"]})
    key = _key()
    big, others = sites[0], sites[1:6]
    big_urls = [big.url(f"/slow/0.02/{key}-b{i}") for i in range(450)]
    other_urls = [o.url(f"/slow/0.02/{key}-o{i}") for o in others for i in range(10)]
    assert daemon.publish(big_urls + other_urls).returncode == 0
    daemon.start()
    wait_until(lambda: sum(o.total_hits(f"/slow/0.02/{key}-o") for o in others) >= 50, 60,
               what="the other sites done")
    big_done = big.total_hits(f"/slow/0.02/{key}-b")
    daemon.wait_finished(500, timeout=120)
    assert daemon.stop() == 0
    assert big_done < 450 * 0.75, big_done
    _log(f"one site with 90% of 500 URLs ({transport}): the other sites finished when it had {big_done}/450")


def _peak_overlap(starts: list[float], page_s: float) -> int:
    """Requests in flight at once over all sites, from the sites' start times."""
    return max(sum(1 for t in starts if s - page_s < t <= s) for s in starts)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sites_surplus_waits_without_a_thread_and_a_drain_gives_it_back(make_crawld, sites, transport):
    """One slot a site, four threads: the busy site's surplus is parked (status shows it
    waiting for its site), so the threads fetch four sites at once instead of waiting on
    one; no task is put back for politeness. A drain gives the parked ones back unstarted,
    and the next run finishes them: none lost, none stored twice."""
    daemon = make_crawld(transport, workers={"count": 1, "threads": 4}, queue={"prefetch": 4},
                         fetch={"per_host_concurrency": 1, "allow_networks": ["127.0.0.0/8"]})
    key, page_s = _key(), 0.3
    busy, others = sites[0], sites[1:4]
    urls = [busy.url(f"/slow/{page_s}/{key}-b{i}") for i in range(32)]
    urls += [o.url(f"/slow/{page_s}/{key}-o{i}") for o in others for i in range(6)]
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    wait_until(lambda: sum(o.total_hits(f"/slow/{page_s}/{key}-o") for o in others) >= 18, 30,
               what="the other sites started")
    # Now only the busy site has work left: the threads it cannot use hold its surplus.
    waiting = wait_for_status(daemon, lambda r: any(w.get("waiting_for_site", 0) >= 1
                                                    for w in r["supervisor"]["workers"]))
    assert all(w["inflight"] >= w["waiting_for_site"] for w in waiting["supervisor"]["workers"])
    assert daemon.stop() == 0
    drained = daemon.events("worker_drained")
    assert drained and drained[-1]["released"] >= 1, drained    # the busy site's parked tasks
    daemon.start()
    daemon.wait_finished(len(urls), timeout=60)
    assert daemon.stop() == 0
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == [] and rec["done"] == len(urls), rec
    assert daemon.count("results", "writes > 1") == 0 and daemon.count("dead") == 0
    for site in sites[:4]:
        assert site.max_concurrent(f"/slow/{page_s}/{key}") == 1, site.base_url
    assert not daemon.events("task_postponed")           # nothing put back to wait for a slot
    starts = [t for site in sites[:4] for t in site.start_times(f"/slow/{page_s}/{key}")]
    peak = _peak_overlap(sorted(starts), page_s)
    assert peak == 4, peak                               # every thread fetching, one per site
    _log(f"parked surplus ({transport}): {waiting['supervisor']['workers'][0]['waiting_for_site']} "
         f"waiting for their site, peak {peak} fetches at once, {drained[-1]['released']} given back by the drain")


def _one_worker_under_load(make_crawld, sites, transport: str = "amqp") -> Crawld:
    """One worker serving ten sites' 600 tasks (the rest waits in their shards)."""
    daemon = make_crawld(transport, workers={"count": 1, "threads": 4}, queue={"prefetch": 4},
                         fetch={"per_host_concurrency": 1, "allow_networks": ["127.0.0.0/8"]})
    key = _key()
    urls = [sites[i % len(sites)].url(f"/slow/0.05/{key}-{i}") for i in range(600)]
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    daemon.wait_workers(1)
    wait_until(lambda: daemon.finished() >= 50, 30, what="first worker working")
    return daemon


def _all_stored_by(daemon: Crawld, tasks: int, workers: int) -> dict[str, int]:
    """Every task stored once, none dead or lost, by at least ``workers`` workers."""
    daemon.wait_finished(tasks, timeout=120)
    assert daemon.stop() == 0
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == [] and rec["done"] == tasks, rec
    assert daemon.count("dead") == 0
    assert daemon.count("results", "writes > 1") == 0
    stored = dict(daemon.store.query("SELECT worker, COUNT(*) FROM results GROUP BY worker"))
    assert len(stored) >= workers, stored
    return stored


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ttin_ttou_rebalance_shards_without_loss(make_crawld, sites, transport):
    daemon = _one_worker_under_load(make_crawld, sites, transport)
    daemon.send(signal.SIGTTIN)
    daemon.wait_workers(2)
    daemon.send(signal.SIGTTIN)
    daemon.wait_workers(3)
    wait_until(lambda: daemon.finished() >= 350, 90, what="three workers working")
    daemon.send(signal.SIGTTOU)
    daemon.wait_workers(2)
    stored = _all_stored_by(daemon, 600, 3)
    released = daemon.events("shard_released")
    assert released, "shards were handed over"
    if transport == "amqp":
        # a shard's tasks waiting here for their site go over with it, unstarted, rather than
        # being run first (that held the shard's other sites back for the whole window)
        parked = sum(e["parked"] for e in daemon.events("shard_releasing"))
        assert parked >= 1 and sum(e["passed_on"] for e in released) >= parked, (parked, released)
    busy = [e for e in released if e.get("reason") == "busy_hand_off"]
    _log(f"TTIN/TTOU ({transport}): results per worker {sorted(stored.values())}, {len(released)} "
         f"shards released ({len(busy)} of them busy hand-offs)")


def test_hup_with_a_new_worker_count_rebalances_without_loss(make_crawld, sites):
    """Edit workers.count 1 -> 3 and HUP: workers roll one by one and the shards spread."""
    daemon = _one_worker_under_load(make_crawld, sites)
    data = tomllib.loads(daemon.config_path.read_text())
    data["workers"]["count"] = 3
    daemon.config_path.write_text(toml_dumps(data))
    daemon.send(signal.SIGHUP)
    daemon.wait_workers(3, timeout=60)
    stored = _all_stored_by(daemon, 600, 3)
    _log(f"HUP 1 -> 3 workers: results per worker {sorted(stored.values())}")


def test_supervisorctl_numprocs_scaling_rebalances_without_loss(tmp_path, rabbit, sites, queue_name):
    """supervisord mode (`crawld worker` x numprocs): 3 -> 5 restarts the group; the five
    new workers split the ten sites' shards (two each), nothing is lost or dead."""
    config = make_config(
        tmp_path, broker_url=rabbit.url, transport="amqp",
        queue={"name": queue_name, "prefetch": 4, "partition": "host"},
        workers={"threads": 4, "drain_timeout_s": 20, "run_dir": str(tmp_path / "run")},
        fetch={"per_host_concurrency": 1, "allow_networks": ["127.0.0.0/8"]},
        store={"url": f"sqlite:///{tmp_path / 'crawld.db'}", "body_dir": str(tmp_path / "bodies")},
        log={"format": "json"})
    daemon = Crawld(config, env=_clean_env(CRAWLD_LOG_FORMAT="json"))
    sv = Supervisord(tmp_path, config)
    key = _key()
    try:
        sv.start()
        sv.wait_running(3)
        urls = [sites[i % len(sites)].url(f"/slow/0.1/{key}-{i}") for i in range(500)]
        assert daemon.publish(urls).returncode == 0
        wait_until(lambda: daemon.finished() >= 60, 60, what="three workers working")
        sv.set_numprocs(5)
        assert sv.ctl("reread").returncode == 0
        before = sv.offsets()
        assert sv.ctl("update").returncode == 0
        sv.wait_running(5)
        daemon.wait_finished(500, timeout=120)
        rc, rec = daemon.reconcile()
        assert rc == 0 and rec["lost"] == [] and rec["done"] == 500, rec
        assert daemon.count("dead") == 0
        new_pids = {pid for _, pid in sv.status().values()}
        after = dict(daemon.store.query("SELECT worker, COUNT(*) FROM results GROUP BY worker"))
        new_workers = [n for w, n in after.items() if int(w.rsplit(":", 1)[1]) in new_pids]
        assert len(new_workers) == 5, after
        drained = [e for evs in sv.events("worker_drained", before).values() for e in evs]
        assert drained and all(e["unfinished"] == 0 for e in drained)
        _log(f"supervisorctl numprocs 3 -> 5: results of the new workers {sorted(new_workers)}")
    finally:
        sv.kill()
        daemon.close()
        rabbit.delete_queues(queue_name)
