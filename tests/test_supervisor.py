"""The supervisor as operators use it: HUP/TTIN/TTOU under load, crash loops, stuck workers,
pid file, status and the metrics endpoint. Real processes, real signals, real RabbitMQ."""
from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
import uuid

import pytest
from crawld_proc import Crawld
from harness import free_port, wait_until


def _key() -> str:
    return uuid.uuid4().hex[:8]



@pytest.fixture
def make_crawld(make_crawld):
    """Small workers (4 threads, prefetch 4) so resizing is visible under modest load."""
    def build(transport: str = "amqp", env: dict | None = None, **sections) -> Crawld:
        sections["workers"] = {"threads": 4, **sections.get("workers", {})}
        sections["queue"] = {"prefetch": 4, **sections.get("queue", {})}
        return make_crawld(transport, env=env, **sections)
    return build


def set_count(daemon: Crawld, count: int) -> None:
    text = daemon.config_path.read_text()
    text = re.sub(r"(?m)^count = \d+$", f"count = {count}", text)
    daemon.config_path.write_text(text)


def live_generation(daemon: Crawld, generation: int, count: int) -> bool:
    state = daemon.supervisor_state()
    workers = state.get("workers", [])
    return (len(workers) == count and all(w["generation"] == generation and w["state"] == "running"
                                          for w in workers))


def stored_by_worker(daemon: Crawld) -> dict[int, int]:
    """Rows in results per worker pid (the ``worker`` column is host:pid)."""
    rows = daemon.store.query("SELECT worker, COUNT(*) FROM results GROUP BY worker")
    return {int(worker.rsplit(":", 1)[1]): n for worker, n in rows}


def stored_by_generation(daemon: Crawld) -> dict[int, int]:
    generation = {e["worker_pid"]: e["generation"] for e in daemon.events("worker_spawned")}
    out: dict[int, int] = {}
    for pid, n in stored_by_worker(daemon).items():
        out[generation[pid]] = out.get(generation[pid], 0) + n
    return out


def assert_no_redelivery(daemon: Crawld, tasks: int, hits: list[int]) -> None:
    """Nothing the rolls did made a task run twice: one row, one write and one request
    (``hits``: the site's count per URL) per task, nothing lost."""
    assert daemon.count("results") == tasks
    assert daemon.count("results", "writes > 1") == 0
    assert daemon.events("duplicate_skipped") == []
    assert hits == [1] * tasks, "a page was fetched twice"
    drained = daemon.events("worker_drained")
    assert drained and all(e["unfinished"] == 0 for e in drained)
    redelivered = sum(e["redelivered"] for e in drained)
    if partitioned(daemon) and transport_of(daemon) == "amqp":
        # A window per shard consumer (quorum queues have no channel-wide prefetch), so a
        # worker may hold more than its threads: a drain passes the unstarted ones on as
        # fresh copies (released, never flagged redelivered). Only a copy published into a
        # shard at the very moment its consumer is cancelled comes back flagged (pika
        # rejects it), never started anywhere: a few at most, and never fetched twice.
        assert redelivered <= len(drained), "redelivered because of the roll"
    else:
        assert redelivered == 0, "redelivered because of the roll"
        assert all(e["released"] == 0 for e in drained)
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == []


def partitioned(daemon: Crawld) -> bool:
    from crawld.config import load_config
    return load_config(str(daemon.config_path)).queue.partition != "none"


def transport_of(daemon: Crawld) -> str:
    from crawld.config import load_config
    return load_config(str(daemon.config_path)).broker.transport


@pytest.mark.parametrize("transport", ["amqp", "jetstream"])
def test_hup_rolls_workers_2_4_1_under_load(make_crawld, sites, transport):
    """Ten sites: partitioned, every worker of a generation owns some of their shards."""
    daemon = make_crawld(transport, workers={"count": 2})
    key = _key()
    tasks = 600
    paths = [(sites[i % len(sites)], f"/slow/0.2/{key}-{i}") for i in range(tasks)]
    assert daemon.publish([site.url(path) for site, path in paths]).returncode == 0
    daemon.start()
    daemon.wait_workers(2)
    wait_until(lambda: daemon.finished() >= 20, 30, what="load running")
    set_count(daemon, 4)
    daemon.send(signal.SIGHUP)
    wait_until(lambda: live_generation(daemon, 2, 4), 60, what="4 workers of generation 2")
    set_count(daemon, 1)
    daemon.send(signal.SIGHUP)
    wait_until(lambda: live_generation(daemon, 3, 1), 60, what="1 worker of generation 3")
    daemon.wait_finished(tasks, timeout=120)
    assert daemon.stop() == 0
    # The rolls happened under load: every generation stored tasks, the last one included
    # (work was still waiting when the roll to 1 worker had replaced the others).
    assert sorted(stored_by_generation(daemon)) == [1, 2, 3], stored_by_generation(daemon)
    assert len(daemon.events("worker_retiring")) == 2 + 4
    assert daemon.events("worker_died") == []
    assert_no_redelivery(daemon, tasks, [site.hits(path) for site, path in paths])


