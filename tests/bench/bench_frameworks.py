"""crawld vs Celery 5 vs Dramatiq: same broker, same work, same process and thread counts.

    python tests/bench/bench_frameworks.py [--quick] [--rounds R] [--warm-stores] [--md FILE]

Two runs, each contender's URLs its own (task ids and dedup are by URL):

1. Zero-latency pages (``measure_fast``): every contender fetches the same ~2 KB static pages
   ``/p/N`` from a private Debian nginx (nginx_site.NginxSite: one site on 127.0.0.1, its own
   temporary directory, started by this bench and stopped at its end), through one helper,
   ``fast_urls``, which tells the contenders apart by a query string (``/p/N?c=<queue>``).
   A Python site would compete for the same cores as the contenders and flatten every ratio.
   Every contender but the last runs the same task body: crawld's Fetcher (SSRF guard, robots,
   politeness, deadlines) and crawld's SQLite store upsert (bench_task.py for Celery and
   Dramatiq). Settings that matter:

   * crawld: ``crawld run --workers P``, workers.threads 16, queue.prefetch 16;
   * Celery: P x ``celery worker -P threads -c 16 --prefetch-multiplier 1``, acks_late=True
     (prefetch 16 per process, ack after the task);
   * Dramatiq: ``dramatiq -p P -t 16`` with dramatiq_queue_prefetch=16 (acks after the actor);
   * celery-prefork+requests, what a user gets from Celery as documented: one ``celery worker
     -P prefork -c CORES --prefetch-multiplier 1`` (the default pool, one child per core),
     acks_late=True, running plain_task.py (``requests.get`` and one committed sqlite3 row
     per task); compared with crawld at P = CORES processes only.

   * plain: P x plain_pipeline.py (issue 17's reference: the same work with no framework),
     threads and prefetch 16, one queue and one SQLite file: the bound for every ratio here;
   * plain-no-body-files: the same with the body's sha256 only, no file (at CORES processes):
     less work than celery-prefork+requests does, the bound for the ratios against it.

   Each row also gives the CPU per task in the steady window: the contender's process trees,
   and the whole machine (broker and site included).

   N tasks (6,000; 2,000 with --quick) are published first (not timed: crawld through its
   outbox, Celery apply_async, Dramatiq send), then the workers are started and timed until
   all N rows are stored; the steady rate (first stored row -> last) is compared, as in
   bench_e2e.py. The contenders run one after another for each process count, so drift hits
   them alike.

   With ``--warm-stores`` every body store that writes one file per body starts with all the
   directories of its layout made (untimed), as on a store past its first few hundred
   thousand bodies: a fresh store of crawld's layout makes a directory for nearly every one
   of a short run's bodies, on every contender that uses it alike (Store.save_body), and
   where an inode is dear that young-store cost dilutes every ratio.

2. Latency-bound pages (``measure_slow``): 1,200 pages (600 with --quick) that each take
   50 ms (benchsite.py ``/slow/0.05/...``, asyncio sleep, no thread held), spread round-robin
   over 50 sites (127.0.0.1 .. 127.0.0.50, one port: Env.wide_site). crawld with its
   defaults (``crawld run --workers 2``, threads 16, prefetch 16, partition by host,
   per_host_concurrency 2, WARC and events) against celery-prefork+requests as above. The
   Python site is fine here: at these rates it sleeps, it is not CPU-bound. Ratio target:
   crawld >= 3x Celery as documented.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from benchlib import (BENCH_DIR, PY, THREADS, Env, Ratio, Section, Table, WideSite, amqp_delete,
                      amqp_publish_raw, db_count, ratio, run_json, run_section, stop_proc,
                      store_dirs_made, wait_rows, write_urls)

KEY = "frameworks"
# The task body of bench_task.py writes each body to a file and publishes no event, and its
# workers share one queue: crawld with the same outputs and one shared queue is the same work
# (its defaults add a WARC record and an event, and give all of one site's pages -- here
# every page -- to one worker, for politeness, so a second process would have nothing to do).
SAME_WORK = "crawld-same-work"
SAME_WORK_ENV = {"CRAWLD_STORE_BODIES": "files", "CRAWLD_OUTPUT_EVENTS": "false"}
SAME_WORK_QUEUE = {"partition": "none"}    # in the config: `crawld publish` must agree
COMMAND = "python tests/bench/bench_frameworks.py"
# Celery's default pool and a task as its docs would have it (plain_task.py), one child per core.
PREFORK = "celery-prefork+requests"
# The same work written plainly (plain_pipeline.py, issue 17's reference): P processes on the
# one queue. Its rate is what the same fetch and store can do on this machine with no
# framework at all, so it bounds what any framework's ratio to another can be.
PLAIN = "plain"
# ... with no body file (its sha256 only): less work than any contender here, Celery's
# documented task included (it keeps the body in its row). At CORES processes, against it.
PLAIN_NO_BODIES = "plain-no-body-files"
PLAINS = (PLAIN, PLAIN_NO_BODIES)
# The contenders that write one file per body: the ones --warm-stores warms.
BODY_FILES = (SAME_WORK, "celery", "dramatiq", PLAIN)
CORES = os.cpu_count() or 1
# The latency-bound run: pages that take SLOW_PAGE_S, round-robin over SLOW_SITES sites.
SLOW_PAGE_S = 0.05
SLOW_SITES = 50
SLOW_WORKERS = 2                           # `crawld run --workers 2`, everything else default

UrlsOf = Callable[[str], list[str]]        # a contender's queue name -> its URLs


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# -- the pages -----------------------------------------------------------------------------
@contextlib.contextmanager
def nginx_site(pages: int) -> Iterator[Any]:
    """A private nginx for this bench only: ``/p/N`` for N < pages on 127.0.0.1, its own
    temporary directory; stopped (and the directory removed) on the way out."""
    from nginx_site import NginxSite
    with tempfile.TemporaryDirectory(prefix="crawld-bench-fwk-nginx-") as tmp:
        with NginxSite(tmp, pages=pages, sites=1) as site:
            yield site


def fast_urls(site: Any, key: str, n: int) -> list[str]:
    """The zero-latency URLs of one contender: the same nginx pages /p/0 .. /p/n-1 for
    every contender, told apart by ``?c=<key>`` (nginx serves the file, ignoring the query;
    the canonical URL, hence the task id, keeps it)."""
    return [f"{site.page_url(i)}?c={key}" for i in range(n)]


def slow_urls(site: WideSite, key: str, n: int) -> list[str]:
    """Round-robin over the sites, as a crawl frontier hands them out: page 0 of every
    site, then page 1, ...; each page answers after SLOW_PAGE_S."""
    return [site.url(i % site.hosts + 1, f"slow/{SLOW_PAGE_S:g}/{key}/{i // site.hosts}")
            for i in range(n)]


# -- Celery and Dramatiq -----------------------------------------------------------------------
def framework_env(env: Env, directory: Path, queue: str) -> dict[str, str]:
    return {"BENCH_AMQP_URL": env.rabbit.url, "BENCH_QUEUE": queue, "BENCH_DB": str(directory / "crawld.db"),
            "BENCH_BODY_DIR": str(directory / "bodies"), "BENCH_RUN_DIR": str(directory / "run"),
            "BENCH_THREADS": str(THREADS), "dramatiq_queue_prefetch": str(THREADS),
            "PYTHONPATH": str(BENCH_DIR)}


def publish(env: Env, framework: str, queue: str, urls: Path, url_list: list[str],
            fenv: dict[str, str]) -> None:
    if framework in PLAINS:
        from bench_plain import plain_bodies
        amqp_publish_raw(env.rabbit.url, queue, plain_bodies(url_list))
        return
    app = "dramatiq_app.py" if framework == "dramatiq" else "celery_app.py"
    plain = ["--plain"] if framework == PREFORK else []
    run_json([PY, str(BENCH_DIR / app), "publish", str(urls), *plain], timeout=300, env=fenv)


def celery_cmd(queue: str, name: str, *pool: str) -> list[str]:
    return [PY, "-m", "celery", "-A", "celery_app", "worker", *pool, "--prefetch-multiplier", "1",
            "-Q", queue, "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
            "-n", f"{name}@{queue}"]


def worker_cmds(framework: str, procs: int, queue: str, fenv: dict[str, str], n: int) -> list[list[str]]:
    if framework in PLAINS:   # each stays up (--linger) until stopped: the bench counts the rows
        body_dir = "-" if framework == PLAIN_NO_BODIES else fenv["BENCH_BODY_DIR"]
        return [[PY, str(BENCH_DIR / "plain_pipeline.py"), "amqp", fenv["BENCH_AMQP_URL"], queue,
                 fenv["BENCH_DB"], body_dir, "--expect", str(n), "--threads", str(THREADS),
                 "--prefetch", str(THREADS), "--max-seconds", "900", "--linger", "900"]
                for _ in range(procs)]
    if framework == "celery":
        return [celery_cmd(queue, f"w{i}", "-P", "threads", "-c", str(THREADS)) for i in range(procs)]
    if framework == PREFORK:     # one worker process; its `procs` forked children run the tasks
        return [celery_cmd(queue, "w0", "-P", "prefork", "-c", str(procs))]
    return [[PY, "-m", "dramatiq", "dramatiq_app", "-p", str(procs), "-t", str(THREADS), "-Q", queue,
             "--path", str(BENCH_DIR), "--worker-shutdown-timeout", "30000"]]


def framework_run(env: Env, framework: str, procs: int, urls_of: UrlsOf,
                  timeout: float | None = None, warm: bool = False) -> dict[str, Any]:
    directory = env.scenario_dir(framework[:3])
    queue = directory.name
    (directory / "run").mkdir()
    fenv = framework_env(env, directory, queue)
    url_list = urls_of(queue)
    n = len(url_list)
    urls = write_urls(directory / "urls.txt", url_list)
    started = time.perf_counter()
    publish(env, framework, queue, urls, url_list, fenv)
    publish_s = time.perf_counter() - started
    if warm and framework in BODY_FILES:
        store_dirs_made(Path(fenv["BENCH_BODY_DIR"]), plain=framework == PLAIN)
    log = directory / "worker.log"
    cmds = worker_cmds(framework, procs, queue, fenv, n)
    started = time.perf_counter()
    workers = [env.spawn(cmd, log=log, env=fenv, cwd=BENCH_DIR) for cmd in cmds]
    progress = wait_rows(directory / "crawld.db", n, started, timeout=timeout or 60 + n / 30,
                         proc=workers[0], roots=lambda: [w.pid for w in workers])
    for proc in workers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in workers:
        stop_proc(proc, timeout=60)
    names = [queue] + ([f"{queue}.DQ", f"{queue}.XQ"] if framework == "dramatiq" else [])
    amqp_delete(env.rabbit.url, *names)
    # the plain pipeline's table has no writes column: it keeps no count of rewrites
    duplicates = None if framework in PLAINS else db_count(directory / "crawld.db", "results", "writes > 1")
    return {"progress": progress, "publish_rate": n / publish_s, "log": log, "duplicates": duplicates}


def contenders_at(procs: int, base_counts: tuple[int, ...], frameworks: list[str],
                  prefork: bool) -> list[str]:
    """crawld's two and the plain pipeline at every count; Celery threads and Dramatiq at the
    base counts; the prefork contender only at CORES processes (its natural size, one child
    per core)."""
    names = ["crawld", SAME_WORK, PLAIN] + (frameworks if procs in base_counts else [])
    return names + ([PREFORK, PLAIN_NO_BODIES] if prefork and procs == CORES else [])


def run_one(env: Env, name: str, procs: int, n: int, section: Section, table: Table,
            urls_of: UrlsOf, timeout: float | None = None, round_no: int = 1, data_prefix: str = "",
            warm: bool = False, **crawld_kw: Any) -> float | None:
    """One contender at one process count on the URLs ``urls_of(queue)`` (n of them): a
    table row; the steady rate (None if unfinished). ``crawld_kw`` goes to crawld_setup
    (through crawld_e2e) for the crawld contenders; ``warm``: see --warm-stores."""
    from bench_e2e import crawld_e2e
    if name.startswith("crawld"):
        same = name == SAME_WORK
        prepare = (lambda setup: store_dirs_made(setup.dir / "bodies")) if warm and same else None
        result = crawld_e2e(env, "amqp", procs, n, tag="fwk", extra_env=SAME_WORK_ENV if same else None,
                            queue=SAME_WORK_QUEUE if same else None, timeout=timeout,
                            urls_of=lambda setup: urls_of(setup.queue), prepare=prepare, **crawld_kw)
        progress, publish_rate = result["progress"], result["publish"]["rate"]
    else:
        result = framework_run(env, name, procs, urls_of, timeout=timeout, warm=warm)
        progress, publish_rate = result["progress"], result["publish_rate"]
    if progress.done_t is None:
        section.notes.append(f"{name} with {procs} process(es) stored only {progress.final}/{n} "
                             f"before the timeout")
    rate = progress.steady_rate if progress.done_t else None
    table.add(name, procs, round_no, publish_rate, progress.wall_s, progress.wall_rate, rate,
              progress.cpu_ms_steady, progress.busy_ms_steady, result["duplicates"])
    for what, value in (("cpu_ms", progress.cpu_ms_steady), ("busy_ms", progress.busy_ms_steady)):
        section.data.setdefault(f"{data_prefix}{data_key(name)}_{procs}_{what}_rounds", []).append(value)
    return rate


def data_key(name: str) -> str:
    return name.replace("-", "_").replace("+", "_")


def add_ratios(section: Section, rates: dict[tuple[str, int], float | None]) -> None:
    for (name, procs), rate in rates.items():
        if name.startswith("crawld") or name in PLAINS:
            continue
        # what a user gets from a default Celery (plain_task.py) must be beaten by 3x, even by
        # crawld's defaults; the same-work contenders by 1.3x, by the same work only
        plain = name == PREFORK
        defaults_target = (">= 3x", 3.0) if plain else ()
        same_target = (">= 3x", 3.0) if plain else (">= 1.3x", 1.3)
        section.ratios.append(Ratio(f"crawld (defaults: WARC, events) / {name}, {procs} process(es)",
                                    ratio(rates[("crawld", procs)], rate), *defaults_target))
        section.ratios.append(Ratio(f"{SAME_WORK} (files, no events, one queue) / {name}, {procs} process(es)",
                                    ratio(rates[(SAME_WORK, procs)], rate), *same_target))
        # the bound: the same work with no framework at all, over this contender
        for bound in PLAINS:
            if (bound, procs) in rates:
                section.ratios.append(Ratio(f"{bound} (no framework) / {name}, {procs} process(es)",
                                            ratio(rates[(bound, procs)], rate)))
        section.data[f"{data_key(name)}_{procs}"] = rate
    for procs in sorted({procs for _, procs in rates}):
        for name in ("crawld", SAME_WORK, PLAIN):
            section.data[f"{data_key(name)}_{procs}"] = rates.get((name, procs))
        section.ratios.append(Ratio(f"{SAME_WORK} / {PLAIN}, {procs} process(es)",
                                    ratio(rates.get((SAME_WORK, procs)), rates.get((PLAIN, procs)))))


TABLE_HEADERS = ["framework", "processes", "round", "publish/s (untimed)", "wall s", "wall/s", "steady/s",
                 "worker CPU ms/task", "machine CPU ms/task", "dup writes"]


def measure(env: Env, quick: bool, section: Section, rounds: int = 1, warm: bool = False) -> None:
    measure_fast(env, quick, section, rounds, warm)
    measure_slow(env, quick, section)


def median_of(values: list[float | None]) -> float | None:
    """The median of the finished rounds (None if none finished)."""
    done = [v for v in values if v is not None]
    return statistics.median(done) if done else None


def measure_fast(env: Env, quick: bool, section: Section, rounds: int = 1, warm: bool = False) -> None:
    """Every contender at every process count, ``rounds`` times, the order reversed every
    other round (this machine drifts by tens of per cent within minutes, and a contender run
    early or late would carry it); the ratios are of the median rates."""
    n = 2000 if quick else 6000
    frameworks = [f for f in ("celery", "dramatiq") if available(f)]
    prefork = available("celery") and available("requests")
    for missing in {"celery", "dramatiq"} - set(frameworks):
        section.notes.append(f"{missing} is not installed: pip install {missing} (skipped)")
    if available("celery") and not prefork:
        section.notes.append(f"requests is not installed: pip install requests ({PREFORK} skipped)")
    base_counts = (2,) if quick else (1, 2)
    counts = sorted(set(base_counts) | ({CORES} if prefork else set()))
    table = Table(f"{n:,} tasks of nginx /p/N pages (~2 KB static, one site, zero latency), same RabbitMQ "
                  f"node; {THREADS} threads and prefetch 16 per process, same Fetcher + SQLite store (all "
                  f"but {PREFORK}: see the notes)", TABLE_HEADERS)
    section.tables.append(table)      # before the runs: a failure keeps the rows measured so far
    runs: dict[tuple[str, int], list[float | None]] = {}
    with nginx_site(n) as site:
        urls_of: UrlsOf = lambda key: fast_urls(site, key, n)   # noqa: E731
        for procs in counts:
            names = contenders_at(procs, base_counts, frameworks, prefork)
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    rate = run_one(env, name, procs, n, section, table, urls_of, round_no=r + 1, warm=warm)
                    runs.setdefault((name, procs), []).append(rate)
    add_ratios(section, {key: median_of(values) for key, values in runs.items()})
    for key in [k for k in section.data if k.endswith("_rounds")]:
        section.data[key.removesuffix("_rounds")] = median_of(section.data[key])
    if warm:
        section.notes.append(f"--warm-stores: {', '.join(BODY_FILES)} started with every directory of "
                             f"their body store's layout made before the run (crawld's files layout ab/cd/: "
                             f"65,536; {PLAIN}'s ab/: 256), as on a store past its first bodies.")
    if rounds > 1:
        section.notes.append(f"{rounds} rounds, the contenders' order reversed every other round; the "
                             f"ratios are of each contender's median steady rate.")
    section.notes.append("Zero-latency pages come from a private nginx (one worker process, "
                         "access_log off) started for this run: the same files /p/0 .. /p/N-1 for "
                         "every contender, each contender's URLs made distinct by '?c=<its queue>'.")
    section.notes.append("Celery uses its thread pool (-P threads), the closest match to crawld's "
                         "worker threads; the task body is bench_task.py (same code as crawld's fetch "
                         "and store). Celery acks_late=True, worker_prefetch_multiplier=1. crawld's workers "
                         "turn on the store's group commit (one transaction and fsync for many threads' "
                         "rows); the Celery and Dramatiq task bodies commit row by row, as a task written "
                         "for them would.")
    section.notes.append(f"{PLAIN} is tests/bench/plain_pipeline.py, the same work written plainly "
                         f"(pika consumer, prefetch = threads, a thread pool, protego robots, a urllib3 "
                         f"GET, the body in a file, batched SQLite commits, the ack after the commit), "
                         f"P processes on one queue: no framework at all, so '{PLAIN} / X' bounds what "
                         f"any framework can reach over X on this machine. worker CPU ms/task: user + "
                         f"system of the contender's processes and all their children, over the steady "
                         f"window's rows; machine CPU ms/task: the whole machine's busy time (/proc/stat: "
                         f"broker, nginx, workers) over the same rows. Where every core is busy, the "
                         f"machine's figure is what decides the rate on any number of cores. "
                         f"{PLAIN_NO_BODIES} is {PLAIN} keeping only each body's sha256 (no file): "
                         f"less work than {PREFORK} (which keeps the body in its row), so "
                         f"'{PLAIN_NO_BODIES} / {PREFORK}' bounds what any crawler doing that task can "
                         f"reach over it here.")
    if prefork:
        section.notes.append(prefork_note())


def measure_slow(env: Env, quick: bool, section: Section) -> None:
    """50 ms pages over 50 sites: crawld's defaults with 2 processes vs Celery as documented."""
    from crawld.config import FetchConfig
    n = 600 if quick else 1200
    prefork = available("celery") and available("requests")
    defaults = FetchConfig()
    # crawld_setup opens per_host_concurrency to 256 for its one-site cases; with many sites
    # crawld's own default is the realistic politeness, so it is restored here.
    fetch = {"per_host_concurrency": defaults.per_host_concurrency}
    crawld_ideal = min(SLOW_WORKERS * THREADS, SLOW_SITES * defaults.per_host_concurrency) / SLOW_PAGE_S
    prefork_ideal = CORES / SLOW_PAGE_S
    # Twice the slower ideal, plus start-up: bounded, and far beyond a healthy run.
    timeout = 60 + 2 * n / min(crawld_ideal, prefork_ideal)
    table = Table(f"{n:,} tasks of {SLOW_PAGE_S * 1000:.0f} ms pages over {SLOW_SITES} sites (Python site, "
                  f"round-robin over the sites), same RabbitMQ node; crawld at its defaults with "
                  f"{SLOW_WORKERS} processes vs {PREFORK}", TABLE_HEADERS)
    section.tables.append(table)
    site = env.wide_site(SLOW_SITES)
    urls_of: UrlsOf = lambda key: slow_urls(site, key, n)   # noqa: E731
    crawld = run_one(env, "crawld", SLOW_WORKERS, n, section, table, urls_of, timeout=timeout,
                     data_prefix="slow_", fetch=fetch)
    celery = (run_one(env, PREFORK, CORES, n, section, table, urls_of, timeout=timeout, data_prefix="slow_")
              if prefork else None)
    if not prefork:
        section.notes.append(f"celery or requests is not installed: {PREFORK} skipped in the "
                             f"{SLOW_PAGE_S * 1000:.0f} ms run")
    section.data[f"slow_crawld_{SLOW_WORKERS}"] = crawld
    section.data[f"slow_celery_prefork_requests_{CORES}"] = celery
    section.ratios.append(Ratio(f"crawld defaults, {SLOW_WORKERS} processes / {PREFORK}, "
                                f"{SLOW_PAGE_S * 1000:.0f} ms pages over {SLOW_SITES} sites",
                                ratio(crawld, celery), ">= 3x", 3.0))
    section.notes.append(
        f"{SLOW_PAGE_S * 1000:.0f} ms run: each page answers after {SLOW_PAGE_S:g} s (benchsite.py "
        f"--hosts {SLOW_SITES}, asyncio sleep). Ideal rates: crawld min({SLOW_WORKERS} x {THREADS} threads, "
        f"{SLOW_SITES} sites x per_host_concurrency {defaults.per_host_concurrency}) / {SLOW_PAGE_S:g} s = "
        f"{crawld_ideal:,.0f}/s; {PREFORK} {CORES} children / {SLOW_PAGE_S:g} s = {prefork_ideal:,.0f}/s. "
        f"crawld runs with its defaults (partition by host, WARC, events, robots) except "
        f"fetch.allow_networks for loopback; steady/s is polled every 0.25 s, coarse for crawld's "
        f"short run.")


