"""Latency-bound efficiency: every page is slow, so throughput is set by concurrency.

    python tests/bench/bench_latency.py [--quick]

Pages ``/slow/<s>/<key>`` answer after ``s`` seconds (asyncio sleep on the site, no thread
held), so the ideal rate is workers x threads / s. Efficiency = steady rate / ideal; it
shows whether crawld keeps all of its threads busy (prefetch refills, ack hand-off,
politeness slots, store waits) when the fetch, not crawld, is the slow part.

Two cases:

* 200 ms pages on one site: config as in bench_e2e.py (threads 16, prefetch 16,
  per_host_concurrency 256), 1 and 2 workers, ``queue.partition = "none"``: under crawld's
  default ``"host"`` the one site is one shard, which one worker serves at a time.
* High concurrency (issue 17): 1 s pages spread over 500 sites (benchsite.py --hosts 500:
  127.0.0.1 .. 127.0.0.250 and 127.0.1.1 .. 127.0.1.250, one port, one site per address),
  ``crawld run --workers 2`` with workers.threads 256 and queue.prefetch 256, published
  round-robin over the sites (page 0 of every site, then page 1, ...), ~20 s of work at
  the ideal 2 x 256 / 1 s = 512 pages/s (~10 s with --quick). Everything else at crawld's
  defaults: ``queue.partition = "host"``, 64 shards, per_host_concurrency 2, no delay
  (only fetch.allow_networks opens loopback). Besides efficiency (target >= 0.9) and the
  rate between 10 % and 90 % of the rows stored (no ramp-up, no tail) it reports each
  worker's peak RSS (VmHWM, and the largest VmRSS sampled every 0.25 s;
  target <= 150 MiB each) and CPU per worker in cores: user+system seconds of that
  worker over the steady window / the window's seconds (target < 1 core per worker).
  Run for AMQP and JetStream (a fresh nats-server, as in bench_e2e.py). The notes print
  the AMQP shard consumers' prefetch window and how the 500 sites spread over the shards.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from benchlib import (THREADS, Env, Ratio, Section, Table, WideSite, bench_main, db_rows,
                      run_section)

KEY = "latency"
COMMAND = "python tests/bench/bench_latency.py"
PAGE_S = 0.2
# One site is one shard under the default partitioning, served by one worker at a time (the
# politeness of issue 13): the 2-worker cases measure keeping 2 x 16 threads busy, so they
# share one queue, as they did before partitioning.
ONE_SITE_QUEUE = {"partition": "none"}
WIDE_SITES = 500
WIDE_PAGE_S = 1.0
WIDE_WORKERS = 2
WIDE_THREADS = 256
WIDE_PREFETCH = 256
RSS_TARGET_MIB = 150.0
CPU_TARGET_CORES = 1.0


def measure(env: Env, quick: bool, section: Section) -> None:
    measure_narrow(env, quick, section)
    measure_wide(env, quick, section)


def measure_narrow(env: Env, quick: bool, section: Section) -> None:
    """200 ms pages on one site, threads 16 (the original case)."""
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
                            timeout=60 + 4 * seconds, queue=ONE_SITE_QUEUE)
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


# -- high concurrency: 1 s pages over 500 sites, 2 x 256 threads --------------------------------
def wide_urls(site: WideSite, key: str, n: int) -> list[str]:
    """Round-robin over the sites, as a crawl frontier hands them out: page 0 of every site,
    then page 1, ... (so every shard and every site has work all along)."""
    return [site.url(i % site.hosts + 1, f"slow/{WIDE_PAGE_S:g}/{key}/{i // site.hosts}") for i in range(n)]


def wide_run(env: Env, transport: str, n: int, timeout: float) -> dict[str, Any]:
    from bench_e2e import crawld_e2e
    from crawld.config import FetchConfig
    site = env.wide_site(WIDE_SITES)
    # crawld_setup opens per_host_concurrency to 256 for its one-site cases; with 500
    # sites crawld's own default is the realistic politeness, so it is restored here.
    return crawld_e2e(env, transport, WIDE_WORKERS, n, tag="latw", timeout=timeout,
                      urls_of=lambda setup: wide_urls(site, setup.queue, n), sample=True,
                      threads=WIDE_THREADS, prefetch=WIDE_PREFETCH,
                      fetch={"per_host_concurrency": FetchConfig().per_host_concurrency})


def mid_rate(db: Path, low: float = 0.1, high: float = 0.9) -> float | None:
    """Rows per second between the 10th and the 90th percentile of fetched_at: the rate
    while the pipeline is full, without the ramp-up and the tail of the last shards."""
    times = [t for (t,) in db_rows(db, "SELECT fetched_at FROM results ORDER BY fetched_at")]
    if len(times) < 10:
        return None
    a, b = int(low * (len(times) - 1)), int(high * (len(times) - 1))
    return (b - a) / (times[b] - times[a]) if times[b] > times[a] else None


def wide_figures(result: dict[str, Any], ideal: float) -> dict[str, Any]:
    """Efficiency, per-worker peak RSS (MiB) and per-worker cores over the steady window."""
    progress, sampler = result["progress"], result["sampler"]
    peaks = sampler.peak_kib()
    cores = sampler.cores_since(progress.first_t or progress.started)
    return {"steady": progress.steady_rate, "wall": progress.wall_rate, "mid": mid_rate(result["setup"].db),
            "efficiency": progress.steady_rate / ideal,
            "steady_s": (progress.done_t - progress.first_t) if progress.first_t else None,
            "hwm_mib": [peaks[p]["VmHWM"] / 1024 for p in sorted(peaks)],
            "rss_mib": [peaks[p]["VmRSS"] / 1024 for p in sorted(peaks)],
            "cores": [cores.get(p, 0.0) for p in sorted(peaks)]}


def measure_wide(env: Env, quick: bool, section: Section) -> None:
    seconds = 10 if quick else 20
    ideal = WIDE_WORKERS * WIDE_THREADS / WIDE_PAGE_S
    n = math.ceil(ideal * seconds / WIDE_SITES) * WIDE_SITES    # whole rounds over the sites
    table = Table(f"Pages that take {WIDE_PAGE_S:g} s on {WIDE_SITES} sites, {WIDE_WORKERS} workers x "
                  f"{WIDE_THREADS} threads, prefetch {WIDE_PREFETCH}, crawld's default partitioning and "
                  f"politeness, ~{seconds} s of work",
                  ["transport", "tasks", "ideal/s", "steady/s", "wall/s", "efficiency (steady)",
                   "steady s", "10-90% rows/s", "worker peak RSS MiB (VmHWM)", "worker max sampled RSS MiB",
                   "worker CPU cores", "CPU cores total", "dead", "attempts > 1"])
    section.tables.append(table)      # before the runs: a failed JetStream run keeps the AMQP row
    for transport in ("amqp", "jetstream"):
        result = wide_run(env, transport, n, timeout=90 + 4 * seconds)
        if result["progress"].done_t is None:
            raise RuntimeError(f"{transport} 500 sites: {result['progress'].final}/{n} stored before the "
                               f"timeout (log: {result['setup'].dir}/run.log)")
        fig = wide_figures(result, ideal)
        table.add(transport, n, ideal, fig["steady"], fig["wall"], fig["efficiency"], fig["steady_s"], fig["mid"],
                  per_worker(fig["hwm_mib"]), per_worker(fig["rss_mib"]), per_worker(fig["cores"]),
                  sum(fig["cores"]), result["dead"], result["redelivered"])
        wide_ratios(section, transport, fig)
        if transport == "amqp":
            section.notes.append(amqp_window_note(result["setup"].config))
    section.notes.append(f"{WIDE_SITES}-site case: 'worker CPU cores' is each worker's user+system CPU "
                         "from the first stored row to the last / those seconds (sampled from /proc "
                         "every 0.25 s); the CPU target is per worker. Peak RSS is the kernel's "
                         "VmHWM of each worker process (the supervisor's children) just before stop. "
                         "'10-90% rows/s' leaves out the ramp-up and the tail.")
    section.notes.append(shard_spread_note())


def amqp_window_note(config: Path) -> str:
    """What the AMQP shard consumers can hold at most, read from crawld's own code."""
    from crawld.config import load_config
    from crawld.transports.amqp.shards import Shards
    cfg = load_config(str(config))
    window = Shards(cfg).prefetch
    cap = cfg.queue.shards * window
    return (f"AMQP, partitioned: each shard consumer's prefetch (transports/amqp/shards.py) is "
            f"{window}, so {cfg.queue.shards} shards hold at most {cap} deliveries fleet-wide, "
            f"{cap / (WIDE_WORKERS * WIDE_THREADS):.2f} of the {WIDE_WORKERS * WIDE_THREADS} threads, "
            f"and one shard runs at most {window} pages at once whatever its number of sites.")


