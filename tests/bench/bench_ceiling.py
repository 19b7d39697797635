"""Ceilings: what plain clients do on this machine against the same broker and site.

    python tests/bench/bench_ceiling.py [--quick]

* pika consumer that only acks (basic_qos = crawld's prefetch, 16), 1 and 2 processes;
* nats-py pull consumer that only acks (fetch batch 16 = crawld's pull bound), 1 and 2;
* raw HTTP loop: urllib3 PoolManager, 16 threads, against the zero-latency site;
* crawld's Fetcher alone (same loop; SSRF guard, robots cache, flock politeness, deadlines);
* crawld's store alone: has_result + save_body + put_result per task, 16 threads
  (SQLite WAL, synchronous=FULL: one fsync per result, as the worker does).

Consumers connect first and are released together; a rate is the total count over the
span from the first delivery to the last ack of all processes. Each helper is a separate
process (raw_clients.py), so none shares a GIL with the runner.
"""
from __future__ import annotations

import sys
from typing import Any

from benchlib import (PREFETCH, THREADS, Env, Section, Table, amqp_delete, amqp_publish_raw,
                      bench_main, js_delete_stream, js_publish_core, js_stream, raw_client,
                      run_parallel, run_section, url_bodies)

KEY = "ceiling"
COMMAND = "python tests/bench/bench_ceiling.py"


def amqp_consume_ceiling(env: Env, n: int, procs: int, prefetch: int = PREFETCH) -> dict[str, Any]:
    queue = env.name("ceil")
    amqp_publish_raw(env.rabbit.url, queue, url_bodies(f"{env.site}/fast/{queue}/{i}" for i in range(n)))
    try:
        return run_parallel(env, [raw_client("amqp-consume", env.rabbit.url, queue, "--prefetch", prefetch,
                                             "--wait-go", "--expect", n, "--idle", "2", "--max-seconds", 300)
                                  for _ in range(procs)], timeout=330)
    finally:
        amqp_delete(env.rabbit.url, queue)


def nats_pull_ceiling(env: Env, n: int, procs: int, batch: int = PREFETCH) -> dict[str, Any]:
    name = env.name("CEIL")
    url = env.nats.url
    js_stream(url, name, name.lower(), durable="raw")
    try:
        js_publish_core(url, f"{name.lower()}.x",
                        url_bodies(f"{env.site}/fast/{name}/{i}" for i in range(n)))
        return run_parallel(env, [raw_client("nats-pull", url, name, "raw", "--batch", batch, "--wait-go",
                                             "--expect", n, "--idle", "2", "--max-seconds", 300)
                                  for _ in range(procs)], timeout=330)
    finally:
        js_delete_stream(url, name)


def http_ceiling(env: Env, n: int, procs: int, client: str = "urllib3") -> dict[str, Any]:
    prefix = f"{env.site}/fast/{env.name('http')}/"
    per = n // procs
    return run_parallel(env, [raw_client("http-loop", f"{prefix}p{i}-", "--count", per, "--threads", THREADS,
                                         "--client", client, "--wait-go", "--max-seconds", 120)
                              for i in range(procs)], timeout=180)


def store_ceiling(env: Env, n: int, procs: int) -> dict[str, Any]:
    directory = env.scenario_dir("store")
    per = n // procs
    return run_parallel(env, [raw_client("store-loop", directory / "crawld.db", directory / "bodies",
                                         "--count", per, "--threads", THREADS, "--prefix", f"p{i}-",
                                         "--wait-go", "--max-seconds", 120)
                              for i in range(procs)], timeout=180)


def measure(env: Env, quick: bool, section: Section) -> None:
    n = 5000 if quick else 20000
    table = Table(f"Raw-client ceilings, {n:,} messages / requests each (rate = per second, all processes)",
                  ["what", "processes", "count", "seconds", "rate/s"])
    cases = [
        ("amqp", "pika consume+ack, prefetch 16", amqp_consume_ceiling),
        ("nats", "nats-py pull fetch(16)+ack", nats_pull_ceiling),
        ("http", "urllib3 GET loop, 16 threads", http_ceiling),
        ("fetcher", "crawld Fetcher loop, 16 threads",
         lambda env, n, procs: http_ceiling(env, n, procs, client="fetcher")),
        ("store", "crawld store per task, 16 threads", store_ceiling),
    ]
    for procs in (1, 2):
        for key, label, func in cases:
            result = func(env, n, procs)
            table.add(label, procs, result["count"], result["seconds"], result["rate"])
            section.data[f"{key}_{procs}"] = result["rate"]
    section.tables.append(table)
    section.notes.append("The SPEC's reference ceilings on this machine (one run, prefetch 100): "
                         "pika consume+ack 7.4k/s, nats-py pull fetch(100)+ack 10.5k/s.")


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None) -> Section:
    return run_section(KEY, "Ceilings: raw clients, same broker, same prefetch, same site",
                       COMMAND + (" --quick" if quick else ""), lambda s: measure(env, quick, s))


def main(argv: list[str] | None = None) -> int:
    return bench_main(KEY, run, needs=("rabbit", "nats", "site"), argv=argv)


if __name__ == "__main__":
    sys.exit(main())
