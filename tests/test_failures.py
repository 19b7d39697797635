"""Failure paths on real brokers: the die-where table, retry tiers, dead letters, reconnects."""
from __future__ import annotations

import json
import select
import subprocess
import sys
import time
import uuid

import pika
import pytest
from crawld_proc import Crawld, run_always_500_against_300_good
from harness import wait_until

from crawld.config import load_config
from crawld.pipeline.crashguard import LONE_DEATHS
from crawld.task import new_task


def _key() -> str:
    return uuid.uuid4().hex[:8]



def queue_of(daemon: Crawld) -> str:
    return load_config(str(daemon.config_path)).queue.name


def raw_publish(rabbit, queue: str, bodies: list[bytes], message_ids: list[str | None] | None = None) -> None:
    """A plain pika client, as in the reference code: durable queue, persistent messages."""
    with rabbit.channel() as ch:
        ch.queue_declare(queue, durable=True)
        for i, body in enumerate(bodies):
            mid = message_ids[i] if message_ids else None
            ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2, message_id=mid))


# -- the die-where table (SPEC.md), row by row ----------------------------------------------
def test_die_broker_before_storing_outbox_resends(make_crawld, site, rabbit):
    """Broker unreachable during publish: rows stay `new`, the next publish sends them."""
    daemon = make_crawld("amqp", workers={"count": 2})
    key = _key()
    urls = [site.url(f"/fast/{key}-{i}") for i in range(100)]
    rabbit.stop_app()
    try:
        down = daemon.publish(urls)
    finally:
        rabbit.start_app()
    assert down.returncode == 1 and "confirmed 0" in down.stdout
    assert daemon.count("outbox", "state = 'new'") == 100
    up = daemon.publish([])
    assert up.returncode == 0 and "confirmed 100" in up.stdout
    daemon.start()
    daemon.wait_finished(100)
    assert daemon.stop() == 0
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["done"] == 100


def test_die_broker_after_storing_before_confirm_one_duplicate(make_crawld, site, rabbit):
    """The broker stored the messages but the confirm never reached the outbox: resent,
    so each task is in the queue twice; the store still gets one row per task."""
    daemon = make_crawld("amqp", workers={"count": 2})
    key = _key()
    tasks = [new_task(site.url(f"/fast/{key}-{i}")) for i in range(50)]
    daemon.store.outbox_add(tasks)                                  # state new: no confirm seen
    raw_publish(rabbit, queue_of(daemon), [t.to_body() for t in tasks], [t.task_id for t in tasks])
    assert daemon.publish([]).returncode == 0                      # resend the unconfirmed
    assert rabbit.work_depth(queue_of(daemon)) == 100   # raw copies on the intake, resent on the shard
    daemon.start()
    wait_until(lambda: rabbit.work_depth(queue_of(daemon)) == 0 and daemon.finished() == 50, 60,
               what="both copies consumed")
    time.sleep(1)
    assert daemon.stop() == 0
    assert daemon.count("results") == 50
    # Every one of the 100 deliveries was either the one stored write, a second upsert of
    # the same row (both copies in flight at once), or recognised by task id and skipped.
    writes = daemon.store.query("SELECT SUM(writes) FROM results")[0][0]
    skipped = len(daemon.events("duplicate_skipped"))
    assert writes + skipped == 100
    assert site.total_hits(f"/fast/{key}") == writes


def test_die_worker_after_storing_before_ack_one_duplicate_no_second_row(make_crawld, site, tmp_path):
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 4}, queue={"prefetch": 4},
                         env={"CRAWLD_TEST_FAULT": "after_store",
                              "CRAWLD_TEST_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")})
    key = _key()
    assert daemon.publish([site.url(f"/fast/{key}-{i}") for i in range(30)]).returncode == 0
    daemon.start()
    daemon.wait_finished(30)
    assert daemon.stop() == 0
    assert len(daemon.events("worker_died")) == 1
    assert daemon.count("results") == 30 and daemon.count("results", "writes > 1") == 0
    assert len(daemon.events("duplicate_skipped")) >= 1      # the stored-but-unacked one came back
    rc, rec = daemon.reconcile()
    assert rc == 0