def test_ttin_ttou_resize_under_load(make_crawld, sites):
    """Ten sites: partitioned, every worker owns some of their shards."""
    daemon = make_crawld("amqp", workers={"count": 1})
    key = _key()
    tasks = 200
    paths = [(sites[i % len(sites)], f"/slow/0.1/{key}-{i}") for i in range(tasks)]
    assert daemon.publish([site.url(path) for site, path in paths]).returncode == 0
    daemon.start()
    daemon.wait_workers(1)
    for _ in range(2):
        daemon.send(signal.SIGTTIN)
        time.sleep(0.3)
    daemon.wait_workers(3)
    daemon.send(signal.SIGTTOU)
    daemon.wait_workers(2)
    daemon.wait_finished(tasks, timeout=120)
    assert daemon.stop() == 0
    assert daemon.events("worker_died") == []
    # Resized under load: the two workers TTIN added stored tasks, and so did the one
    # TTOU retired (it drained, then exited).
    spawned = [e["worker_pid"] for e in daemon.events("worker_spawned")]
    retired = [e["worker_pid"] for e in daemon.events("worker_retiring")]
    stored = stored_by_worker(daemon)
    assert len(spawned) == 3 and len(retired) == 1 and retired[0] in spawned
    assert all(stored.get(pid, 0) > 0 for pid in spawned), (spawned, stored)
    assert_no_redelivery(daemon, tasks, [site.hits(path) for site, path in paths])


def test_crash_at_start_trips_the_crash_loop_limit(make_crawld):
    daemon = make_crawld("amqp", workers={"count": 1, "crash_limit": 10, "backoff_max_s": 1.0},
                         env={"CRAWLD_TEST_FAULT": "boot"})
    daemon.start()
    code = daemon.proc.wait(60)
    assert code == 1
    died = daemon.events("worker_died")
    assert len(died) == 10 and died[-1]["crashes_in_a_row"] == 10
    assert [e["backoff_s"] for e in died[:3]] == [0.5, 1.0, 1.0], "exponential, capped"
    assert daemon.events("crash_loop")
    assert "crashed 10 times in a row" in daemon.log_path.read_text()


def test_stuck_worker_is_replaced(make_crawld, site, tmp_path):
    daemon = make_crawld("amqp", workers={"count": 1, "liveness_timeout_s": 2},
                         env={"CRAWLD_TEST_FAULT": "stuck",
                              "CRAWLD_TEST_FAULT_ONCE_FILE": str(tmp_path / "stuck-once")})
    daemon.start()
    wait_until(lambda: daemon.events("worker_stuck"), 30, what="stuck worker detected")
    daemon.wait_workers(1)
    key = _key()
    assert daemon.publish([site.url(f"/fast/{key}-{i}") for i in range(10)]).returncode == 0
    daemon.wait_finished(10)
    assert daemon.stop() == 0
    assert len(daemon.events("worker_spawned")) == 2


def start_with_slow_fetches(daemon: Crawld, site, seconds: int, n: int) -> str:
    """Publish ``n`` pages that take ``seconds``, start, wait until all are being fetched;
    return the URL prefix of those pages."""
    prefix = f"/slow/{seconds}/{_key()}"
    assert daemon.publish([site.url(f"{prefix}-{i}") for i in range(n)]).returncode == 0
    daemon.start()
    wait_until(lambda: site.total_hits(prefix) >= n, 30, what="fetches in flight")
    return prefix


