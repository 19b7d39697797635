"""Dramatiq app for the framework benchmark (same RabbitMQ, same fetch + store as crawld).

    dramatiq dramatiq_app -p N -t 16 -Q QUEUE       # env dramatiq_queue_prefetch=16
    python dramatiq_app.py publish URLS_FILE        # actor.send per URL (not timed)

Dramatiq acks after the actor returns (its only mode); max_retries=0 (no page fails here).
Environment: BENCH_AMQP_URL, BENCH_QUEUE and those of bench_task.py.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dramatiq  # noqa: E402
from dramatiq.brokers.rabbitmq import RabbitmqBroker  # noqa: E402

import bench_task  # noqa: E402

QUEUE = os.environ.get("BENCH_QUEUE", "dramatiqbench")
broker = RabbitmqBroker(url=os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"))
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def fetch_store(task_id: str, url: str) -> None:
    bench_task.fetch_and_store(task_id, url, "dramatiq")


def publish(path: str) -> int:
    from crawld.task import task_id_for
    count = 0
    for line in open(path):
        url = line.strip()
        if url:
            fetch_store.send(task_id_for(url), url)
            count += 1
    broker.close()
    print(f'{{"count": {count}}}')
    return 0


if __name__ == "__main__":
    sys.exit(publish(sys.argv[2]) if sys.argv[1:2] == ["publish"] else 2)