def shard_spread_note() -> str:
    """How unevenly the sites fall into shards (the slowest shard sets the tail)."""
    from benchsite import loopback_host
    from crawld.config import QueueConfig
    from crawld.fleet.partition import partition_key_of_host, shard_of_key
    shards = QueueConfig().shards
    counts = Counter(shard_of_key(partition_key_of_host(loopback_host(k), "host"), shards)
                     for k in range(1, WIDE_SITES + 1))
    return (f"{WIDE_SITES} sites in {shards} shards (partition by host): {min(counts.values())} to "
            f"{max(counts.values())} sites per shard ({WIDE_SITES / shards:.1f} on average, "
            f"{shards - len(counts)} shards empty).")


def per_worker(values: list[float]) -> str:
    """One figure per worker process, in pid order."""
    return " / ".join(f"{v:.0f}" if v >= 10 else f"{v:.2f}" for v in values) or "-"


def wide_ratios(section: Section, transport: str, fig: dict[str, Any]) -> None:
    """Ratio lines and section.data keys for one transport of the 500-site case."""
    worst_rss = max(fig["hwm_mib"], default=None)
    worst_cpu = max(fig["cores"], default=None)
    section.data[f"wide_{transport}_efficiency"] = fig["efficiency"]
    section.data[f"wide_{transport}_rss_mib"] = worst_rss
    section.data[f"wide_{transport}_cpu_cores"] = worst_cpu
    section.ratios += [
        Ratio(f"latency-bound {transport}, 1 s pages on {WIDE_SITES} sites, {WIDE_WORKERS} x {WIDE_THREADS} "
              f"threads: steady / (workers x threads / 1 s) efficiency", fig["efficiency"], ">= 0.9", 0.9),
        Ratio(f"latency-bound {transport}, {WIDE_SITES} sites: largest worker peak RSS (VmHWM)",
              worst_rss, f"<= {RSS_TARGET_MIB:.0f} MiB", RSS_TARGET_MIB, higher_is_better=False, unit="MiB"),
        # Ratio.met allows equality; one core exactly counts as met, close enough for "below".
        Ratio(f"latency-bound {transport}, {WIDE_SITES} sites: busiest worker's CPU over the steady window",
              worst_cpu, f"< {CPU_TARGET_CORES:g} core", CPU_TARGET_CORES, higher_is_better=False,
              unit="cores")]


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None) -> Section:
    return run_section(KEY, "Latency-bound efficiency (200 ms pages; 1 s pages on 500 sites)",
                       COMMAND + (" --quick" if quick else ""),
                       lambda s: measure(env, quick, s))


def main(argv: list[str] | None = None) -> int:
    return bench_main(KEY, run, needs=("rabbit", "site"), argv=argv)


if __name__ == "__main__":
    sys.exit(main())
