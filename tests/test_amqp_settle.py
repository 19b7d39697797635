"""AMQP settles on a real RabbitMQ: pool threads queue them, the connection thread sends a
burst's acks as one multiple-ack up to the oldest delivery still in progress; and the shard
balance asks the broker for shard queue depths only when another worker shares the intake."""
from __future__ import annotations

import threading

import pika
import pytest
from harness import make_config, wait_until

from crawld.config import load_config
from crawld.task import new_task
from crawld.transports.amqp import AmqpTransport
from crawld.transports.base import Action, Settlement


@pytest.fixture
def transport(rabbit, tmp_path, queue_name):
    cfg = load_config(str(make_config(
        tmp_path, broker_url=rabbit.url, transport="amqp",
        queue={"name": queue_name, "prefetch": 40, "partition": "none"},
        store={"url": f"sqlite:///{tmp_path}/s.db", "body_dir": str(tmp_path / "bodies")})))
    t = AmqpTransport(cfg, "test:1")
    t.connect()
    yield t
    t.close()


def publish(rabbit, queue: str, n: int) -> list[str]:
    tasks = [new_task(f"http://127.0.0.1:9/settle/{i}") for i in range(n)]
    with rabbit.channel() as ch:
        for task in tasks:
            ch.basic_publish("", queue, task.to_body(), pika.BasicProperties(message_id=task.task_id))
    return [t.task_id for t in tasks]


def settle_from_threads(transport: AmqpTransport, deliveries: list) -> None:
    """Eight pool-like threads settle at once, as a group commit's waiters do."""
    chunks = [deliveries[i::8] for i in range(8)]
    threads = [threading.Thread(target=lambda c=c: [transport.settle(d, Settlement(Action.ACK)) for d in c])
               for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(lambda: (transport.poll(0.02), transport.pending_settlements() == 0)[1], 30,
               what="settlements sent")


def count_acks(transport: AmqpTransport) -> list[tuple[int, bool]]:
    sent: list[tuple[int, bool]] = []
    real = transport._ch.basic_ack

    def basic_ack(delivery_tag: int = 0, multiple: bool = False) -> None:
        sent.append((delivery_tag, multiple))
        real(delivery_tag, multiple=multiple)

    transport._ch.basic_ack = basic_ack
    return sent


def test_a_burst_of_acks_is_one_frame_and_a_slow_delivery_holds_back_nothing(rabbit, transport, queue_name):
    ids = publish(rabbit, queue_name, 30)
    got: list = []
    transport.start_consuming(got.append, lambda: 40)
    wait_until(lambda: (transport.poll(0.05), len(got) == 30)[1], 30, what="30 deliveries")
    sent = count_acks(transport)

    # The first delivery is still in progress: the other 29 are acked one by one (a
    # multiple-ack would take the first one with them).
    settle_from_threads(transport, got[1:])
    assert len(sent) == 29 and not any(multiple for _, multiple in sent)
    # Settling the first: one frame, and everything is acked.
    settle_from_threads(transport, got[:1])
    assert sent[-1] == (got[0].handle[1], False)

    more = publish(rabbit, queue_name, 30)
    wait_until(lambda: (transport.poll(0.05), len(got) == 60)[1], 30, what="30 more deliveries")
    del sent[:]
    settle_from_threads(transport, got[30:])
    # All 30 were queued before the connection thread ran: one frame acks them all.
    assert sent == [(got[-1].handle[1], True)], sent

    # What the broker holds: drop the connection; an unacked message would come back.
    rabbit.ctl("close_all_connections", "test: unacked ones go back to the queue")
    wait_until(lambda: (transport.poll(0.05), not transport.connected)[1], 30, what="loss seen")
    assert rabbit.queue_depth(queue_name) == 0
    assert {d.message_id for d in got} == set(ids + more)


def test_a_slow_first_delivery_is_the_only_one_given_back(rabbit, transport, queue_name):
    ids = publish(rabbit, queue_name, 20)
    got: list = []
    transport.start_consuming(got.append, lambda: 40)
    wait_until(lambda: (transport.poll(0.05), len(got) == 20)[1], 30, what="20 deliveries")
    settle_from_threads(transport, got[1:])
    rabbit.ctl("close_all_connections", "test: the unfinished one goes back")
    wait_until(lambda: (transport.poll(0.05), not transport.connected)[1], 30, what="loss seen")
    wait_until(lambda: rabbit.queue_depth(queue_name) == 1, 10, what="the unacked one requeued")
    with rabbit.channel() as ch:
        _, props, _ = ch.basic_get(queue_name, auto_ack=True)
    assert props.message_id == got[0].message_id == ids[0]


def count_declares(transport: AmqpTransport) -> list[str]:
    asked: list[str] = []
    real = transport._ch.queue_declare

    def queue_declare(queue: str, *args, **kwargs):
        asked.append(queue)
        return real(queue, *args, **kwargs)

    transport._ch.queue_declare = queue_declare
    return asked


def test_a_lone_worker_asks_for_no_shard_queue_depths(rabbit, tmp_path, queue_name):
    """The balance round asks every shard queue's depth only when another worker could take
    a shard: alone, one passive declare of the intake (not one per shard, 1 + 64 by default)."""
    cfg = load_config(str(make_config(
        tmp_path, broker_url=rabbit.url, transport="amqp",
        queue={"name": queue_name, "prefetch": 8, "partition": "host", "shards": 4},
        store={"url": f"sqlite:///{tmp_path}/s.db", "body_dir": str(tmp_path / "bodies")})))
    transport = AmqpTransport(cfg, "test:1")
    transport.connect()
    try:
        transport.start_consuming(lambda d: None, lambda: 8)
        asked = count_declares(transport)
        assert transport._shard_load() == (1, set())
        assert asked == [queue_name]

        shard = transport._shards.queues[2]
        with rabbit.channel() as ch:
            ch.confirm_delivery()   # a quorum queue counts a message once it is committed
            for _ in range(20):     # beyond the shard's window here: some stay ready
                ch.basic_publish("", shard, b"{}")
            wait_until(lambda: rabbit.queue_depth(shard) > 0, 10, what="shard messages ready")
            other = ch.basic_consume(queue_name, lambda *a: None)    # a second worker
            try:
                del asked[:]
                assert transport._shard_load() == (2, {shard})
                assert asked == [queue_name, *transport._shards.queues]
            finally:
                ch.basic_cancel(other)
    finally:
        transport.close()
