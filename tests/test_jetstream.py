"""The JetStream transport on a real nats-server (loopback, one fresh server per test).

Reproduces the reference lab's scenarios (reconnect table, duplicate publish, in-progress,
nak with delay, dead-letter + term, release on close) plus what the lab could not test:
file storage across a SIGKILL of the server, and consumer config drift.

Each test gets its own server: CRAWL is a WorkQueue stream, which allows only one
consumer per subject, so tests cannot share a server with different durable names.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

import nats
import pytest
from harness import NatsServer, free_port, run_async
from structlog.testing import capture_logs
from transport_doubles import CrashingJetStreamTransport

from crawld.config import Config
from crawld.task import Task, new_task, parse_message
from crawld.transports.jetstream.topology import task_subject
from crawld.transports.base import (ATTEMPT_HEADER, ERROR_HEADER, ORIGIN_HEADER, REASON_HEADER,
                                    Action, Delivery, PublishReport, Settlement)
from crawld.transports.jetstream import (DEAD_STREAM, STREAM, JetStreamPublisher, JetStreamTransport,
                                         TopologyError, jetstream_stats)


_transports: list[CrashingJetStreamTransport] = []


@pytest.fixture
def server() -> Any:
    srv = NatsServer()
    srv.start()
    yield srv
    while _transports:   # a failed test must not leave loops and connections behind
        _transports.pop().abort()
    srv.close()


def make_cfg(url: str, **queue: Any) -> Config:
    cfg = Config().replace("broker", transport="jetstream", url=url, reconnect_max_s=1.0)
    return cfg.replace("queue", **{"name": "fetchers", "ack_wait_s": 1.0, "prefetch": 16, **queue})


def make_tasks(*keys: str, source: str = "shop") -> list[Task]:
    return [new_task(f"http://site.test/{key}", source=source, task_id=key) for key in keys]


def publish(cfg: Config, *keys: str) -> None:
    with JetStreamPublisher(cfg) as pub:
        report = pub.publish(make_tasks(*keys))
    assert sorted(report.confirmed) == sorted(keys) and not report.failed


def key(delivery: Delivery) -> str:
    return json.loads(delivery.body)["task_id"]


class Worker:
    """A tiny stand-in for the worker loop: records deliveries and settles on request."""

    def __init__(self, cfg: Config, name: str, slots: int = 16, limit: int = 1 << 30,
                 hook: Callable[["Worker", Delivery], None] | None = None) -> None:
        self.name = name
        self.slots = slots
        self.limit = limit      # takes no more than this many deliveries in total
        self.hook = hook
        self.t = CrashingJetStreamTransport(cfg, worker_id=name)
        _transports.append(self.t)
        self.got: list[Delivery] = []
        self.open: dict[int, Delivery] = {}
        self.settled: list[tuple[str, Action]] = []
        self.lock = threading.Lock()

    def start(self) -> "Worker":
        self.t.connect()
        self.t.start_consuming(self._on_delivery, self.free_slots)
        return self

    def free_slots(self) -> int:
        return max(0, min(self.slots - len(self.open), self.limit - len(self.got)))

    def _on_delivery(self, delivery: Delivery) -> None:   # on the I/O thread, inside poll()
        with self.lock:
            self.got.append(delivery)
            self.open[id(delivery)] = delivery
        if self.hook:
            self.hook(self, delivery)

    def settle(self, delivery: Delivery, action: Action, **kw: Any) -> None:   # any thread
        with self.lock:
            self.open.pop(id(delivery), None)
            self.settled.append((key(delivery), action))
        self.t.settle(delivery, Settlement(action, **kw))

    def poll_until(self, cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> float:
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"{self.name}: timed out waiting for {what or cond}")
            self.t.poll(0.05)
        return time.monotonic() - t0

    def poll_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.t.poll(0.05)

    def settled_all(self) -> bool:
        return not self.open and self.t.pending_settlements() == 0

    def keys(self) -> list[str]:
        return [key(d) for d in self.got]


def ack_in_thread(delay: float) -> Callable[[Worker, Delivery], None]:
    """A handler that 'fetches' for ``delay`` seconds on another thread, then acks."""
    def hook(worker: Worker, delivery: Delivery) -> None:
        def run() -> None:
            time.sleep(delay)
            worker.settle(delivery, Action.ACK)
        threading.Thread(target=run, daemon=True).start()
    return hook


async def _with_js(url: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
    """``call(js)`` on a connection of its own, closed afterwards."""
    nc = await nats.connect(url)
    try:
        return await call(nc.jetstream())
    finally:
        await nc.close()


async def _get_msg(url: str, stream: str, seq: int) -> Any:
    return await _with_js(url, lambda js: js.get_msg(stream, seq))


async def _delete_stream(url: str, stream: str) -> None:
    await _with_js(url, lambda js: js.delete_stream(stream))


# -- the lab's reconnect table ---------------------------------------------------------
def test_reconnect_table(server: NatsServer, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_cfg(server.url, ack_wait_s=1.0)
    publish(cfg, "p1", "p2", "p3", "p4", "p5")
    last: dict[str, tuple[int, str, int, str]] = {}

    w1 = Worker(cfg, "worker 1", limit=3).start()
    w1.poll_until(lambda: len(w1.got) == 3, what="3 deliveries")
    assert w1.keys() == ["p1", "p2", "p3"]
    w1.settle(w1.got[0], Action.ACK)
    w1.poll_until(lambda: w1.t.pending_settlements() == 0)
    for d in w1.got:
        last[key(d)] = (d.stream_seq or 0, w1.name, d.attempt, "ack" if key(d) == "p1" else "none")
    before = jetstream_stats(cfg)
    assert (before["num_ack_pending"], before["num_pending"], before["num_redelivered"]) == (2, 2, 0)

    w1.t.abort()                      # worker 1 disconnects without answering p2, p3
    time.sleep(cfg.queue.ack_wait_s + 0.2)
    after = jetstream_stats(cfg)
    assert after["delivered_consumer_seq"] == 3 and after["delivered_stream_seq"] == 3

    w2 = Worker(cfg, "worker 2", slots=10).start()
    w2.poll_until(lambda: len(w2.got) == 4, what="the remaining 4")
    for d in w2.got:
        w2.settle(d, Action.ACK)
        last[key(d)] = (d.stream_seq or 0, w2.name, d.attempt, "ack")
    w2.poll_until(w2.settled_all)
    w2.poll_until(lambda: jetstream_stats(cfg)["messages"] == 0, what="empty stream")
    w2.t.close()

    assert sorted((key(d), d.attempt, d.redelivered) for d in w2.got) == [
        ("p2", 2, True), ("p3", 2, True), ("p4", 1, False), ("p5", 1, False)]
    final = jetstream_stats(cfg)
    assert final["num_ack_pending"] == 0 and final["num_pending"] == 0
    with capsys.disabled():
        print(f"\nbefore disconnect: ack_pending={before['num_ack_pending']} "
              f"pending={before['num_pending']} redelivered={before['num_redelivered']}")
        print(f"after ack_wait:    ack_pending={after['num_ack_pending']} pending={after['num_pending']} "
              f"redelivered={after['num_redelivered']} delivered={after['delivered_consumer_seq']}")
        print(f"{'key':<5}{'stream seq':>11}  {'worker':<10}{'num_delivered':>14}  outcome")
        for item, (seq, worker, attempt, outcome) in sorted(last.items()):
            print(f"{item:<5}{seq:>11}  {worker:<10}{attempt:>14}  {outcome}")


# -- publishing ---------------------------------------------------------------------------
def test_republish_same_id_is_a_duplicate(server: NatsServer) -> None:
    cfg = make_cfg(server.url)
    calls: list[tuple[int, int]] = []
    with JetStreamPublisher(cfg) as pub:
        first = pub.publish(make_tasks("p1", "p2"), progress=lambda d, t: calls.append((d, t)))
        assert sorted(first.confirmed) == ["p1", "p2"] and pub.duplicates == 0
        again = pub.publish(make_tasks("p1"))
        assert again.confirmed == ["p1"] and not again.failed and pub.duplicates == 1
        assert jetstream_stats(cfg)["messages"] == 2
        replay = pub.publish(make_tasks("p1"), attempt_reset=True)   # DLQ replay: a new message
        assert replay.confirmed == ["p1"] and pub.duplicates == 0
    assert calls[-1] == (2, 2)
    assert jetstream_stats(cfg)["messages"] == 3


def test_pub_ack_answers_as_nats_server_writes_them() -> None:
    """The PubAck bodies nats-server 2.x sends (captured from it): the plain answer takes
    the fast path, a duplicate (written with a space) and an error the JSON one."""
    from nats.aio.msg import Msg

    from crawld.transports.jetstream.publisher import pub_ack_outcome

    def answer(data: bytes, headers: dict | None = None):
        return pub_ack_outcome(Msg(None, subject="_INBOX.x.1", data=data, headers=headers), "crawl.url.x")
    assert answer(b'{"stream":"CRAWL","seq":12}') == (None, False)
    assert answer(b'{"stream":"CRAWL","seq":12,"duplicate": true}') == (None, True)
    assert answer(b'{"stream":"CRAWL","seq":12,"duplicate":false}') == (None, False)
    error, duplicate = answer(b'{"error":{"code":400,"err_code":10060,"description":"expected stream '
                              b'does not match"},"stream":"T","seq":0}')
    assert error == "rejected: expected stream does not match (err_code 10060)" and not duplicate
    assert answer(b"", {"Status": "503"}) == ("no stream for subject crawl.url.x", False)


def test_publish_failures_are_reported(server: NatsServer) -> None:
    cfg = make_cfg(server.url)
    with JetStreamPublisher(cfg) as pub:
        assert pub.publish(make_tasks("a")).confirmed == ["a"]
        run_async(_delete_stream(server.url, STREAM))
        report = pub.publish(make_tasks("b"))
    assert report.confirmed == [] and "no stream" in report.failed["b"]
    down = make_cfg(f"nats://127.0.0.1:{free_port()}")
    with JetStreamPublisher(down) as pub:
        report = pub.publish(make_tasks("c"))
    assert report.failed["c"].startswith("connect failed")


def test_publish_window_confirms_thousands_and_reports_silence(server: NatsServer) -> None:
    """PubAcks come back on one inbox: 3,000 tasks through a window of 50 are all confirmed
    (and in the stream), with progress to the end. A subject that something other than a
    stream listens on answers nothing: the window gives up after its timeout and reports
    every task failed, none confirmed, nothing hangs."""
    cfg = make_cfg(server.url)
    keys = [f"w{i:04d}" for i in range(3000)]
    calls: list[tuple[int, int]] = []
    with JetStreamPublisher(cfg, window=50) as pub:
        report = pub.publish(make_tasks(*keys), progress=lambda d, t: calls.append((d, t)))
    assert sorted(report.confirmed) == keys and not report.failed
    assert calls[-1] == (3000, 3000) and jetstream_stats(cfg)["messages"] == 3000

    run_async(_delete_stream(server.url, STREAM))
    silent = make_tasks(*[f"s{i:02d}" for i in range(25)])

    def publish_silent() -> PublishReport:
        with JetStreamPublisher(cfg, window=10, timeout_s=0.5, declare=False) as pub:
            return pub.publish(silent)

    async def swallow() -> PublishReport:     # a core subscriber: the server sees a responder
        nc = await nats.connect(server.url)
        await nc.subscribe(task_subject(cfg, silent[0]))
        await nc.flush()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, publish_silent)
        finally:
            await nc.close()

    report = run_async(swallow())
    assert report.confirmed == [] and sorted(report.failed) == sorted(t.task_id for t in silent)
    reasons = Counter(reason.split(":")[0] for reason in report.failed.values())
    assert reasons == {"no PubAck within 0.5s": 10, "not sent": 15}, reasons


async def _add_work_stream(cfg: Config, **changes: Any) -> None:
    """The work stream as crawld declares it, with ``changes`` (e.g. as an older crawld made it)."""
    from dataclasses import replace

    from crawld.transports.jetstream.topology import work_stream_config
    await _with_js(cfg.broker.url, lambda js: js.add_stream(replace(work_stream_config(cfg), **changes)))


async def _allows_fast_batches(url: str) -> bool:
    info = await _with_js(url, lambda js: js.stream_info(STREAM))
    return bool(info.config.allow_batched)


def test_a_large_publish_is_one_fast_batch_with_a_flow_ack_per_window(server: NatsServer) -> None:
    """3,000 tasks with window 100: confirmed by a few dozen flow acks (31 here; the bound
    leaves the server room to ack more often under load), not 3,000 PubAcks, and all in the
    stream. Published again with 500 new ones behind them, the server's
    Nats-Msg-Id check drops the 3,000 it has: everything confirmed, 3,500 messages."""
    cfg = make_cfg(server.url)
    keys = [f"f{i:04d}" for i in range(3000)]
    calls: list[tuple[int, int]] = []
    with JetStreamPublisher(cfg, window=100) as pub:
        report = pub.publish(make_tasks(*keys), progress=lambda d, t: calls.append((d, t)))
        assert sorted(report.confirmed) == keys and not report.failed
        assert pub.acks_heard <= 3000 // 10 and pub.duplicates is None, pub.acks_heard
        assert calls[-1] == (3000, 3000) and [d for d, _ in calls] == sorted(d for d, _ in calls)
        more = keys + [f"g{i:03d}" for i in range(500)]
        again = pub.publish(make_tasks(*more))
        assert sorted(again.confirmed) == sorted(more) and not again.failed
        assert pub.acks_heard <= 3500 // 10, pub.acks_heard
    assert jetstream_stats(cfg)["messages"] == 3500
    assert run_async(_allows_fast_batches(server.url))


def test_a_stream_without_fast_batches_gets_a_pub_ack_per_task_until_declared(server: NatsServer) -> None:
    """A work stream made without allow_batched (an older crawld) refuses the batch's first
    message: the publisher sends all 300 with a PubAck each, that first one included. A
    publisher that declares the topology turns fast batches on in place, queue kept."""
    cfg = make_cfg(server.url)
    run_async(_add_work_stream(cfg, allow_batched=False))
    keys = [f"o{i:03d}" for i in range(300)]
    with JetStreamPublisher(cfg, declare=False) as pub:
        report = pub.publish(make_tasks(*keys))
        assert sorted(report.confirmed) == keys and not report.failed
        assert pub.acks_heard == 1 + 300 and pub.duplicates == 0
    assert jetstream_stats(cfg)["messages"] == 300 and not run_async(_allows_fast_batches(server.url))
    newer = [f"n{i:03d}" for i in range(300)]
    with JetStreamPublisher(cfg) as pub:
        report = pub.publish(make_tasks(*newer))
        assert sorted(report.confirmed) == newer and pub.acks_heard <= 300 // 10, pub.acks_heard
    assert jetstream_stats(cfg)["messages"] == 600 and run_async(_allows_fast_batches(server.url))


def test_a_full_stream_ends_the_fast_batch_and_every_task_is_confirmed_or_failed(
        server: NatsServer) -> None:
    """The stream takes 250 messages (discard new): the batch stops at the refusal. Every
    confirmed task is among the 250 stored, the rest are reported failed with the server's
    reason (the outbox keeps them), none both, none missing."""
    cfg = make_cfg(server.url)
    run_async(_add_work_stream(cfg, max_msgs=250))
    keys = [f"m{i:04d}" for i in range(1000)]
    with JetStreamPublisher(cfg, window=50, declare=False) as pub:
        report = pub.publish(make_tasks(*keys))
    confirmed, failed = set(report.confirmed), set(report.failed)
    assert not confirmed & failed and confirmed | failed == set(keys)
    assert 200 <= len(confirmed) <= 250 and jetstream_stats(cfg)["messages"] == 250
    assert confirmed == set(keys[:len(confirmed)])        # the batch is stored in order
    assert all("maximum messages" in reason for reason in report.failed.values()
               if not reason.startswith("not sent")), Counter(report.failed.values())


def test_lost_flow_acks_are_asked_again_by_a_ping(server: NatsServer) -> None:
    """Every flow ack the server sends on its own is lost (dropped here, on arrival): only
    the answers to pings get through. The batch still ends with all 1,000 tasks confirmed,
    each stall costing a third of the timeout. Without the pings it would stop at the
    first stall and report everything failed."""
    from crawld.transports.jetstream.fastbatch import FastBatch
    from crawld.transports.jetstream.topology import ensure_streams

    class LossyInbox(FastBatch):
        dropped = 0

        async def _on_reply(self, msg: Any) -> None:
            if b'"type":"ack"' in msg.data and b'"seq":0,' not in msg.data \
                    and not msg.subject.endswith(".4.$FI"):
                self.dropped += 1
                return
            await super()._on_reply(msg)

    cfg = make_cfg(server.url)
    tasks = make_tasks(*[f"l{i:04d}" for i in range(1000)])

    async def main() -> tuple[PublishReport, LossyInbox]:
        nc = await nats.connect(server.url)
        try:
            await ensure_streams(nc.jetstream(), cfg)
            report = PublishReport()
            batch = LossyInbox(nc, 100, 0.6, report, None, len(tasks))
            assert await batch.run([(task_subject(cfg, t), t, t.task_id) for t in tasks]) == 1000
            return report, batch
        finally:
            await nc.close()

    report, batch = run_async(main())
    assert not report.failed and sorted(report.confirmed) == sorted(t.task_id for t in tasks)
    assert batch.dropped >= 3 and batch.pings >= 3, (batch.dropped, batch.pings)
    assert jetstream_stats(cfg)["messages"] == 1000


# -- in progress ----------------------------------------------------------------------------
@pytest.mark.parametrize("partition", ["none", "host"])
def test_long_fetch_is_kept_alive_by_in_progress(server: NatsServer, partition: str) -> None:
    cfg = make_cfg(server.url, ack_wait_s=1.0, partition=partition)
    publish(cfg, "slow")
    w = Worker(cfg, "w", hook=ack_in_thread(3.0)).start()
    w.poll_until(lambda: len(w.got) == 1)   # partitioned: once this worker holds the shard
    samples = []
    t0 = time.monotonic()
    while not w.settled_all():
        w.poll_for(0.5)
        stats = jetstream_stats(cfg)        # partitioned: intake and shard durables summed
        samples.append((stats["num_redelivered"], stats["delivered_consumer_seq"]))
        assert time.monotonic() - t0 < 10
    assert time.monotonic() - t0 >= 2.8     # the 3 s fetch started just before t0
    w.poll_for(1.5)   # well past ack_wait after the ack: nothing comes back
    w.t.close()
    assert len(w.got) == 1 and w.got[0].attempt == 1
    assert len(samples) >= 4 and all(s == (0, 1) for s in samples), samples
    final = jetstream_stats(cfg)
    assert (final["messages"], final["num_redelivered"], final["delivered_consumer_seq"]) == (0, 0, 1)


# -- settlements ------------------------------------------------------------------------------
def test_retry_naks_with_delay(server: NatsServer) -> None:
    cfg = make_cfg(server.url, ack_wait_s=10.0)
    publish(cfg, "flaky")
    w = Worker(cfg, "w").start()
    w.poll_until(lambda: len(w.got) == 1)
    t0 = time.monotonic()
    w.settle(w.got[0], Action.RETRY, delay_s=1.0, reason="http_5xx")
    w.poll_until(lambda: len(w.got) == 2, timeout=5)
    elapsed = time.monotonic() - t0
    second = w.got[1]
    assert elapsed >= 0.9, elapsed
    assert (second.attempt, second.redelivered, second.stream_seq) == (2, True, w.got[0].stream_seq)
    w.settle(second, Action.ACK)
    w.poll_until(w.settled_all)
    w.t.close()
    assert jetstream_stats(cfg)["messages"] == 0


def test_dead_publishes_to_dead_stream_then_terms(server: NatsServer) -> None:
    cfg = make_cfg(server.url)
    publish(cfg, "bad")
    w = Worker(cfg, "w").start()
    w.poll_until(lambda: len(w.got) == 1)
    d = w.got[0]
    task = parse_message(d.body, d.message_id)
    w.settle(d, Action.DEAD, reason="retries_exhausted", error="HTTP 503\nService Unavailable", task=task)
    w.poll_until(w.settled_all)
    w.poll_for(1.5)   # past ack_wait: a terminated message never comes back
    w.t.close()
    stats = jetstream_stats(cfg)
    assert (stats["messages"], stats["dead_messages"], len(w.got)) == (0, 1, 1)
    dead = run_async(_get_msg(server.url, DEAD_STREAM, 1))
    assert dead.subject == "crawl.dead.shop" and dead.data == d.body
    assert dead.headers["Nats-Msg-Id"] == "bad:dead:1"
    assert dead.headers[ATTEMPT_HEADER] == "1"
    assert dead.headers[ERROR_HEADER] == "HTTP 503 Service Unavailable"
    assert dead.headers[REASON_HEADER] == "retries_exhausted"
    # Where it was delivered from: its shard subject (the work subject when unpartitioned).
    assert dead.headers[ORIGIN_HEADER] == task_subject(cfg, task) == d.origin


def test_dead_publish_failure_keeps_the_message(server: NatsServer) -> None:
    cfg = make_cfg(server.url)
    publish(cfg, "bad")
    w = Worker(cfg, "w").start()
    w.poll_until(lambda: len(w.got) == 1)
    run_async(_delete_stream(server.url, DEAD_STREAM))
    with capture_logs() as logs:
        w.settle(w.got[0], Action.DEAD, reason="malformed", error="boom")
        w.poll_until(w.settled_all)
    w.t.close()
    assert any(e["event"] == "dead_letter_failed" for e in logs)
    assert jetstream_stats(cfg)["messages"] == 1     # not terminated: nothing lost


def test_skip_terms(server: NatsServer) -> None:
    cfg = make_cfg(server.url)
    publish(cfg, "robots")
    w = Worker(cfg, "w").start()
    w.poll_until(lambda: len(w.got) == 1)
    w.settle(w.got[0], Action.SKIP, reason="robots_disallowed")
    w.poll_until(w.settled_all)
    w.poll_for(1.3)
    w.t.close()
    assert len(w.got) == 1 and jetstream_stats(cfg)["messages"] == 0


def test_close_releases_unsettled_at_once(server: NatsServer) -> None:
    cfg = make_cfg(server.url, ack_wait_s=30.0)   # long: a redelivery here can only be a nak
    publish(cfg, "a", "b", "c")
    w1 = Worker(cfg, "w1", slots=2).start()
    w1.poll_until(lambda: len(w1.got) == 2)
    w1.t.stop_consuming()
    t0 = time.monotonic()
    w1.t.close()
    w2 = Worker(cfg, "w2").start()
    w2.poll_until(lambda: len(w2.got) == 3, timeout=5, what="released deliveries")
    assert time.monotonic() - t0 < 5
    attempts = {key(d): d.attempt for d in w2.got}
    assert attempts == {"a": 2, "b": 2, "c": 1}
    # an explicit RELEASE (drain: never started) also comes back at once
    released = w2.got[0]
    w2.settle(released, Action.RELEASE)
    w2.poll_until(lambda: len(w2.got) == 4, timeout=3)
    assert key(w2.got[3]) == key(released) and w2.got[3].attempt == attempts[key(released)] + 1
    for d in w2.got[1:]:
        w2.settle(d, Action.ACK)
    w2.poll_until(w2.settled_all)
    w2.t.close()
    assert jetstream_stats(cfg)["messages"] == 0


def test_close_forgives_what_was_pulled_but_never_handed_out(server: NatsServer) -> None:
    """Messages a pull brought after the worker's slots were gone wait in the backlog; the
    server counted them as delivered, so giving them back must forgive them, or each close
    or shard hand-over they wait through would cost them an attempt (and, at max_deliver,
    the task)."""
    cfg = make_cfg(server.url, ack_wait_s=30.0, partition="none")   # one pull, sized by the slots
    publish(cfg, "a", "b", "c")
    w1 = Worker(cfg, "w1")
    sizes = iter([3])           # the pull is sized for 3, then the slots are gone (paused)
    w1.free_slots = lambda: next(sizes, 0)      # type: ignore[method-assign]
    forgiven: list[Delivery] = []
    w1.t.set_giveback_listener(forgiven.extend)
    w1.start()
    w1.poll_until(lambda: len(w1.t._backlog) == 3, what="three messages in the backlog")
    assert w1.got == [] and forgiven == []
    w1.t.stop_consuming()
    w1.t.close()
    assert sorted(key(d) for d in forgiven) == ["a", "b", "c"]
    w2 = Worker(cfg, "w2").start()
    w2.poll_until(lambda: len(w2.got) == 3, timeout=5, what="released backlog")
    assert {key(d): d.attempt for d in w2.got} == {"a": 2, "b": 2, "c": 2}, "given back at once"
    for d in w2.got:
        w2.settle(d, Action.ACK)
    w2.poll_until(w2.settled_all)
    w2.t.close()


def test_worker_style_drain_leaves_nothing_waiting_on_ack_wait(server: NatsServer) -> None:
    """The lead's loop: pool threads settle; stop, finish in-flight, close. What was
    prefetched but never started is naked by close(), not left to AckWait."""
    cfg = make_cfg(server.url, ack_wait_s=30.0, prefetch=4)
    publish(cfg, *[f"t{i:02d}" for i in range(20)])
    pool = ThreadPoolExecutor(2)
    t = CrashingJetStreamTransport(cfg, worker_id="host:1")
    _transports.append(t)
    inflight: set[int] = set()
    done: list[str] = []

    def fetch(delivery: Delivery) -> None:
        time.sleep(0.2)
        done.append(key(delivery))
        t.settle(delivery, Settlement(Action.ACK))
        inflight.discard(id(delivery))

    def on_delivery(delivery: Delivery) -> None:
        inflight.add(id(delivery))
        pool.submit(fetch, delivery)

    t.connect()
    t.start_consuming(on_delivery, lambda: 4 - len(inflight))
    deadline = time.monotonic() + 10
    while len(done) < 5 and time.monotonic() < deadline:
        t.poll(0.05)
    t.stop_consuming()
    # Queued but never started: never settled. Running ones finish; their settles only
    # queue work on the loop, so blocking here without polling is fine.
    pool.shutdown(wait=True, cancel_futures=True)
    while t.pending_settlements():
        t.poll(0.05)
    t.close()
    left = 20 - len(done)
    stats = jetstream_stats(cfg)
    # Naked messages count as ack-pending on the server until they are redelivered, so the
    # proof is the next worker getting every one of them at once (AckWait is 30 s here).
    assert stats["messages"] == left and stats["num_ack_pending"] + stats["num_pending"] == left
    nxt = Worker(cfg, "next", hook=lambda w, d: w.settle(d, Action.ACK)).start()
    nxt.poll_until(lambda: len(nxt.got) == left, timeout=3, what="the released tasks")
    nxt.poll_until(nxt.settled_all)
    assert not set(done) & set(nxt.keys())
    assert jetstream_stats(cfg)["messages"] == 0


def test_settle_after_close_is_dropped(server: NatsServer) -> None:
    cfg = make_cfg(server.url)
    publish(cfg, "x")
    w = Worker(cfg, "w").start()
    w.poll_until(lambda: len(w.got) == 1)
    w.t.close()
    with capture_logs() as logs:
        w.settle(w.got[0], Action.ACK)
    assert w.t.pending_settlements() == 0
    assert [e["event"] for e in logs] == ["settle_dropped"]


# -- server crash -----------------------------------------------------------------------------
def test_server_sigkill_and_restart_loses_nothing(server: NatsServer) -> None:
    cfg = make_cfg(server.url, ack_wait_s=2.0)
    keys = [f"k{i:02d}" for i in range(30)]
    publish(cfg, *keys)
    w = Worker(cfg, "w", slots=4, hook=ack_in_thread(0.1)).start()
    w.poll_until(lambda: len({k for k, _ in w.settled}) >= 10, what="10 acks")
    server.kill()
    # Only the main thread runs the loop, and it is here: nothing more reaches the server.
    seen_before_kill = set(w.keys())
    answered = set(w.t.answered)
    confirmed_before_kill = {key(d) for d in w.got if d.stream_seq in answered}
    in_flight = len(w.got) - len(answered)     # delivered, and the server never answered
    assert 10 <= len(seen_before_kill) < len(keys) and len(seen_before_kill) == len(w.got)
    assert len(confirmed_before_kill) >= 5
    w.poll_for(0.7)                      # keeps polling while the server is gone
    server.start()
    w.poll_until(lambda: w.t.reconnects >= 1, timeout=15, what="reconnect")
    publish(cfg, "after1", "after2")
    want = set(keys) | {"after1", "after2"}
    w.poll_until(lambda: {k for k, _ in w.settled} >= want, timeout=20, what="every task acked")
    w.poll_until(lambda: w.settled_all() and jetstream_stats(cfg)["messages"] == 0, timeout=10,
                 what="empty stream")
    w.t.close()
    deliveries = Counter(w.keys())
    duplicated = {k for k, n in deliveries.items() if n > 1}
    duplicates = len(w.got) - len(want)
    print(f"deliveries={len(w.got)} distinct={len(want)} duplicates={duplicates} "
          f"in flight at the kill={in_flight} confirmed={len(confirmed_before_kill)}")
    assert set(deliveries) == want, "every task delivered, nothing else"
    assert {k for k, a in w.settled if a is Action.ACK} == want
    # An ack the server confirmed is never undone; the crash may repeat only what it
    # interrupted, each at most once more: deliveries the server had not answered for, and
    # those it had sent (and counted) but died before they arrived, at most one pull window.
    assert not duplicated & confirmed_before_kill and max(deliveries.values()) <= 2
    assert duplicates <= in_flight + w.slots and in_flight <= w.slots * 2


# -- topology --------------------------------------------------------------------------------
def test_consumer_drift_is_reported_not_replaced(server: NatsServer) -> None:
    first = make_cfg(server.url, ack_wait_s=1.0)
    t = JetStreamTransport(first, worker_id="a")
    t.connect()
    t.close()
    drifted = make_cfg(server.url, ack_wait_s=2.5)
    publish(drifted, "d1")
    with capture_logs() as logs:
        w = Worker(drifted, "b").start()
    events = [e for e in logs if e["event"] == "jetstream_consumer_drift"]
    assert len(events) == 1 and events[0]["log_level"] == "warning"
    assert events[0]["diffs"] == {"ack_wait": {"have": 1.0, "want": 2.5}}
    assert w.t.drift == events[0]["diffs"]
    w.poll_until(lambda: len(w.got) == 1)        # keeps working on the existing consumer
    w.settle(w.got[0], Action.ACK)
    w.poll_until(w.settled_all)
    w.t.close()
    assert jetstream_stats(drifted)["ack_wait_s"] == 1.0


def test_second_durable_on_work_queue_is_a_clear_error(server: NatsServer) -> None:
    t = JetStreamTransport(make_cfg(server.url, name="fetchers"), worker_id="a")
    t.connect()
    t.close()
    other = JetStreamTransport(make_cfg(server.url, name="renamed"), worker_id="b")
    with pytest.raises(TopologyError, match="fetchers"):
        other.connect()
    other.close()


def test_connect_gives_up_when_told_to_stop() -> None:
    cfg = make_cfg(f"nats://127.0.0.1:{free_port()}")
    t = JetStreamTransport(cfg, worker_id="w")
    t0 = time.monotonic()
    t.set_stop_check(lambda: time.monotonic() - t0 > 1.0)
    with capture_logs() as logs:
        t.connect()
    assert time.monotonic() - t0 < 5 and not t.connected
    assert any(e["event"] == "broker_connect_failed" for e in logs)
    t.close()


def test_stats(server: NatsServer) -> None:
    cfg = make_cfg(server.url)
    empty = jetstream_stats(cfg)
    assert empty["stream_exists"] is False and empty["consumer_exists"] is False
    publish(cfg, "s1", "s2")
    time.sleep(0.2)
    stats = jetstream_stats(cfg)
    assert stats["messages"] == 2 and stats["dead_messages"] == 0
    assert stats["depth"] == 2 and stats["consumers"] == 0
    assert stats["oldest_waiting_s"] is not None and stats["oldest_waiting_s"] >= 0.1
    with pytest.raises(ConnectionError):
        jetstream_stats(make_cfg(f"nats://127.0.0.1:{free_port()}"))


# -- pulls take what is already queued at once -------------------------------------------------
def test_queued_messages_are_taken_without_nats_py_wait(server: NatsServer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """take_queued_at_once: what sits in a subscription's queue comes back in order with
    nats-py's bookkeeping, and never through its per-message Task (which draws a uuid4);
    an empty queue or a closed connection still goes through nats-py's own next_msg."""
    import nats.aio.subscription as nats_sub
    import nats.errors
    from crawld.transports.jetstream.pulls import take_queued_at_once

    async def scenario() -> None:
        nc = await nats.connect(server.url)
        try:
            sub = await nc.subscribe("lean.test")
            take_queued_at_once(sub)
            for i in range(3):
                await nc.publish("lean.test", f"m{i}".encode())
            await nc.flush()
            deadline = time.monotonic() + 5
            while sub.pending_msgs < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert sub.pending_msgs == 3 and sub.pending_bytes == 6

            def no_task_please() -> None:
                raise AssertionError("nats-py's waiting next_msg ran for a queued message")
            monkeypatch.setattr(nats_sub, "uuid4", no_task_please)
            got = [(await sub.next_msg(timeout=1)).data for _ in range(3)]
            assert got == [b"m0", b"m1", b"m2"]
            assert sub.pending_msgs == 0 and sub.pending_bytes == 0
            monkeypatch.undo()

            with pytest.raises(nats.errors.TimeoutError):     # empty: nats-py waits and times out
                await sub.next_msg(timeout=0.1)
            await nc.publish("lean.test", b"late")
            assert (await sub.next_msg(timeout=2)).data == b"late"   # arrives while it waits
            await nc.publish("lean.test", b"left")     # queued, but the connection closes
            await nc.flush()
            while sub.pending_msgs < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert sub.pending_msgs == 1
        finally:
            await nc.close()
        with pytest.raises(nats.errors.ConnectionClosedError):
            await sub.next_msg(timeout=0.1)

    run_async(scenario())
