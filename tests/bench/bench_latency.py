"""Latency-bound efficiency: every page takes 200 ms, so throughput is set by concurrency.

    python tests/bench/bench_latency.py [--quick]

Pages ``/slow/0.2/<key>`` answer after 200 ms (asyncio sleep on the site, no thread held),
so the ideal rate is workers x threads / 0.2 s. Efficiency = steady rate / ideal; it
shows whether crawld keeps all of its threads busy (prefetch refills, ack hand-off,
politeness slots, store waits) when the fetch, not crawld, is the slow part. Config as
in bench_e2e.py (threads 16, prefetch 16, per_host_concurrency 256).
"""
from __future__ import annotations

import sys

from benchlib import THREADS, Env, Ratio, Section, Table, bench_main, run_section

KEY = "latency"
COMMAND = "python tests/bench/bench_latency.py"
PAGE_S = 0.2


def measure(env: Env, quick: bool, section: Section) -> None:
    from bench_e2e import crawld_e2e
    seconds = 6 if quick else 12
    cases = [("amqp", 2)] if quick else [("amqp", 1), ("amqp", 2), ("jetstream", 2)]
    table = Table(f"Pages that take {PAGE_S * 1000:.0f} ms, {THREADS} threads per worker, ~{seconds} s of work "
                  f"per case", ["transport", "workers", "tasks", "ideal/s", "steady/s", "wall/s",
                                "efficiency (steady)", "efficiency (wall)"])
    for transport, workers in cases:
        ideal = workers * THREADS / PAGE_S
        n = int(ideal * seconds)
        result = crawld_e2e(env, transport, workers, n, tag="lat", page=f"slow/{PAGE_S:g}",
                            timeout=60 + 4 * seconds)
        progress = result["progress"]
        if progress.done_t is None:
            raise RuntimeError(f"{transport} workers={workers}: {progress.final}/{n} stored before the timeout")
        steady, wall = progress.steady_rate, progress.wall_rate
        table.add(transport, workers, n, ideal, steady, wall, steady / ideal, wall / ideal)
        section.data[f"{transport}_{workers}"] = steady / ideal
        section.ratios.append(Ratio(f"latency-bound {transport} {workers} worker(s): steady / "
                                    f"(workers x threads / 0.2 s) efficiency", steady / ideal, ">= 0.9", 0.9))
    section.tables.append(table)
    section.notes.append("Wall efficiency includes interpreter start, imports and broker connect of "
                         "`crawld run` (about 1 s) against a run of a few seconds.")


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None) -> Section:
    return run_section(KEY, "Latency-bound efficiency (200 ms pages)", COMMAND + (" --quick" if quick else ""),
                       lambda s: measure(env, quick, s))


def main(argv: list[str] | None = None) -> int:
    return bench_main(KEY, run, needs=("rabbit", "site"), argv=argv)


if __name__ == "__main__":
    sys.exit(main())