def prefork_note() -> str:
    return (f"{PREFORK} is what a user gets from Celery as documented: the default prefork pool, one "
            f"`celery worker -P prefork -c {CORES}` (os.cpu_count() children run the tasks; 'processes' "
            f"counts the children), acks_late=True, worker_prefetch_multiplier=1, running plain_task.py: "
            f"requests.get(url, timeout=10) (a new connection per task, no robots, no SSRF guard, no "
            f"politeness) and one INSERT ... ON CONFLICT and commit per task on a sqlite3 connection each "
            f"child opens on its first task (WAL; the table is created once before the workers start). "
            f"Its ratios are matched on process count = cores: on this {CORES}-core machine, the "
            f"{CORES}-process crawld rows.")


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None, rounds: int = 1,
        warm: bool = False) -> Section:
    command = (COMMAND + (" --quick" if quick else "") + (f" --rounds {rounds}" if rounds > 1 else "")
               + (" --warm-stores" if warm else ""))
    return run_section(KEY, "crawld vs Celery 5 vs Dramatiq (same broker, same work, same processes)",
                       command, lambda s: measure(env, quick, s, rounds, warm))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts (smoke run)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="zero-latency runs per contender, order reversed every other round; "
                             "ratios of the medians")
    parser.add_argument("--warm-stores", action="store_true",
                        help="body stores start with their layout's directories made (untimed)")
    parser.add_argument("--md", help="also write the section as markdown to this file")
    args = parser.parse_args(argv)
    with Env(("rabbit",)) as env:
        section = run(env, args.quick, rounds=args.rounds, warm=args.warm_stores)
    if args.md:
        Path(args.md).write_text(section.markdown())
    return 1 if section.error else 0


if __name__ == "__main__":
    sys.exit(main())