def test_quit_is_a_fast_stop(make_crawld, site):
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 4, "drain_timeout_s": 30})
    prefix = start_with_slow_fetches(daemon, site, 5, 4)
    started = time.monotonic()
    assert daemon.stop(signal.SIGQUIT) == 0
    quit_s = time.monotonic() - started
    assert daemon.count("results") == 0, "did not wait for the 5 s fetches"
    rc, rec = daemon.reconcile()
    assert rc == 1 and len(rec["lost"]) == 4      # still in the broker: not lost, just pending
    # The same four fetches in flight again, now stopped with TERM: that drain waits for them.
    daemon.start()
    wait_until(lambda: site.total_hits(prefix) >= 8, 60, what="fetches in flight again")
    started = time.monotonic()
    assert daemon.stop() == 0
    drain_s = time.monotonic() - started
    assert daemon.count("results") == 4, "TERM finished and stored the in-flight fetches"
    assert drain_s > 3, f"the drain waited for the 5 s fetches ({drain_s:.1f}s)"
    assert quit_s < drain_s - 2, f"QUIT ({quit_s:.1f}s) did not wait like a drain ({drain_s:.1f}s)"
    assert daemon.reconcile()[0] == 0


def test_pid_file_status_and_metrics(make_crawld, site, tmp_path):
    port = free_port()
    pid_file = tmp_path / "run" / "crawld.pid"
    daemon = make_crawld("amqp", workers={"count": 2, "pid_file": str(pid_file)},
                         metrics={"port": port}, queue={"retry_delays_s": [0.5], "max_deliver": 2})
    key = _key()
    urls = ([site.url(f"/fast/{key}-{i}") for i in range(40)] + [site.url(f"/404/{key}")]
            + [site.url(f"/500/{key}")])
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    daemon.wait_workers(2)
    assert int(pid_file.read_text()) == daemon.proc.pid
    daemon.wait_finished(42)
    time.sleep(1.5)               # let the workers' last samples land
    status = json.loads(daemon.cli("status", "--json").stdout)
    assert status["store"]["done"] == 41 and status["store"]["dead"] == 1
    assert status["broker"]["depth"] == 0 and status["broker"]["consumers"] == 2
    assert len(status["supervisor"]["workers"]) == 2
    assert status["store"]["e2e_latency_s"]["p50"] is not None
    text_status = daemon.cli("status").stdout
    assert "running" in text_status and "retry tier" in text_status
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    metrics = parse_metrics(body)
    assert metrics['crawld_tasks_settled_total{outcome="ack"}'] == 41
    assert metrics['crawld_tasks_dead_total{reason="retries_exhausted"}'] == 1
    assert metrics['crawld_tasks_retried_total{reason="http_500"}'] == 1
    assert metrics['crawld_tasks_received_total'] == 43
    assert metrics["crawld_dead_letters_per_minute"] == 1
    assert metrics['crawld_http_responses_total{status="404"}'] == 1
    assert daemon.stop() == 0
    assert not pid_file.exists()
    log_text = daemon.log_path.read_text()
    assert "guest:guest@" not in log_text and "guest:***@" in log_text, "credentials never printed"


def parse_metrics(body: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = out.get(name, 0.0) + float(value)
    return out


def test_worker_that_cannot_boot_stops_the_supervisor_at_once(make_crawld, rabbit):
    """gunicorn's rule: a topology the broker refuses will not be accepted on retry either."""
    daemon = make_crawld("amqp", workers={"count": 2})
    from crawld.config import load_config
    queue = load_config(str(daemon.config_path)).queue.name
    with rabbit.channel() as ch:        # someone else owns the queue with other arguments
        ch.queue_declare(queue, durable=True, arguments={"x-max-length": 10})
    started = time.monotonic()
    daemon.start()
    assert daemon.proc.wait(30) == 1
    assert time.monotonic() - started < 15
    failed = daemon.events("worker_boot_failed")
    assert failed and failed[0]["reason"] == "topology" and "PRECONDITION_FAILED" in failed[0]["error"]
    assert "failed to boot" in daemon.log_path.read_text()


def test_quit_during_graceful_drain_escalates(make_crawld, site):
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 2, "drain_timeout_s": 60})
    start_with_slow_fetches(daemon, site, 20, 2)
    daemon.send(signal.SIGTERM)
    time.sleep(1)
    assert daemon.proc.poll() is None, "still draining the 20 s fetches"
    started = time.monotonic()
    assert daemon.stop(signal.SIGQUIT, timeout=30) == 0
    assert time.monotonic() - started < 8
