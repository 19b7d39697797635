"""crawld vs Celery 5 vs Dramatiq: same broker, same work, same process and thread counts.

    python tests/bench/bench_frameworks.py [--quick]

Every contender but the last runs the same task body on the same zero-latency pages:
crawld's Fetcher (SSRF guard, robots, politeness, deadlines) and crawld's SQLite store
upsert (bench_task.py for Celery and Dramatiq). Settings that matter:

* crawld: ``crawld run --workers P``, workers.threads 16, queue.prefetch 16;
* Celery: P x ``celery worker -P threads -c 16 --prefetch-multiplier 1``, acks_late=True
  (prefetch 16 per process, ack after the task);
* Dramatiq: ``dramatiq -p P -t 16`` with dramatiq_queue_prefetch=16 (acks after the actor);
* celery-prefork+requests, what a user gets from Celery as documented: one ``celery worker
  -P prefork -c CORES --prefetch-multiplier 1`` (the default pool, one child per core),
  acks_late=True, running plain_task.py (``requests.get`` and one committed sqlite3 row
  per task); compared with crawld at P = CORES processes only.

N tasks are published first (not timed: crawld through its outbox, Celery apply_async,
Dramatiq send), then the workers are started and timed until all N rows are stored;
the steady rate (first stored row -> last) is compared, as in bench_e2e.py. The three
run one after another for each process count, so drift hits them alike.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import (BENCH_DIR, PY, THREADS, Env, Ratio, Section, Table, amqp_delete, bench_main,
                      db_count, ratio, run_json, run_section, stop_proc, wait_rows, write_urls)

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
CORES = os.cpu_count() or 1


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def framework_env(env: Env, directory: Path, queue: str) -> dict[str, str]:
    return {"BENCH_AMQP_URL": env.rabbit.url, "BENCH_QUEUE": queue, "BENCH_DB": str(directory / "crawld.db"),
            "BENCH_BODY_DIR": str(directory / "bodies"), "BENCH_RUN_DIR": str(directory / "run"),
            "BENCH_THREADS": str(THREADS), "dramatiq_queue_prefetch": str(THREADS),
            "PYTHONPATH": str(BENCH_DIR)}


def publish_cmd(framework: str, urls: Path) -> list[str]:
    app = "dramatiq_app.py" if framework == "dramatiq" else "celery_app.py"
    return [PY, str(BENCH_DIR / app), "publish", str(urls)] + (["--plain"] if framework == PREFORK else [])


def celery_cmd(queue: str, name: str, *pool: str) -> list[str]:
    return [PY, "-m", "celery", "-A", "celery_app", "worker", *pool, "--prefetch-multiplier", "1",
            "-Q", queue, "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
            "-n", f"{name}@{queue}"]


def worker_cmds(framework: str, procs: int, queue: str) -> list[list[str]]:
    if framework == "celery":
        return [celery_cmd(queue, f"w{i}", "-P", "threads", "-c", str(THREADS)) for i in range(procs)]
    if framework == PREFORK:     # one worker process; its `procs` forked children run the tasks
        return [celery_cmd(queue, "w0", "-P", "prefork", "-c", str(procs))]
    return [[PY, "-m", "dramatiq", "dramatiq_app", "-p", str(procs), "-t", str(THREADS), "-Q", queue,
             "--path", str(BENCH_DIR), "--worker-shutdown-timeout", "30000"]]


def framework_run(env: Env, framework: str, procs: int, n: int) -> dict[str, Any]:
    directory = env.scenario_dir(framework[:3])
    queue = directory.name
    (directory / "run").mkdir()
    fenv = framework_env(env, directory, queue)
    urls = write_urls(directory / "urls.txt", (f"{env.site}/fast/{queue}/{i}" for i in range(n)))
    started = time.perf_counter()
    run_json(publish_cmd(framework, urls), timeout=300, env=fenv)
    publish_s = time.perf_counter() - started
    log = directory / "worker.log"
    cmds = worker_cmds(framework, procs, queue)
    started = time.perf_counter()
    workers = [env.spawn(cmd, log=log, env=fenv, cwd=BENCH_DIR) for cmd in cmds]
    progress = wait_rows(directory / "crawld.db", n, started, timeout=60 + n / 30, proc=workers[0])
    for proc in workers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in workers:
        stop_proc(proc, timeout=60)
    names = [queue] + ([f"{queue}.DQ", f"{queue}.XQ"] if framework == "dramatiq" else [])
    amqp_delete(env.rabbit.url, *names)
    return {"progress": progress, "publish_rate": n / publish_s, "log": log,
            "duplicates": db_count(directory / "crawld.db", "results", "writes > 1")}


def contenders_at(procs: int, base_counts: tuple[int, ...], frameworks: list[str],
                  prefork: bool) -> list[str]:
    """crawld's two at every count; Celery threads and Dramatiq at the base counts; the
    prefork contender only at CORES processes (its natural size, one child per core)."""
    names = ["crawld", SAME_WORK] + (frameworks if procs in base_counts else [])
    return names + ([PREFORK] if prefork and procs == CORES else [])


def run_one(env: Env, name: str, procs: int, n: int, section: Section, table: Table) -> float | None:
    """One contender at one process count: a table row; the steady rate (None if unfinished)."""
    from bench_e2e import crawld_e2e
    if name.startswith("crawld"):
        same = name == SAME_WORK
        result = crawld_e2e(env, "amqp", procs, n, tag="fwk", extra_env=SAME_WORK_ENV if same else None,
                            queue=SAME_WORK_QUEUE if same else None)
        progress, publish_rate = result["progress"], result["publish"]["rate"]
    else:
        result = framework_run(env, name, procs, n)
        progress, publish_rate = result["progress"], result["publish_rate"]
    if progress.done_t is None:
        section.notes.append(f"{name} with {procs} process(es) stored only {progress.final}/{n} "
                             f"before the timeout")
    rate = progress.steady_rate if progress.done_t else None
    table.add(name, procs, publish_rate, progress.wall_s, progress.wall_rate, rate, result["duplicates"])
    return rate


def add_ratios(section: Section, rates: dict[tuple[str, int], float | None]) -> None:
    for (name, procs), rate in rates.items():
        if name.startswith("crawld"):
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
        section.data[f"{name.replace('-', '_').replace('+', '_')}_{procs}"] = rate
    for procs in sorted({procs for _, procs in rates}):
        section.data[f"crawld_{procs}"] = rates.get(("crawld", procs))
        section.data[f"crawld_same_work_{procs}"] = rates.get((SAME_WORK, procs))


def measure(env: Env, quick: bool, section: Section) -> None:
    n = 2000 if quick else 6000
    frameworks = [f for f in ("celery", "dramatiq") if available(f)]
    prefork = available("celery") and available("requests")
    for missing in {"celery", "dramatiq"} - set(frameworks):
        section.notes.append(f"{missing} is not installed: pip install {missing} (skipped)")
    if available("celery") and not prefork:
        section.notes.append(f"requests is not installed: pip install requests ({PREFORK} skipped)")
    base_counts = (2,) if quick else (1, 2)
    counts = sorted(set(base_counts) | ({CORES} if prefork else set()))
    table = Table(f"{n:,} tasks of /fast/ pages, same RabbitMQ node; {THREADS} threads and prefetch 16 per "
                  f"process, same Fetcher + SQLite store (all but {PREFORK}: see the notes)",
                  ["framework", "processes", "publish/s (untimed)", "wall s", "wall/s", "steady/s",
                   "dup writes"])
    rates: dict[tuple[str, int], float | None] = {}
    for procs in counts:
        for name in contenders_at(procs, base_counts, frameworks, prefork):
            rates[(name, procs)] = run_one(env, name, procs, n, section, table)
    section.tables.append(table)
    add_ratios(section, rates)
    section.notes.append("Celery uses its thread pool (-P threads), the closest match to crawld's "
                         "worker threads; the task body is bench_task.py (same code as crawld's fetch "
                         "and store). Celery acks_late=True, worker_prefetch_multiplier=1. crawld's workers "
                         "turn on the store's group commit (one transaction and fsync for many threads' "
                         "rows); the Celery and Dramatiq task bodies commit row by row, as a task written "
                         "for them would.")
    if prefork:
        section.notes.append(prefork_note())


def prefork_note() -> str:
    return (f"{PREFORK} is what a user gets from Celery as documented: the default prefork pool, one "
            f"`celery worker -P prefork -c {CORES}` (os.cpu_count() children run the tasks; 'processes' "
            f"counts the children), acks_late=True, worker_prefetch_multiplier=1, running plain_task.py: "
            f"requests.get(url, timeout=10) (a new connection per task, no robots, no SSRF guard, no "
            f"politeness) and one INSERT ... ON CONFLICT and commit per task on a sqlite3 connection each "
            f"child opens on its first task (WAL; the table is created once before the workers start). "
            f"Its ratios are matched on process count = cores: on this {CORES}-core machine, the "
            f"{CORES}-process crawld rows.")


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None) -> Section:
    return run_section(KEY, "crawld vs Celery 5 vs Dramatiq (same broker, same work, same processes)",
                       COMMAND + (" --quick" if quick else ""), lambda s: measure(env, quick, s))


def main(argv: list[str] | None = None) -> int:
    return bench_main(KEY, run, needs=("rabbit", "site"), argv=argv)


if __name__ == "__main__":
    sys.exit(main())
