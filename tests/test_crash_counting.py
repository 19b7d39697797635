"""Count only real crashes; run a suspect alone before calling it poison (issue 14).

Real supervisor, real workers SIGKILLed, real RabbitMQ and nats-server restarted in full.
Deliveries a lost connection or a restart handed back are forgiven; a task that still
reaches ``max_deliver`` through worker deaths runs alone, and only a task that kills its
worker in ``LONE_DEATHS`` runs alone is dead-lettered, as ``poison``.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from typing import Any

import pytest
from crawld_proc import Crawld
from harness import NatsServer, wait_until

from crawld.pipeline.crashguard import LONE_DEATHS

HEALTHY_BESIDE_POISON = 16


def _key() -> str:
    return uuid.uuid4().hex[:8]


def broker_for(transport: str, request: pytest.FixtureRequest) -> Any:
    """The broker the test restarts: the session's RabbitMQ, or a nats-server of its own."""
    if transport == "amqp":
        return request.getfixturevalue("rabbit")
    server = NatsServer()
    server.start()
    request.addfinalizer(server.close)
    return server


@pytest.mark.parametrize("transport", ["amqp", "jetstream"])
def test_poison_beside_16_healthy_in_flight_is_dead_as_poison_all_16_stored(
        make_crawld, site, transport, request):
    broker = broker_for(transport, request)
    daemon = make_crawld(transport, broker_url=broker.url,
                         workers={"count": 1, "threads": HEALTHY_BESIDE_POISON + 1, "crash_limit": 30,
                                  "backoff_max_s": 0.5},
                         queue={"prefetch": HEALTHY_BESIDE_POISON + 1, "max_deliver": 3, "ack_wait_s": 2},
                         env={"CRAWLD_TEST_FAULT": "poison"})
    key = _key()
    healthy = [site.url(f"/slow/0.5/{key}-{i}") for i in range(HEALTHY_BESIDE_POISON)]
    poison = site.url(f"/fast/poison/{key}")
    assert daemon.publish(healthy + [poison]).returncode == 0
    daemon.start()
    daemon.wait_finished(len(healthy) + 1, timeout=180)
    assert daemon.stop() == 0
    dead = daemon.store.list_dead()
    assert [(d.url, d.reason) for d in dead] == [(poison, "poison")]
    assert daemon.count("results") == HEALTHY_BESIDE_POISON
    assert {r[0] for r in daemon.store.query("SELECT url FROM results")} == set(healthy)
    assert daemon.reconcile()[0] == 0
    # max_deliver deliveries beside others, then the runs alone that prove it
    assert len(daemon.events("worker_died")) == 3 + LONE_DEATHS
    killed_alone = daemon.events("suspect_killed_alone")
    assert [(e["url"], e["deaths"]) for e in killed_alone] == [(poison, n) for n in range(1, LONE_DEATHS)]
    isolated = {e["url"] for e in daemon.events("suspect_isolated")}
    assert poison in isolated
    survived = {e["url"] for e in daemon.events("suspect_survived")}
    assert poison not in survived and survived <= set(healthy)