def test_die_worker_after_fetch_before_store_one_duplicate_fetch(make_crawld, site, tmp_path):
    """Fetched but not stored (so not acked): the broker redelivers it and the page is
    fetched a second time; still one row per task, nothing lost."""
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 1}, queue={"prefetch": 1},
                         env={"CRAWLD_TEST_FAULT": "before_store",
                              "CRAWLD_TEST_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")})
    key = _key()
    paths = [f"/fast/{key}-{i}" for i in range(20)]
    assert daemon.publish([site.url(p) for p in paths]).returncode == 0
    daemon.start()
    daemon.wait_finished(20)
    assert daemon.stop() == 0
    assert len(daemon.events("worker_died")) == 1
    assert sorted(site.hits(p) for p in paths) == [1] * 19 + [2], "exactly one duplicate fetch"
    assert daemon.count("results") == 20 and daemon.count("results", "writes > 1") == 0
    assert daemon.events("duplicate_skipped") == [], "the first copy never reached the store"
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == []


def test_die_worker_after_early_ack_loses_the_task(make_crawld, site, tmp_path):
    """Demonstration (tests/faults.py middleware): ack before storing, then die -> lost.
    crawld itself has no such mode."""
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 1}, queue={"prefetch": 1},
                         env={"CRAWLD_TEST_FAULT": "early_ack",
                              "CRAWLD_TEST_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")})
    key = _key()
    assert daemon.publish([site.url(f"/fast/{key}-{i}") for i in range(10)]).returncode == 0
    daemon.start()
    wait_until(lambda: daemon.finished() == 9, 60, what="the other 9 tasks")
    time.sleep(1.5)
    assert daemon.stop() == 0
    rc, rec = daemon.reconcile()
    assert rc == 1 and len(rec["lost"]) == 1
    assert daemon.cli("reconcile").returncode == 1


# What the reference consumer did wrong, as a plain pika client: auto_ack=True. It prints
# the task id of the first message it receives, then "fetches" until it is killed.
AUTO_ACK_CONSUMER = """
import json, sys, time, pika
conn = pika.BlockingConnection(pika.URLParameters(sys.argv[1]))
ch = conn.channel()
ch.queue_declare(sys.argv[2], passive=True)   # crawld declared it (a shard: SAC arguments)
def on_message(ch, method, props, body):
    print(json.loads(body)["task_id"], flush=True)
    time.sleep(3600)
ch.basic_consume(sys.argv[2], on_message, auto_ack=True)
ch.start_consuming()
"""


def test_die_worker_right_after_receive_with_auto_ack_loses_tasks(make_crawld, site, rabbit):
    """Demonstration: with auto_ack the broker forgets each message as it pushes it, so a
    consumer SIGKILLed right after receiving loses everything it was sent, and crawld
    (manual acks) started afterwards cannot bring those tasks back."""
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 2}, queue={"prefetch": 2})
    key = _key()
    assert daemon.publish([site.url(f"/fast/{key}-{i}") for i in range(40)]).returncode == 0
    queue = daemon.work_queue_of(site.url("/"))     # where the tasks wait (the site's shard)
    consumer = subprocess.Popen([sys.executable, "-c", AUTO_ACK_CONSUMER, rabbit.url, queue],
                                stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([consumer.stdout], [], [], 30)
        assert ready, "the auto_ack consumer received nothing"
        received = consumer.stdout.readline().strip()
    finally:
        consumer.kill()                      # SIGKILL right after the receive
        consumer.wait()
    daemon.start()
    daemon.wait_workers(1)
    wait_until(lambda: rabbit.queue_depth(queue) == 0, 30, what="what was left consumed")
    assert daemon.stop() == 0                # the drain finishes what crawld received
    rc, rec = daemon.reconcile()
    print(f"\nauto_ack + kill after receive: {len(rec['lost'])} of 40 tasks lost")
    assert rc == 1 and received in rec["lost"]
    assert len(rec["lost"]) + daemon.count("results") == 40 and daemon.count("dead") == 0
    named = daemon.cli("reconcile")
    assert named.returncode == 1 and f"lost {received}" in named.stdout


def test_die_worker_manual_ack_after_receive_redelivers(make_crawld, site, tmp_path):
    """The same crash with manual acks (what we do): nothing is lost."""
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 2}, queue={"prefetch": 2},
                         env={"CRAWLD_TEST_FAULT": "after_receive",
                              "CRAWLD_TEST_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")})
    key = _key()
    assert daemon.publish([site.url(f"/slow/0.2/{key}-{i}") for i in range(40)]).returncode == 0
    daemon.start()
    daemon.wait_finished(40)
    assert daemon.stop() == 0
    assert len(daemon.events("worker_died")) == 1
    rc, rec = daemon.reconcile()
    assert rc == 0 and daemon.count("results") == 40


