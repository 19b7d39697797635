"""Retry tiers vs in-place sleep-retry: 50% failing URLs.

    python tests/bench/bench_retry_tiers.py [--quick]

N tasks, half ``/flaky/1/<key>`` (500 on the first hit, 200 after) and half ``/fast/<key>``,
interleaved, put on the work queue by a plain pika publisher ({"url": ...} bodies).

* crawld: ``crawld run --workers 1``, 16 threads, prefetch 16, ``queue.retry_delays_s = [1]``:
  a 500 stores an attempt row, the message goes to ``<queue>.retry.1`` (x-message-ttl 1 s,
  dead-lettered back to the work queue) and the thread takes the next task at once.
* baseline: one process, raw pika + a pool of 16 threads, prefetch 16, the same Fetcher
  and store calls (attempt row, then result row), which on a failure sleeps the 1 s delay
  *in the worker thread* and retries in place (raw_clients.py baseline).

Both are timed from process start until N results are stored; the ratio is crawld's
rate over the baseline's. The reference measured 25.5x for its version of this test.
"""
from __future__ import annotations

import sys
import time

from benchlib import (THREADS, Env, Ratio, Section, Table, amqp_delete, amqp_delete_setup,
                      amqp_publish_raw, bench_main, crawld_setup, db_count, finish_json, go, raw_client,
                      ratio, run_section, start_crawld, start_json, stop_proc, url_bodies,
                      wait_log_event, wait_ready, wait_rows)

KEY = "retry_tiers"
COMMAND = "python tests/bench/bench_retry_tiers.py"
DELAY_S = 1.0


def urls_for(env: Env, key: str, n: int) -> list[str]:
    return [f"{env.site}/flaky/1/{key}/{i}" if i % 2 == 0 else f"{env.site}/fast/{key}/{i}" for i in range(n)]


def crawld_tiers(env: Env, n: int) -> dict:
    setup = crawld_setup(env, "tier", queue={"retry_delays_s": [DELAY_S], "max_deliver": 5})
    try:
        started = time.perf_counter()
        proc = start_crawld(env, setup, 1)
        # Publish once the worker declared the retry tier (it connects within ~1 s): the
        # plain publisher below only declares the work queue. Publishing is not timed.
        if not wait_log_event(setup.dir / "run.log", "broker_connected", 30):
            raise RuntimeError(f"crawld worker did not connect (see {setup.dir}/run.log)")
        publish_s = amqp_publish_raw(env.rabbit.url, setup.queue, url_bodies(urls_for(env, setup.queue, n)))
        progress = wait_rows(setup.db, n, started, timeout=60 + n / 10, proc=proc)
        stop_proc(proc, timeout=60)
        retried = db_count(setup.db, "attempts")
        return {"progress": progress, "retried": retried, "publish_s": publish_s}
    finally:
        amqp_delete_setup(setup)


def baseline(env: Env, n: int) -> dict:
    directory = env.scenario_dir("sleepretry")
    queue = directory.name
    amqp_publish_raw(env.rabbit.url, queue, url_bodies(urls_for(env, queue, n)))
    try:
        started = time.perf_counter()
        proc = start_json(env, raw_client("baseline", env.rabbit.url, queue, directory / "crawld.db",
                                          directory / "bodies", directory / "run", "--expect", n,
                                          "--threads", THREADS, "--sleep-retry", DELAY_S, "--wait-go",
                                          "--max-seconds", 60 + n / 5),
                          log=directory / "baseline.log")
        wait_ready([proc])
        go([proc])
        progress = wait_rows(directory / "crawld.db", n, started, timeout=90 + n / 5, proc=proc)
        result = finish_json(proc, timeout=60)
        return {"progress": progress, "retried": result.get("retries", 0)}
    finally:
        amqp_delete(env.rabbit.url, queue)


def measure(env: Env, quick: bool, section: Section) -> None:
    n = 600 if quick else 2000
    table = Table(f"{n:,} tasks, 50% fail once (HTTP 500) then succeed; retry delay {DELAY_S:g} s; one process, "
                  f"{THREADS} threads", ["consumer", "retried", "wall s", "tasks/s (wall)", "steady/s"])
    tiers = crawld_tiers(env, n)
    base = baseline(env, n)
    for label, result in (("crawld, AMQP retry tier (TTL queue)", tiers),
                          ("baseline, sleep in the worker thread", base)):
        progress = result["progress"]
        if progress.done_t is None:
            raise RuntimeError(f"{label}: {progress.final}/{n} stored before the timeout")
        table.add(label, result["retried"], progress.wall_s, progress.wall_rate, progress.steady_rate)
    section.tables.append(table)
    value = ratio(tiers["progress"].wall_rate, base["progress"].wall_rate)
    section.ratios.append(Ratio("retry tiers / in-place sleep-retry throughput (wall, process start to last row)",
                                value))
    section.data["ratio"] = value
    section.notes.append(f"The baseline's floor is (N/2 failures x {DELAY_S:g} s) / {THREADS} threads of pure "
                         f"sleeping = {n / 2 * DELAY_S / THREADS:.0f} s; crawld's is one tier delay plus "
                         "the processing time. The reference saw 25.5x for its version of this test.")


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None) -> Section:
    return run_section(KEY, "Retry tiers vs in-place sleep-retry (50% failing URLs)",
                       COMMAND + (" --quick" if quick else ""), lambda s: measure(env, quick, s))


def main(argv: list[str] | None = None) -> int:
    return bench_main(KEY, run, needs=("rabbit", "site"), argv=argv)


if __name__ == "__main__":
    sys.exit(main())
