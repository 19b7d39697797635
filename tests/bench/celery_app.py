"""Celery 5 app for the framework benchmark (same RabbitMQ, same fetch + store as crawld).

    celery -A celery_app worker -P threads -c 16 --prefetch-multiplier 1 -Q QUEUE ...
    celery -A celery_app worker -P prefork -c CORES --prefetch-multiplier 1 -Q QUEUE ...
    python celery_app.py publish URLS_FILE [--plain]   # apply_async per URL (not timed)

Two tasks: bench.fetch_store (bench_task.py: crawld's Fetcher and store) and
bench.fetch_store_plain (plain_task.py: requests + sqlite3, what a Celery user writes);
``--plain`` publishes the second, after creating its table. acks_late=True and
worker_prefetch_multiplier=1 (prefetch = concurrency: 16 threads, like crawld's
queue.prefetch = workers.threads, or one per prefork child). Environment: BENCH_AMQP_URL,
BENCH_QUEUE and those of bench_task.py (plain_task.py needs only BENCH_DB).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from celery import Celery  # noqa: E402

import bench_task  # noqa: E402

QUEUE = os.environ.get("BENCH_QUEUE", "celerybench")
app = Celery("crawldbench", broker=os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1//"))
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, task_ignore_result=True,
                task_default_queue=QUEUE, task_default_delivery_mode="persistent",
                broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                worker_redirect_stdouts=False, task_serializer="json", accept_content=["json"])


@app.task(name="bench.fetch_store", acks_late=True)
def fetch_store(task_id: str, url: str) -> None:
    bench_task.fetch_and_store(task_id, url, "celery")


@app.task(name="bench.fetch_store_plain", acks_late=True)
def fetch_store_plain(task_id: str, url: str) -> None:
    import plain_task     # here, not at the top: the threads contender must not need requests
    plain_task.fetch_and_store(task_id, url)


def publish(path: str, plain: bool = False) -> int:
    from crawld.task import task_id_for
    task = fetch_store_plain if plain else fetch_store
    if plain:
        import plain_task
        plain_task.create_table(os.environ["BENCH_DB"])
    count = 0
    with app.producer_or_acquire() as producer:
        for line in open(path):
            url = line.strip()
            if url:
                task.apply_async((task_id_for(url), url), queue=QUEUE, producer=producer)
                count += 1
    print(f'{{"count": {count}}}')
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["publish"] or len(sys.argv) < 3:
        sys.exit(2)
    sys.exit(publish(sys.argv[2], plain="--plain" in sys.argv[3:]))
