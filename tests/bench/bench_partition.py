"""Partitioned fleet vs one shared queue (issue 13): throughput over 200 sites, and shard handover.

    python tests/bench/bench_partition.py [--quick] [--transports amqp,jetstream] [--rounds 2]
                                          [--handover] [--handover-only]

Throughput: a private nginx serves 200 sites (127.0.0.1 .. 127.0.0.200, one port, so 200
host names for politeness), 20 pages each. ``crawld run --workers 2`` works through the
4,000 tasks (published round-robin over the sites, as a crawl frontier would hand them out)
once with ``queue.partition = "host"`` and once with ``"none"``, alternating host, none,
none, host, ... in the same run; the steady rate (first stored row -> last) of each is
compared: partitioned / none. Politeness at crawld's defaults (per_host_concurrency 2,
no delay).

Handover (``--handover``): two ``crawld run`` supervisors (two "hosts": separate run dirs and
sessions, nothing shared but the broker and the store) work a backlog slowed by a
per-site delay; once both store results, one supervisor's whole process group is
SIGKILLed, and ``measure_handover`` times how long until the survivor stores the next
result of a site the dead host owned (a site only the dead host had stored before the
kill). Under ``"none"`` every host serves every site, so that set is empty and it times
the next stored result of any site. It takes a ``rows_since`` reader, so a PostgreSQL
store plugs in; here both hosts share one SQLite file (same machine).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from benchlib import (CRAWLD, Env, Ratio, Section, Table, amqp_delete_setup, children_of,
                      crawld_publish, crawld_setup, db_count, ratio, run_section,
                      start_crawld, stop_proc, transports_bench_main, wait_rows, wait_until, CrawldSetup)

KEY = "partition"
COMMAND = "python tests/bench/bench_partition.py"
SITES = 200
PAGES = 20
WORKERS = 2


def frontier(site, sites: int, pages: int) -> list[str]:
    """Round-robin over the sites: page 0 of every site, then page 1, ..."""
    return [site.page_url(n, k) for n in range(pages) for k in range(1, sites + 1)]


# -- throughput: partitioned vs none ------------------------------------------------------------
def throughput(env: Env, transport: str, partition: str, urls: list[str],
               fetch: dict | None = None) -> dict:
    nats = env.new_nats() if transport == "jetstream" else None
    setup = crawld_setup(env, "pt", transport=transport, broker_url=nats.url if nats else None,
                         workers=WORKERS, queue={"partition": partition},
                         fetch={"per_host_concurrency": 2, **(fetch or {})})
    try:
        crawld_publish(setup, urls)
        started = time.perf_counter()
        sup = start_crawld(env, setup, WORKERS)
        progress = wait_rows(setup.db, len(urls), started, timeout=60 + len(urls) / 20, proc=sup)
        stop_proc(sup, timeout=60)
        return {"progress": progress, "fetched": db_count(setup.db, "results", "status = 'fetched'"),
                "dead": db_count(setup.db, "dead")}
    finally:
        if nats is not None:
            env.drop_nats(nats)
        else:
            amqp_delete_setup(setup)


def alternate(rounds: int) -> list[str]:
    order: list[str] = []
    for r in range(rounds):
        order += ["host", "none"] if r % 2 == 0 else ["none", "host"]
    return order


def compare(env: Env, transport: str, rounds: int, sites: int, pages: int, table: Table,
            section: Section) -> None:
    urls = frontier(env.nginx(pages=pages, sites=sites), sites, pages)
    rates: dict[str, list[float]] = {"host": [], "none": []}
    for mode in alternate(rounds):
        result = throughput(env, transport, mode, urls)
        progress = result["progress"]
        if progress.done_t is None:
            section.notes.append(f"{transport} partition={mode}: only {progress.final}/{len(urls)} rows")
        else:
            rates[mode].append(progress.steady_rate)
        table.add(transport, mode, len(rates[mode]) or 1, progress.final, result["fetched"], result["dead"],
                  progress.wall_rate, progress.steady_rate)
    mean = {m: (sum(v) / len(v) if v else None) for m, v in rates.items()}
    section.data[f"{transport}_host"], section.data[f"{transport}_none"] = mean["host"], mean["none"]
    section.ratios.append(Ratio(f"partition=host / partition=none, {transport}, {WORKERS} workers, "
                                f"{sites} sites", ratio(mean["host"], mean["none"]), ">= 0.9x", 0.9))


# -- handover after SIGKILL of one host ------------------------------------------------------------
@dataclass
class Host:
    """One ``crawld run`` supervisor in its own session (its workers share its process group)."""
    label: str
    proc: subprocess.Popen

    def worker_pids(self) -> set[int]:
        return set(children_of(self.proc.pid))

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


Rows = Callable[[float], list[tuple[str, str, float]]]   # since epoch s -> (url, worker, fetched_at)


def sqlite_rows(db: Path) -> Rows:
    def rows_since(since: float) -> list[tuple[str, str, float]]:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("SELECT url, worker, fetched_at FROM results WHERE fetched_at > ?",
                                (since,)).fetchall()
        except sqlite3.OperationalError:
            return []
        finally:
            conn.close()
    return rows_since


def _pid(worker: str) -> int:
    tail = worker.rpartition(":")[2]
    return int(tail) if tail.isdigit() else -1


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


@dataclass
class Handover:
    dead_sites: int                  # sites only the dead host had stored before the kill
    first_any_s: float | None        # kill -> the survivor's next stored result (any site)
    first_owned_s: float | None      # kill -> the survivor's first result of a dead host's site
    all_owned_s: float | None        # kill -> every dead host's site served by the survivor
    owned_served: int = 0
    shared_sites: int = 0            # sites both hosts stored before the kill
    notes: list[str] = field(default_factory=list)


def measure_handover(dead: Host, survivor: Host, rows_since: Rows, partitioned: bool = True,
                     timeout: float = 60, interval: float = 0.02) -> Handover:
    """SIGKILL ``dead``'s process group and time how long until ``survivor`` stores the next
    result of a site ``dead`` owned (partitioned: sites only ``dead`` had stored), or the next
    result of any site (``partitioned=False``: no site has one owner). Both hosts must be
    storing results. ``shared_sites`` (stored by both before the kill) shows whether the
    partitioning is in effect: ~0 when it is."""
    dead_pids = dead.worker_pids()
    before = rows_since(0.0)
    by_dead = {_host(u) for u, w, _ in before if _pid(w) in dead_pids}
    by_other = {_host(u) for u, w, _ in before if _pid(w) not in dead_pids}
    owned = (by_dead - by_other) if partitioned else set()
    killed_wall, killed = time.time(), time.perf_counter()
    dead.kill_group()
    out = Handover(len(owned), None, None, None, shared_sites=len(by_dead & by_other))
    seen: set[str] = set()
    deadline = killed + timeout
    while time.perf_counter() < deadline:
        now = time.perf_counter()
        for url, worker, _ in rows_since(killed_wall):
            if _pid(worker) in dead_pids:
                continue                          # committed by the dead host as it died
            if out.first_any_s is None:
                out.first_any_s = now - killed
            host = _host(url)
            if host in owned and host not in seen:
                seen.add(host)
                out.first_owned_s = out.first_owned_s or now - killed
        if owned and len(seen) == len(owned):
            out.all_owned_s = now - killed
            break
        if not owned and out.first_any_s is not None:
            break
        time.sleep(interval)
    out.owned_served = len(seen)
    return out


def two_hosts(env: Env, transport: str, partition: str, delay: float) -> tuple[CrawldSetup, Path]:
    """One store and queue, two configs with their own run dirs (two "hosts")."""
    nats_url = env.new_nats().url if transport == "jetstream" else None
    setup = crawld_setup(env, "ho", transport=transport, broker_url=nats_url, workers=WORKERS,
                         queue={"partition": partition},
                         fetch={"per_host_concurrency": 1, "per_host_delay_s": delay})
    text = setup.config.read_text().replace(str(setup.dir / "run"), str(setup.dir / "run-b"))
    config_b = setup.dir / "crawld-b.toml"
    config_b.write_text(text)
    return setup, config_b


def handover_case(env: Env, transport: str, partition: str, sites: int, pages: int,
                  delay: float = 0.5) -> Handover:
    setup, config_b = two_hosts(env, transport, partition, delay)
    urls = frontier(env.nginx(pages=pages, sites=sites), sites, pages)
    try:
        crawld_publish(setup, urls)
        hosts = [Host(label, env.spawn([*CRAWLD, "run", "-c", str(cfg), "--workers", str(WORKERS)],
                                       log=setup.dir / f"run-{label}.log", env={"CRAWLD_LOG_FORMAT": "json"},
                                       start_new_session=True))
                 for label, cfg in (("a", setup.config), ("b", config_b))]
        rows = sqlite_rows(setup.db)
        wait_until(lambda: _both_storing(hosts, rows), 60, interval=0.2, what="both hosts to store results")
        time.sleep(1.0)                           # let each host settle on its sites
        result = measure_handover(hosts[0], hosts[1], rows, partitioned=partition != "none", timeout=30)
        stop_proc(hosts[1].proc, timeout=60)
        return result
    finally:
        if transport == "amqp":
            with contextlib.suppress(Exception):
                amqp_delete_setup(setup)


def _both_storing(hosts: list[Host], rows: Rows) -> bool:
    writers = {_pid(w) for _, w, _ in rows(0.0)}
    return all(writers & h.worker_pids() for h in hosts)


def handovers(env: Env, args: argparse.Namespace, section: Section) -> None:
    table = Table(f"SIGKILL of one of two hosts ({WORKERS} workers each) mid-run; {args.sites} sites, "
                  f"per_host_concurrency 1, per_host_delay_s 0.5",
                  ["transport", "partition", "sites both hosts stored", "dead host's own sites",
                   "kill -> next result s",
                   "kill -> first own-site result s", "kill -> all own sites s", "own sites served"])
    for transport in args.transports.split(","):
        for mode in ("host", "none"):
            h = handover_case(env, transport, mode, args.sites, args.pages)
            table.add(transport, mode, h.shared_sites, h.dead_sites, h.first_any_s, h.first_owned_s, h.all_owned_s,
                      h.owned_served)
            section.data[f"handover_{transport}_{mode}"] = h.first_owned_s or h.first_any_s
    section.tables.append(table)
    section.notes.append("'dead host's own sites' are sites only the killed host had stored before "
                         "the kill (partitioned modes; for 'none' the time is the survivor's next stored "
                         "result of any site). 'sites both hosts stored' is ~0 when the partitioning is "
                         "in effect; if it is not, the own sites are only the ones the dead host happened "
                         "to reach alone, and their times say nothing about a handover.")


# -- entry points -------------------------------------------------------------------------------
def measure(env: Env, args: argparse.Namespace, section: Section) -> None:
    if not args.handover_only:
        table = Table(f"crawld run --workers {WORKERS}, {args.sites} sites x {args.pages} pages on nginx, "
                      f"partition host vs none, alternating", ["transport", "partition", "round", "rows",
                                                               "fetched", "dead", "wall/s", "steady/s"])
        for transport in args.transports.split(","):
            compare(env, transport, args.rounds, args.sites, args.pages, table, section)
        section.tables.append(table)
        section.notes.append("Same tree, same run: host = one shard owner per site (64 shards, "
                             "in-process politeness); none = one shared queue, flock politeness.")
    if args.handover or args.handover_only:
        handovers(env, args, section)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 sites x 10 pages, one round")
    parser.add_argument("--transports", default="amqp,jetstream")
    parser.add_argument("--md", help="also write the section as markdown to this file")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sites", type=int, default=SITES)
    parser.add_argument("--pages", type=int, default=PAGES)
    parser.add_argument("--handover", action="store_true", help="also measure the SIGKILL handover")
    parser.add_argument("--handover-only", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.sites, args.pages, args.rounds = min(args.sites, 50), min(args.pages, 10), 1
    return args


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None,
        args: argparse.Namespace | None = None) -> Section:
    args = args or parse_args(["--quick"] if quick else [])
    return run_section(KEY, "Partitioned fleet vs one shared queue (200 nginx sites)",
                       COMMAND + (" --quick" if args.quick else ""), lambda s: measure(env, args, s))


def main(argv: list[str] | None = None) -> int:
    return transports_bench_main(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