class Chaos:
    """SIGKILL one random worker every ``every_s`` for ``kills`` times, from a thread."""

    def __init__(self, daemon: Crawld, kills: int, every_s: float = 2.0) -> None:
        self.daemon, self.kills, self.every_s = daemon, kills, every_s
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Chaos":
        self._thread.start()
        return self

    def _run(self) -> None:
        rng = random.Random(14)
        while len(self.killed) < self.kills and not self._stop.wait(self.every_s):
            pids = self.daemon.worker_pids()
            if pids:
                pid = rng.choice(pids)
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.append(pid)
                except ProcessLookupError:
                    pass

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._stop.set()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["amqp", "jetstream"])
def test_10000_healthy_sigkill_every_2s_two_broker_restarts_none_dead_none_lost(
        make_crawld, sites, transport, request):
    broker = broker_for(transport, request)
    tasks = 10_000
    daemon = make_crawld(transport, broker_url=broker.url,
                         workers={"count": 3, "threads": 16, "crash_limit": 50, "backoff_max_s": 0.5},
                         queue={"prefetch": 16, "max_deliver": 3, "ack_wait_s": 5},
                         broker={"reconnect_max_s": 1})
    key = _key()
    # Ten sites, as a fleet crawls: partitioned, one site would be one worker's alone.
    urls = [sites[i % len(sites)].url(f"/slow/0.3/{key}-{i}") for i in range(tasks)]
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    wait_until(lambda: daemon.finished() >= 500, 60, what="the run under way")
    chaos = Chaos(daemon, kills=7).start()
    time.sleep(3)
    broker.restart()                                 # a full stop and start, on its data dir
    target = min(tasks - 1, daemon.finished() + 500)
    wait_until(lambda: daemon.finished() >= target, 120, what="progress after the first restart")
    broker.restart()
    chaos.join(60)
    assert len(chaos.killed) >= 6, chaos.killed
    daemon.wait_finished(tasks, timeout=300)
    assert daemon.stop() == 0
    dead = daemon.store.list_dead(limit=20)
    assert dead == [], [(d.url, d.reason, d.error) for d in dead]
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == [] and daemon.count("results") == tasks
    print(f"\n[issue14] {transport}: {len(chaos.killed)} SIGKILLs, 2 broker restarts, "
          f"{len(daemon.events('suspect_isolated'))} suspects run alone, "
          f"{sum(e.get('count', 0) for e in daemon.events('deliveries_forgiven'))} deliveries forgiven")


def test_deliveries_a_lost_connection_gave_back_are_forgiven(rabbit, tmp_path, queue_name):
    """Three connection losses with a task in hand: the broker redelivers it three times
    (the unpartitioned classic work queue: flagged redelivered, so the store counts it), yet it is no suspect,
    because the worker knew it held it and forgave each. A SIGKILLed worker could not:
    the same count without forgiveness makes it one."""
    from harness import make_config

    from crawld.config import load_config
    from crawld.fetch import Fetcher
    from crawld.pipeline.handler import DeliveryHandler
    from crawld.store import open_store
    from crawld.task import new_task
    from crawld.transports.amqp import AmqpTransport

    cfg = load_config(str(make_config(
        tmp_path, broker_url=rabbit.url, transport="amqp", queue={"name": queue_name, "prefetch": 1,
                                                                  "max_deliver": 3,
                                                                  "partition": "none"},
        store={"url": f"sqlite:///{tmp_path}/s.db", "body_dir": str(tmp_path / "bodies")},
        broker={"reconnect_max_s": 1})))
    store = open_store(cfg.store)
    fetcher = Fetcher(cfg.fetch)
    handler = DeliveryHandler(cfg, store, fetcher, worker_id="test:1", counts_deliveries=False)
    transport = AmqpTransport(cfg, "test:1")
    transport.set_giveback_listener(handler.forgive)
    got: list = []
    try:
        transport.connect()
        task = new_task(f"http://127.0.0.1:9/{_key()}")
        with rabbit.channel() as ch:
            ch.basic_publish("", queue_name, task.to_body())
        transport.start_consuming(got.append, lambda: 1)
        for loss in range(4):
            wait_until(lambda: (transport.poll(0.05), len(got) > loss)[1], 30, what=f"delivery {loss + 1}")
            if loss:
                assert got[loss].redelivered
                handler.guard.check(got[loss], task)         # what the handler does on each copy
            if loss < 3:
                rabbit.ctl("close_all_connections", "test: drop the worker's connection")
                wait_until(lambda: (transport.poll(0.05), not transport.connected)[1], 30, what="loss seen")
        handler.guard.flush()
        assert store.forgiven(task.task_id) == 3
        assert store.bump_redelivery(task.task_id, delta=0) == 3, "the broker did redeliver it 3 times"
        assert not handler.guard.check(got[3], task).suspect
        store.forgive({task.task_id: -3})                    # as if SIGKILLed: nothing forgiven
        assert handler.guard.check(got[3], task).suspect
    finally:
        transport.close()
        fetcher.close()
        store.close()