# -- connection drops and broker restarts --------------------------------------------------
def test_connection_dropped_midfetch_stale_tags_dropped(make_crawld, site, rabbit):
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 8}, queue={"prefetch": 8})
    key = _key()
    assert daemon.publish([site.url(f"/slow/2/{key}-{i}") for i in range(16)]).returncode == 0
    daemon.start()
    daemon.wait_workers(1)
    wait_until(lambda: site.total_hits(f"/slow/2/{key}") >= 8, 30, what="fetches in flight")
    rabbit.ctl("close_all_connections", "test: drop the worker's connection")
    daemon.wait_finished(16, timeout=90)
    wait_until(lambda: rabbit.queue_depth(queue_of(daemon)) == 0, 30, what="redeliveries consumed")
    time.sleep(1)
    assert daemon.stop() == 0
    assert daemon.events("broker_connection_lost")
    assert daemon.events("stale_delivery_tag_dropped"), "late acks of the dead channel dropped"
    assert daemon.events("worker_died") == [], "no PRECONDITION_FAILED crash"
    assert daemon.count("results") == 16 and daemon.count("results", "writes > 1") == 0
    log_text = daemon.log_path.read_text()
    assert "PRECONDITION_FAILED" not in log_text


@pytest.mark.parametrize("how", ["stop_app", "restart"])
def test_rabbit_restart_during_1000_tasks_loses_nothing(make_crawld, site, rabbit, how):
    daemon = make_crawld("amqp", workers={"count": 2, "threads": 8}, queue={"prefetch": 8},
                         broker={"reconnect_max_s": 2})
    key = _key()
    assert daemon.publish([site.url(f"/slow/0.05/{key}-{i}") for i in range(1000)]).returncode == 0
    daemon.start()
    wait_until(lambda: daemon.finished() >= 200, 60, what="a fifth done")
    stored_before = daemon.count("results")
    if how == "stop_app":
        rabbit.stop_app()
        time.sleep(2)
        rabbit.start_app()
    else:
        rabbit.restart()
    stored_at_restart = daemon.count("results")
    assert 200 <= stored_before <= stored_at_restart < 1000, "the restart hit mid-run"
    daemon.wait_finished(1000, timeout=180)
    assert daemon.stop() == 0
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == [] and daemon.count("results") == 1000
    assert daemon.events("broker_connection_lost")
    assert reconnected_workers(daemon) == 2, "both workers came back to the restarted broker"


def reconnected_workers(daemon: Crawld) -> int:
    """Workers that connected again after losing the broker (a later connection generation)."""
    return len({e["pid"] for e in daemon.events("broker_connected") if e.get("generation", 1) > 1})


# -- retry tiers and dead letters -----------------------------------------------------------
def test_always_500_walks_every_tier_while_main_queue_flows(make_crawld, site, rabbit):
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 4}, queue={
        "prefetch": 4, "retry_delays_s": [1, 2, 3], "max_deliver": 4})
    run_always_500_against_300_good(daemon, site, _key())
    assert rabbit.queue_depth(f"{queue_of(daemon)}.dead") == 1
    with rabbit.channel() as ch:
        method, props, body = ch.basic_get(f"{queue_of(daemon)}.dead", auto_ack=True)
    assert props.headers["x-crawld-attempt"] == 4
    assert props.headers["x-crawld-origin"] == daemon.work_queue_of(site.url("/"))
    assert "HTTP 500" in props.headers["x-crawld-error"]


