"""Result events settled with their delivery, on a real RabbitMQ and a real nats-server.

The transport publishes a settlement's event on the delivery's own connection and acks
only after the broker confirmed it. A broker that refuses the event (an AMQP nack, a
JetStream PubAck that never comes) gets the delivery back instead: its redelivery is a
duplicate, no second fetch, that announces the stored row and is acked then.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from harness import NatsServer, wait_until

from crawld.config import Config, FetchConfig, StoreConfig, WorkersConfig
from crawld.fetch import Fetcher
from crawld.pipeline.handler import DeliveryHandler
from crawld.store import open_store
from crawld.task import new_task
from crawld.transports import make_publisher, make_transport
from crawld.transports.base import EVENTS_EXCHANGE, Action, Delivery, Settlement, Transport


def _config(tmp_path: Path, transport: str, url: str) -> Config:
    cfg = Config(workers=WorkersConfig(run_dir=str(tmp_path / "run")),
                 fetch=FetchConfig(timeout_s=10, allow_networks=("127.0.0.0/8",)),
                 store=StoreConfig(url=f"sqlite:///{tmp_path / 'crawld.db'}",
                                   body_dir=str(tmp_path / "bodies")))
    cfg = cfg.replace("broker", transport=transport, url=url)
    return cfg.replace("queue", name=f"ev{uuid.uuid4().hex[:8]}", partition="none")


class Rig:
    """One transport and one handler, driven from the test thread as a worker would."""

    def __init__(self, cfg: Config, tmp_path: Path) -> None:
        self.cfg = cfg
        self.store = open_store(cfg.store)
        self.fetcher = Fetcher(cfg.fetch, pool_size=2, run_dir=str(tmp_path))
        self.handler = DeliveryHandler(cfg, self.store, self.fetcher, worker_id="t:1",
                                       counts_deliveries=cfg.broker.transport == "jetstream")
        self.transport: Transport = make_transport(cfg, "t:1")
        self.deliveries: list[Delivery] = []
        self.outcomes: list[tuple[Action, str]] = []    # what the worker would count
        self.closed = False
        self.transport.set_stop_check(lambda: False)
        self.transport.set_settled_listener(lambda _d, s: self.outcomes.append((s.action, s.reason)))
        self.transport.connect()
        self.transport.start_consuming(self.deliveries.append, lambda: 4 - len(self.deliveries))

    def next_delivery(self, timeout: float = 30) -> Delivery:
        wait_until(lambda: self._poll() and self.deliveries, timeout, what="a delivery")
        return self.deliveries.pop(0)

    def handle_and_settle(self, delivery: Delivery, timeout: float = 40) -> Settlement:
        settlement = self.handler.handle(delivery)
        self.transport.settle(delivery, settlement)
        wait_until(lambda: self._poll() and self.transport.pending_settlements() == 0, timeout,
                   what="the settlement to reach the broker")
        return settlement

    def _poll(self) -> bool:
        self.transport.poll(0.05)
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.transport.stop_consuming()
        self.transport.close()
        self.fetcher.close()
        self.store.close()


@pytest.fixture()
def rig_factory(tmp_path: Path) -> Iterator[Callable[[str, str], Rig]]:
    rigs: list[Rig] = []

    def make(transport: str, url: str) -> Rig:
        rigs.append(Rig(_config(tmp_path, transport, url), tmp_path))
        return rigs[-1]
    yield make
    for rig in rigs:
        rig.close()


def _refused_then_announced(rig: Rig, site: Any, refuse: Callable[[], None],
                            allow: Callable[[], None]) -> str:
    """Store a page while the broker refuses its event, then let it through; returns the
    task id. The first settlement asks for an ack, but the delivery must come back."""
    path = f"/fast/{uuid.uuid4().hex[:8]}"
    task = new_task(site.url(path))
    with make_publisher(rig.cfg) as publisher:
        assert not publisher.publish([task]).failed
    refuse()
    first = rig.handle_and_settle(rig.next_delivery())
    assert first.action is Action.ACK and first.event is not None
    assert rig.store.has_result(task.task_id)
    assert rig.outcomes == [(Action.RELEASE, "event_unconfirmed")]   # not counted as done
    allow()
    again = rig.next_delivery()                  # given back, not acked
    assert again.message_id == task.task_id and again.attempt >= 1
    second = rig.handle_and_settle(again)
    assert (second.action, second.reason) == (Action.ACK, "duplicate")
    assert rig.outcomes[1:] == [(Action.ACK, "duplicate")]
    assert second.event is not None and json.loads(second.event.body)["task_id"] == task.task_id
    assert site.hits(path) == 1                  # the redelivery did not fetch again
    return task.task_id


def test_amqp_nacked_event_gives_the_delivery_back_and_the_duplicate_announces_it(
        rig_factory, rabbit, site):
    rig = rig_factory("amqp", rabbit.url)
    key = uuid.uuid4().hex[:8]
    blocker, collector = f"evblock-{key}", f"evcollect-{key}"

    def refuse() -> None:
        # A full queue that rejects publishes: the broker nacks every event routed to it.
        with rabbit.channel() as ch:
            ch.queue_declare(blocker, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
            ch.queue_bind(blocker, EVENTS_EXCHANGE, routing_key="#")

    def allow() -> None:
        with rabbit.channel() as ch:
            ch.queue_delete(blocker)
            ch.queue_declare(collector)
            ch.queue_bind(collector, EVENTS_EXCHANGE, routing_key="#")

    try:
        task_id = _refused_then_announced(rig, site, refuse, allow)
        assert [json.loads(b)["task_id"] for b in _drain_queue(rabbit, collector)] == [task_id]
        rig.close()
        assert rabbit.queue_depth(rig.cfg.queue.name) == 0    # acked: nothing went back
    finally:
        rabbit.delete_queues(blocker)
        rabbit.delete_queues(collector)
        rabbit.delete_queues(rig.cfg.queue.name)


def test_jetstream_refused_event_gives_the_delivery_back_and_the_duplicate_announces_it(
        rig_factory, tmp_path, site):
    server = NatsServer()
    server.start()
    try:
        rig = rig_factory("jetstream", server.url)
        # A stream on one subject inside crawl.event.> keeps CRAWL_EVENTS from being
        # declared again (overlap): the event has no stream to answer it.
        refuse = lambda: asyncio.run(_swap_events_stream(server.url, blocker=True))  # noqa: E731
        allow = lambda: asyncio.run(_swap_events_stream(server.url, blocker=False))  # noqa: E731
        task_id = _refused_then_announced(rig, site, refuse, allow)
        assert [json.loads(b)["task_id"] for b in asyncio.run(_read_events(server.url))] == [task_id]
    finally:
        server.close()


def test_event_publish_cancelled_underneath_is_resent_or_unconfirmed_never_raised(tmp_path):
    """A broker restart under load once ended an event publish in CancelledError (from
    nats-py, not from us), and the task whose row was stored was dead-lettered as an
    internal error. A cancelled PubAck wait is resent until the deadline, then reported
    unconfirmed like any other lost PubAck."""
    import nats
    from crawld.transports.base import ResultEvent
    from crawld.transports.jetstream.events import events_stream_config, publish_event
    from crawld.transports.jetstream.replies import Replies
    from crawld.transports.jetstream.topology import ensure_stream

    server = NatsServer()
    server.start()
    cfg = _config(tmp_path, "jetstream", server.url)

    async def scenario() -> tuple[str | None, str | None, int]:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_stream(js, events_stream_config(cfg))
        replies = Replies()
        await replies.bind(nc)
        cancels = {"left": 1, "done": 0}

        async def cancelled_underneath(*args: Any) -> Any:
            if cancels["left"] > 0:
                cancels["left"] -= 1
                cancels["done"] += 1
                raise asyncio.CancelledError()
            return await replies.request(*args)
        body = json.dumps({"task_id": "a" * 32, "status": "ok"}).encode()
        first = await publish_event(js, cancelled_underneath, cfg, ResultEvent("a" * 32, "ok", body), 5.0)
        cancels["left"] = 10 ** 6
        second = await publish_event(js, cancelled_underneath, cfg,
                                     ResultEvent("b" * 32, "ok", body.replace(b"a", b"b")), 1.0)
        await nc.close()
        return first, second, cancels["done"]

    try:
        first, second, cancelled = asyncio.run(scenario())
        assert first is None
        assert second is not None and "PubAck" in second
        assert cancelled > 2
        assert [json.loads(b)["task_id"] for b in asyncio.run(_read_events(server.url))] == ["a" * 32]
    finally:
        server.close()


def _drain_queue(rabbit: Any, queue: str) -> list[bytes]:
    bodies = []
    with rabbit.channel() as ch:
        while True:
            method, _props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                return bodies
            bodies.append(body)


async def _swap_events_stream(url: str, blocker: bool) -> None:
    import nats
    from crawld.transports.base import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX
    nc = await nats.connect(url)
    js = nc.jetstream()
    if blocker:
        await js.delete_stream(EVENTS_STREAM)
        # Owns a subject inside the events' wildcard: CRAWL_EVENTS (crawl.event.>) cannot be
        # created again (overlapping subjects), and crawl.event.ok has no stream at all.
        await js.add_stream(name="EVBLOCK", subjects=[EVENTS_SUBJECT_PREFIX + "nothing"])
    else:
        await js.delete_stream("EVBLOCK")
    await nc.close()


async def _read_events(url: str) -> list[bytes]:
    """What a plain nats-py pull consumer reads from CRAWL_EVENTS, from the first event."""
    import nats
    from nats.errors import TimeoutError as NatsTimeout
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe("crawl.event.>", durable=f"r{time.monotonic_ns()}", stream="CRAWL_EVENTS")
        bodies: list[bytes] = []
        while True:
            try:
                msgs = await sub.fetch(50, timeout=1)
            except NatsTimeout:
                return bodies
            for msg in msgs:
                bodies.append(msg.data)
                await msg.ack()
    finally:
        await nc.close()


def test_replies_answer_each_request_time_out_alone_and_fail_when_rebound():
    """The inbox behind every JetStream ack and event PubAck (replies.py), on a real
    nats-server: answers reach their own request, a silent responder times out that
    request only, and binding a new connection fails what waited on the old one."""
    import nats
    import nats.errors
    from crawld.transports.jetstream.replies import Replies

    server = NatsServer()
    server.start()

    async def scenario() -> None:
        nc = await nats.connect(server.url)
        replies = Replies()
        await replies.bind(nc)

        async def echo(msg: Any) -> None:
            await msg.respond(b"pong:" + msg.data)

        async def silent(msg: Any) -> None:
            pass
        await nc.subscribe("svc.echo", cb=echo)
        await nc.subscribe("svc.silent", cb=silent)
        answers = await asyncio.gather(*(replies.request("svc.echo", b"%d" % i, 5.0) for i in range(200)))
        assert [a.data for a in answers] == [b"pong:%d" % i for i in range(200)]
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await replies.request("svc.silent", b"x", 0.3)
        assert 0.25 < time.monotonic() - started < 3.0
        assert (await replies.request("svc.echo", b"after", 5.0)).data == b"pong:after"
        assert not replies._waiting
        waiting = asyncio.ensure_future(replies.request("svc.silent", b"y", 30.0))
        await asyncio.sleep(0.1)
        nc2 = await nats.connect(server.url)
        await replies.bind(nc2)
        with pytest.raises(nats.errors.ConnectionClosedError):
            await waiting
        assert (await replies.request("svc.echo", b"new", 5.0)).data == b"pong:new"
        await nc.close()
        await nc2.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()


@pytest.mark.parametrize("status, task_id, body_size, body_max", [
    ("fetched", "0123456789abcdef0123456789abcdef", 300, 131064),
    ("http_error", "t" * 255, 0, 131064),
    ("skipped", "caf\u00e9-id", 1000, 256),        # a body over several frames
    ("fetched", "x", 512, 256),                    # exactly two full body frames
])
def test_event_frames_are_the_bytes_pika_would_send(status, task_id, body_size, body_max):
    """PublishFrames against pika's own marshalling of the same publish (method frame,
    content header with the five properties, body frames of at most body_max bytes)."""
    import pika
    import pika.frame
    import pika.spec

    from crawld.transports.amqp.events import EVENT_PROPERTIES
    from crawld.transports.amqp.frames import PublishFrames
    body = bytes(i % 251 for i in range(body_size))
    props = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent, message_id=task_id,
                                 content_type="application/json", type="crawl.result", app_id="crawld")
    expected = [pika.frame.Method(5, pika.spec.Basic.Publish(exchange=EVENTS_EXCHANGE, routing_key=status)).marshal(),
                pika.frame.Header(5, len(body), props).marshal()]
    expected += [pika.frame.Body(5, body[i:i + body_max]).marshal() for i in range(0, len(body), body_max)]
    frames = PublishFrames(5, body_max, EVENTS_EXCHANGE, **EVENT_PROPERTIES)
    assert frames.encode(status, task_id, body) == b"".join(expected)
    assert frames.encode(status, task_id, body) == b"".join(expected), "the cached method frame too"
