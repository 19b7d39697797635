"""Memory: worker and supervisor RSS with 1k, 100k and 1M tasks waiting in the queue.

    python tests/bench/bench_memory.py [--quick]          # --quick skips the 1M backlog

For each backlog size a fresh queue is filled by plain pika publishers (no confirms,
transient messages, ``{"url": ...}`` bodies, two processes in parallel), then
``crawld run --workers 1`` is started on it with a fresh store. The worker holds at most
prefetch (16) deliveries whatever the backlog, so its RSS should not depend on the
backlog. RSS (VmRSS, and the peak VmHWM) of the worker and of the supervisor is read
from /proc after the worker has stored the same number of results in every case
(900, under the smallest backlog), and again after 5,000 for the larger backlogs.
"""
from __future__ import annotations

import sys
import time

from benchlib import (Env, Ratio, Section, Table, amqp_declare, amqp_delete_setup, bench_main,
                      children_of, crawld_setup, raw_client, rss_kib, run_section,
                      start_crawld, stop_proc, wait_rows, wait_until)

KEY = "memory"
COMMAND = "python tests/bench/bench_memory.py"
SAMPLE_AT = 900
SECOND_SAMPLE_AT = 5000


def fill(env: Env, queue: str, prefix: str, n: int) -> float:
    """Publish n messages with two parallel plain publishers; returns seconds."""
    import subprocess
    amqp_declare(env.rabbit.url, queue)
    started = time.perf_counter()
    parts = 2 if n >= 10000 else 1
    size = n // parts
    procs = [subprocess.Popen(raw_client("amqp-publish", env.rabbit.url, queue, "--count",
                                         size if i < parts - 1 else n - size * (parts - 1),
                                         "--start", i * size, "--url-prefix", prefix, "--transient"),
                              stdout=subprocess.PIPE, text=True) for i in range(parts)]
    env.procs.extend(procs)
    for proc in procs:
        proc.communicate(timeout=900)
        if proc.returncode:
            raise RuntimeError("amqp-publish failed")
    return time.perf_counter() - started


def measure_backlog(env: Env, backlog: int, second: bool) -> dict:
    setup = crawld_setup(env, "mem")
    try:
        fill_s = fill(env, setup.queue, f"{env.site}/fast/{setup.queue}/", backlog)
        started = time.perf_counter()
        sup = start_crawld(env, setup, 1)
        wait_until(lambda: children_of(sup.pid), 30, what="the worker process")
        worker = children_of(sup.pid)[0]
        samples = []
        for at in ([SAMPLE_AT, SECOND_SAMPLE_AT] if second else [SAMPLE_AT]):
            progress = wait_rows(setup.db, at, started, timeout=120, proc=sup)
            if progress.done_t is None:
                raise RuntimeError(f"backlog {backlog}: only {progress.final} results before the timeout")
            samples.append({"at": progress.final, "worker": rss_kib(worker), "supervisor": rss_kib(sup.pid)})
        stop_proc(sup, timeout=60)
        return {"fill_s": fill_s, "samples": samples}
    finally:
        amqp_delete_setup(setup)


def measure(env: Env, quick: bool, section: Section) -> None:
    sizes = [1_000, 100_000] if quick else [1_000, 100_000, 1_000_000]
    table = Table("RSS with a backlog waiting in the queue (crawld run --workers 1, prefetch 16, 16 threads)",
                  ["backlog", "publish s", "results stored", "worker RSS MiB", "worker peak MiB",
                   "supervisor RSS MiB"])
    first_rss: list[float] = []
    for backlog in sizes:
        result = measure_backlog(env, backlog, second=backlog >= 100_000 and not quick)
        for sample in result["samples"]:
            w, s = sample["worker"], sample["supervisor"]
            table.add(backlog, result["fill_s"], sample["at"], w.get("VmRSS", 0) / 1024, w.get("VmHWM", 0) / 1024,
                      s.get("VmRSS", 0) / 1024)
        first_rss.append(result["samples"][0]["worker"].get("VmRSS", 0) / 1024)
        section.data[f"rss_{backlog}"] = first_rss[-1]
    section.tables.append(table)
    spread = max(first_rss) / min(first_rss) if min(first_rss) else None
    section.ratios.append(Ratio(f"worker RSS, largest / smallest across backlogs {', '.join(f'{s:,}' for s in sizes)} "
                                f"(after {SAMPLE_AT} results each)", spread, "<= 1.05x", 1.05,
                                higher_is_better=False))
    section.data["spread"] = spread
    if quick:
        section.notes.append("--quick: the 1M backlog is skipped.")


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None) -> Section:
    return run_section(KEY, "Memory: RSS across backlog sizes", COMMAND + (" --quick" if quick else ""),
                       lambda s: measure(env, quick, s))


def main(argv: list[str] | None = None) -> int:
    return bench_main(KEY, run, needs=("rabbit", "site"), argv=argv)


if __name__ == "__main__":
    sys.exit(main())