def test_dlq_replay_after_fix(make_crawld, site):
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 4},
                         queue={"retry_delays_s": [0.5], "max_deliver": 2})
    key = _key()
    flaky = [site.url(f"/flaky/2/{key}-{i}") for i in range(5)]    # 500 twice, then fixed
    assert daemon.publish(flaky).returncode == 0
    daemon.start()
    wait_until(lambda: daemon.count("dead") == 5, 60, what="5 dead")
    listed = daemon.cli("dlq", "list", "--json")
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 5
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["dead"] == 5
    replay = daemon.cli("dlq", "replay", "--all")
    assert replay.returncode == 0 and "replayed 5" in replay.stdout
    again = daemon.cli("dlq", "replay", json.loads(listed.stdout)[0]["task_id"])
    assert "replayed 0" in again.stdout and "not dead 1" in again.stdout
    daemon.wait_finished(5)
    wait_until(lambda: daemon.count("results") == 5, 30, what="replayed tasks done")
    assert daemon.stop() == 0
    assert daemon.count("dead") == 0
    rows = daemon.store.query("SELECT attempts FROM results")
    assert all(r[0] == 1 for r in rows), "attempt counter reset on replay"
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["done"] == 5


def test_malformed_messages_dead_at_once_worker_keeps_running(make_crawld, site, rabbit):
    daemon = make_crawld("amqp", workers={"count": 1})
    queue = queue_of(daemon)
    bodies = [b"not json", b"\xff\xfe\xfd", b'{"nourl": true}', b'{"url": ""}', b'{"url": 7}',
              b'{"url": "http://x/", "pad": "' + b"a" * 70000 + b'"}',
              # too long for the message_id of its event and copies: it once stopped the worker
              b'{"url": "http://x/", "task_id": "' + b"t" * 300 + b'"}']
    daemon.start()
    daemon.wait_workers(1)
    raw_publish(rabbit, queue, bodies)
    good = site.url(f"/fast/{_key()}")
    raw_publish(rabbit, queue, [json.dumps({"url": good}).encode()])   # plain-client message
    wait_until(lambda: daemon.count("dead") == 7 and daemon.count("results") == 1, 30,
               what="7 dead + 1 result")
    assert daemon.stop() == 0
    reasons = sorted(r[0] for r in daemon.store.query("SELECT reason FROM dead"))
    assert reasons == sorted(["malformed:not_json", "malformed:invalid_utf8", "malformed:no_url",
                              "malformed:no_url", "malformed:bad_types", "malformed:oversized",
                              "malformed:oversized"])
    assert rabbit.queue_depth(f"{queue}.dead") == 7
    assert daemon.events("worker_died") == []
    assert all(e.get("task_id") for e in daemon.events("message_malformed"))


@pytest.mark.parametrize("transport", ["amqp", "jetstream"])
def test_task_that_kills_its_worker_is_dead_lettered_not_redelivered_forever(make_crawld, site, transport):
    """Dramatiq's weak point: a SIGKILLed task redelivers forever. We count deliveries."""
    daemon = make_crawld(transport, workers={"count": 1, "threads": 2, "crash_limit": 20,
                                             "backoff_max_s": 0.5},
                         queue={"prefetch": 1, "max_deliver": 3, "ack_wait_s": 2},
                         env={"CRAWLD_TEST_FAULT": "poison"})
    key = _key()
    poison = site.url(f"/fast/poison/{key}")
    assert daemon.publish([poison] + [site.url(f"/fast/{key}-{i}") for i in range(10)]).returncode == 0
    daemon.start()
    daemon.wait_finished(11, timeout=120)
    assert daemon.stop() == 0
    dead = daemon.store.list_dead()
    assert [d.url for d in dead] == [poison]
    assert dead[0].reason == "poison", "a suspect is dead only after killing its worker alone"
    crashes = len(daemon.events("worker_died"))
    assert crashes == 3 + LONE_DEATHS, crashes     # max_deliver (3) deliveries, then the runs alone
    assert daemon.count("results") == 10
    assert daemon.reconcile()[0] == 0
