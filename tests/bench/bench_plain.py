"""crawld (1 worker) vs the same work written plainly (plain_pipeline.py), side by side (issue 17).

    python tests/bench/bench_plain.py [--quick] [--tasks 8000] [--rounds 2] [--transports amqp,jetstream]
                                      [--lean] [--warmup N] [--baseline CHECKOUT] [--profile DIR] [--threads] [--md FILE]

Pages come from a private Debian nginx (nginx_site.py): ``/p/N``, ~2 KB static HTML, one site
on 127.0.0.1. For each transport the two contenders work through the same N tasks (the
same URLs, each contender its own queue / stream, fresh stores) in ABBA order (crawld,
plain, plain, crawld, ...) so drift and neighbours' load hit both alike:

* crawld: ``crawld run --workers 1``, workers.threads 16, queue.prefetch 16,
  fetch.per_host_concurrency 256 (>= threads: politeness must not serialise one local host),
  fetch.allow_networks loopback; robots, the SSRF guard, the body store (WARC) and the
  events stream at their defaults. Tasks go in through ``crawld publish`` (untimed).
* plain: ``plain_pipeline.py`` with the same threads and prefetch; tasks go in with plain
  client publishes (untimed).

Both are timed from the outside in the same way: a COUNT(*) of the store polled every
0.25 s. ``steady/s`` is rows per second from the first poll that saw a row to the last row
(excludes interpreter start and connect). CPU per task is user+system of the worker
processes from /proc (crawld: the supervisor's forked worker, not the supervisor; plain:
its one process): ``all`` over the whole life divided by N (start-up included), ``steady``
over the same window as steady/s. ``--lean`` adds crawld with ``store.bodies = files`` and
``output.events = false`` (the outputs the plain pipeline lacks), once on a fresh store and
once with the store's body directories made beforehand. ``--baseline CHECKOUT`` adds
crawld run from another checkout's ``daemon/`` (e.g. a ``git worktree`` of the commit before a
change), the same ABBA rounds: before/after of one change measured side by side. With ``--profile DIR`` py-spy records the crawld worker
(``--native``, speedscope) in the first round of each transport and prints its top frames.
``--threads`` splits each worker's steady CPU per task by thread (the broker connection, the
commit thread, the fetch pool, the rest) from ``/proc/<pid>/task``: where crawld's extra
CPU over the plain pipeline is.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchlib import (BENCH_DIR, PREFETCH, PY, THREADS, CrawldSetup, Env, Progress, Ratio, Section, Table,
                      amqp_delete, amqp_delete_setup, amqp_depth, amqp_publish_raw, children_of, cpu_seconds,
                      crawld_publish, crawld_setup, db_count, js_stream, js_stream_messages, ratio,
                      run_section, start_crawld, stop_proc, store_dirs_made, thread_names, thread_stats,
                      transports_bench_main)

KEY = "plain"
COMMAND = "python tests/bench/bench_plain.py"


# -- timing one contender from the outside ------------------------------------------------------
@dataclass
class Track(Progress):
    """Rows and worker CPU at the first poll that saw a row and at completion (Progress), and
    at every poll in between, for --together's common window."""
    fetched: int = 0               # rows with status 'fetched' (a skipped or failed page is no page)
    errors: list[str] = field(default_factory=list)   # the plain pipeline's fetch errors (retried)
    left: int | None = None        # messages still in the broker after the stop (acked = gone)
    samples: list[tuple[float, int, float]] = field(default_factory=list)   # (time, rows, cpu) per poll
    # --together: the steady figures over the window every contender of the round ran in
    window: tuple[tuple[float, int, float], tuple[float, int, float]] | None = None
    # --threads: each worker thread's (CPU, switches) at the first row and at the end, and its name
    threads_first: dict[int, tuple[float, int]] = field(default_factory=dict)
    threads_done: dict[int, tuple[float, int]] = field(default_factory=dict)
    thread_names: dict[int, str] = field(default_factory=dict)

    def narrow(self, start: float, end: float) -> None:
        """Steady rate and CPU over [start, end] only: the polls nearest inside it."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) >= 2 and inside[-1][1] > inside[0][1]:
            self.window = (inside[0], inside[-1])

    @property
    def steady_rate(self) -> float | None:
        if self.window is not None:
            (t0, n0, _), (t1, n1, _) = self.window
            return (n1 - n0) / (t1 - t0)
        if self.done_t is None or self.first_t is None or self.done_t <= self.first_t:
            return None     # no steady window: not the wall rate Progress would give
        return super().steady_rate

    @property
    def cpu_ms_all(self) -> float | None:
        return 1e3 * self.cpu / self.final if self.final else None

    @property
    def cpu_ms_steady(self) -> float | None:
        if self.window is not None:
            (_, n0, c0), (_, n1, c1) = self.window
            return 1e3 * (c1 - c0) / (n1 - n0)
        rows = self.steady_rows
        return 1e3 * (self.cpu - self.first_cpu) / rows if rows > 0 else None


THREAD_KINDS = ("connection", "commit", "pool", "other")
SPLIT_COLUMNS = (*THREAD_KINDS, "pool max", "total", *(f"{kind} sw" for kind in THREAD_KINDS), "total sw")


def thread_kind(name: str) -> str:
    """crawld's and the plain pipeline's threads by what they do: the broker connection is
    the main thread in both; crawld's group commit and the plain writer write the rows."""
    if name == "MainThread":
        return "connection"
    if name in ("group-commit", "writer"):
        return "commit"
    if name.startswith(("fetch_", "ThreadPoolExecutor-")):
        return "pool"
    return "other"


def thread_split(t: Track) -> dict[str, float] | None:
    """Per stored row in the steady window, by thread kind: ms of CPU, the busiest pool
    thread's ('pool max'), and context switches ('<kind> sw'). None without --threads' samples."""
    rows = t.final - t.first_n
    if not (t.threads_first and t.threads_done and t.thread_names) or rows <= 0:
        return None
    ms = dict.fromkeys(THREAD_KINDS, 0.0)
    switches = dict.fromkeys(THREAD_KINDS, 0.0)
    pool_max = 0.0
    for tid, (cpu, sw) in t.threads_done.items():
        cpu0, sw0 = t.threads_first.get(tid, (0.0, 0))
        kind = thread_kind(t.thread_names.get(tid, ""))
        thread_ms = 1e3 * (cpu - cpu0) / rows
        ms[kind] += thread_ms
        switches[kind] += (sw - sw0) / rows
        if kind == "pool":
            pool_max = max(pool_max, thread_ms)
    return {**ms, "pool max": pool_max, "total": sum(ms.values()),
            **{f"{kind} sw": n for kind, n in switches.items()}, "total sw": sum(switches.values())}


def track(db: Path, n: int, started: float, pids: Callable[[], list[int]], proc: subprocess.Popen,
          timeout: float, interval: float = 0.25, split: bool = False) -> Track:
    """Poll the store until n rows; read the workers' CPU at the first row and at the end
    (with ``split``, each thread's too, of the one worker process)."""
    out = Track(n, started)
    known: list[int] = []
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline and proc.poll() is None:
        known = known or pids()
        count = db_count(db)
        now = time.perf_counter()
        cpu = sum(cpu_seconds(p) for p in known)
        if count and out.first_t is None:
            out.first_t, out.first_n, out.first_cpu = now, count, cpu
            if split and known:
                out.threads_first = thread_stats(known[0])
        out.final, out.cpu = count, cpu
        if count:
            out.samples.append((now, count, cpu))
        if split and known and out.first_t is not None:
            # at every poll: the plain pipeline's threads may be gone by the poll that sees its last row
            out.threads_done.update(thread_stats(known[0]))
            if not out.thread_names and count >= n // 2:
                out.thread_names = thread_names(known[0])     # mid-run: every thread is up
        if count >= n:
            out.done_t = now
            break
        time.sleep(interval)
    out.fetched = db_count(db, "results", "status = 'fetched'")
    return out


# -- crawld -------------------------------------------------------------------------------------
def run_crawld(env: Env, transport: str, urls: list[str], timeout: float,
               profile: Path | None = None, extra_env: dict[str, str] | None = None,
               gate: Callable[[], object] | None = None,
               prepare: Callable[[CrawldSetup], object] | None = None, split: bool = False) -> Track:
    nats = env.new_nats() if transport == "jetstream" else None
    setup = crawld_setup(env, "cp", transport=transport, broker_url=nats.url if nats else None,
                         workers=1, threads=THREADS, prefetch=PREFETCH)
    try:
        crawld_publish(setup, urls)
        if prepare is not None:
            prepare(setup)
        if gate is not None:
            gate()            # --together: every contender published, all start now
        started = time.perf_counter()
        sup = start_crawld(env, setup, 1, extra_env=extra_env)
        spy = None
        workers = lambda: children_of(sup.pid)   # noqa: E731  (the forked worker, not the supervisor)
        if profile is not None:
            spy = start_profile(env, sup, setup.db, profile, transport)
        result = track(setup.db, len(urls), started, workers, sup, timeout, split=split)
        if spy is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(60)                  # both samples taken (the crawl may end first)
            stop_proc(spy, timeout=10)
        stop_proc(sup, timeout=60)
        result.left = left_in_broker(nats.url if nats else env.rabbit.url, "CRAWL" if nats else setup.queue)
        return result
    finally:
        if nats is not None:
            env.drop_nats(nats)
        else:
            amqp_delete_setup(setup)


def left_in_broker(url: str, name: str) -> int | None:
    """Ready + unacked messages of an AMQP queue, or messages of a WorkQueue stream (an acked
    message leaves it): 0 when every task was acked."""
    with contextlib.suppress(Exception):
        return js_stream_messages(url, name) if url.startswith("nats") else amqp_depth(url, name)
    return None


PROFILES = (("gil", ["--native", "--gil"], "the thread holding the GIL (interpreter CPU)"),
            ("all", ["--native"], "all active threads, GIL waits included"),
            # Python frames only: cheaper to sample, so more GIL samples in the same 8 s.
            ("gil-py", ["--gil"], "the thread holding the GIL, Python frames only"))


def start_profile(env: Env, sup: subprocess.Popen, db: Path, out: Path,
                  transport: str) -> subprocess.Popen | None:
    """Once the worker stores rows, py-spy record it three times, 8 s each: the GIL holder
    and all active threads with native frames, then the GIL holder without (a shell runs
    them one after the other; one process to stop)."""
    from benchlib import wait_until
    if shutil.which("py-spy") is None:
        return None
    wait_until(lambda: children_of(sup.pid), 30, what="the worker process")
    wait_until(lambda: db_count(db) > 200, 60, what="the worker to store results")
    worker = children_of(sup.pid)[0]
    out.mkdir(parents=True, exist_ok=True)
    cmds = [" ".join(["py-spy", "record", "--pid", str(worker), *flags, "--duration", "8",
                      "--rate", "100", "--format", "speedscope", "--output",
                      str(out / f"crawld-worker-{transport}.{name}.speedscope.json")])
            for name, flags, _ in PROFILES]
    return env.spawn(["sh", "-c", " ; ".join(cmds)], log=out / "py-spy.log")


Top = list[tuple[str, float]]


def speedscope_top(path: Path, top: int = 12) -> tuple[float, Top, Top, Top]:
    """(sampled seconds, top frames by self %, top Python frames by self % (native frames
    below them folded in), top crawld functions by total %) over all threads of a py-spy
    speedscope file. A function is ``name (file)``; total counts it once per sample;
    unsymbolised native addresses are grouped per library."""
    from collections import Counter
    data = json.loads(path.read_text())
    frames = [_frame_name(f) for f in data["shared"]["frames"]]
    python = [f.get("file", "").endswith(".py") for f in data["shared"]["frames"]]
    self_c: Counter[str] = Counter()
    py_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    samples = 0.0
    for prof in data["profiles"]:
        for stack, weight in zip(prof["samples"], prof["weights"]):
            if not stack:
                continue
            samples += weight
            self_c[frames[stack[-1]]] += weight
            py_leaf = next((frames[i] for i in reversed(stack) if python[i]), frames[stack[-1]])
            py_c[py_leaf] += weight
            for name in {frames[i] for i in stack}:
                if "(crawld/" in name:       # thread bootstraps and the like are ~100% anyway
                    total_c[name] += weight
    pct = lambda c: [(k, 100.0 * v / samples) for k, v in c.most_common(top)]   # noqa: E731
    return samples, pct(self_c), pct(py_c), pct(total_c)


def _frame_name(frame: dict) -> str:
    name, file = frame["name"], _short(frame.get("file", ""))
    if name.startswith("0x"):
        name = "[unsymbolised]"
    return f"{name} ({file})"


def _short(file: str) -> str:
    """Path from the package on (crawld/..., urllib3/..., or the stdlib file name)."""
    for marker in ("/crawld/", "/site-packages/"):
        if marker in file:
            return file.split(marker, 1)[1] if marker == "/site-packages/" else "crawld/" + file.split(marker, 1)[1]
    return file.rsplit("/", 1)[-1]


def profile_tables(out: Path) -> list[Table]:
    tables = []
    for transport, (name, _, label) in itertools.product(("amqp", "jetstream"), PROFILES):
        path = out / f"crawld-worker-{transport}.{name}.speedscope.json"
        if not path.exists():
            continue
        seconds, self_top, py_top, total_top = speedscope_top(path)
        flags = " ".join(next(f for n, f, _ in PROFILES if n == name))
        table = Table(f"py-spy {flags}, crawld worker ({transport}): {label}; "
                      f"{seconds:.1f} thread-seconds sampled over 8 s",
                      ["frame (self)", "% self", "Python frame (self, native folded in)", "% self",
                       "crawld function (total)", "% total"])
        for i in range(max(len(self_top), len(py_top), len(total_top))):
            cells = [col[i] if i < len(col) else ("", None) for col in (self_top, py_top, total_top)]
            table.add(*(v for cell in cells for v in cell))
        tables.append(table)
    return tables


# -- the plain pipeline -------------------------------------------------------------------------------
def plain_bodies(urls: list[str]) -> list[bytes]:
    """The same message shape crawld publishes (task id, url, round, source, enqueued_at)."""
    import hashlib
    now = time.time()
    return [json.dumps({"task_id": hashlib.sha256(u.encode()).hexdigest()[:32], "url": u, "round": "b",
                        "source": "bench", "enqueued_at": now}).encode() for u in urls]


def js_publish_acked(url: str, subject: str, bodies: list[bytes], window: int = 500) -> None:
    """JetStream publishes with PubAcks awaited in windows: core publishes can be dropped by
    a busy server, and both contenders must start from the same full backlog."""
    import asyncio

    import nats

    async def main() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        for i in range(0, len(bodies), window):
            await asyncio.gather(*(js.publish(subject, b, timeout=30) for b in bodies[i:i + window]))
        await nc.close()
    asyncio.run(main())


def run_plain(env: Env, transport: str, urls: list[str], timeout: float,
              gate: Callable[[], object] | None = None, split: bool = False) -> Track:
    directory = env.scenario_dir("pp")
    name = directory.name
    db, bodies = directory / "plain.db", directory / "bodies"
    nats = env.new_nats() if transport == "jetstream" else None
    try:
        if nats is None:
            amqp_publish_raw(env.rabbit.url, name, plain_bodies(urls))
            args = ["amqp", env.rabbit.url, name]
        else:
            js_stream(nats.url, "PLAIN", "plain.url", durable=name)
            js_publish_acked(nats.url, "plain.url.bench", plain_bodies(urls))
            if js_stream_messages(nats.url, "PLAIN") < len(urls):
                raise RuntimeError("not every plain JetStream publish reached the stream")
            args = ["jetstream", nats.url, "PLAIN", name]
        cmd = [PY, str(BENCH_DIR / "plain_pipeline.py"), *args, str(db), str(bodies),
               "--expect", str(len(urls)), "--threads", str(THREADS), "--prefetch", str(PREFETCH),
               "--max-seconds", str(timeout), "--linger", "30"]
        if gate is not None:
            gate()
        started = time.perf_counter()
        proc = env.spawn(cmd, log=directory / "plain.log")
        result = track(db, len(urls), started, lambda: [proc.pid], proc, timeout, split=split)
        stop_proc(proc, timeout=30)
        result.left = left_in_broker(nats.url if nats else env.rabbit.url, "PLAIN" if nats else name)
        result.errors = [l for l in (directory / "plain.log").read_text(errors="replace").splitlines()
                         if l.startswith(("error:", "Traceback"))]
        return result
    finally:
        if nats is not None:
            env.drop_nats(nats)
        else:
            amqp_delete(env.rabbit.url, name)


# -- the comparison ------------------------------------------------------------------------------------
# crawld with the two default outputs a plain pipeline does not have turned off (events, WARC
# instead of one file per body): shows how much of the gap is those defaults, not the core path.
LEAN_ENV = {"CRAWLD_STORE_BODIES": "files", "CRAWLD_OUTPUT_EVENTS": "false"}


def body_dirs_made(setup: CrawldSetup) -> None:
    store_dirs_made(setup.dir / "bodies")


def abba(rounds: int, contenders: list[str]) -> list[str]:
    """crawld, plain, plain, crawld, ...: forward then reversed, so each runs early and late."""
    order: list[str] = []
    for r in range(rounds):
        order += contenders if r % 2 == 0 else contenders[::-1]
    return order


WARMUP = 1000


def at_once(run: Callable[[str, Callable[[], object] | None], Track], group: list[str]) -> list[Track]:
    """``run(who, gate)`` for every contender of ``group`` at the same time (one alone:
    inline). Each calls ``gate()`` once its tasks are published, so all start together, and
    the steady figures of each cover only the window in which all of them were storing
    rows (the first to finish would otherwise leave the others a tail alone)."""
    if len(group) == 1:
        return [run(group[0], None)]
    results: dict[str, Track] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(group), timeout=900)

    def one(who: str) -> None:
        try:
            results[who] = run(who, barrier.wait)
        except BaseException as exc:      # re-raised below, on the bench's own thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(who,), name=f"bench-{who}") for who in group]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    tracks = [results[who] for who in group]
    firsts = [t.first_t for t in tracks if t.first_t is not None]
    ends = [t.done_t for t in tracks if t.done_t is not None]
    if len(firsts) == len(ends) == len(tracks):
        for t in tracks:
            t.narrow(max(firsts), min(ends))
    return tracks


def mean(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return sum(real) / len(real) if real else None


def compare(env: Env, transport: str, n: int, rounds: int, table: Table, section: Section,
            profile: Path | None, lean: bool = False, baseline: str | None = None,
            warmup: int = 0, together: bool = False, threads: Table | None = None) -> None:
    site = env.nginx(pages=n)
    urls = [site.page_url(i) for i in range(n)]
    timeout = 60 + n / 50
    if warmup:
        # Uncounted: the first run on a fresh broker and site was the slowest of its kind,
        # and crawld always runs first in the ABBA order.
        run_plain(env, transport, urls[:warmup], timeout)
        run_crawld(env, transport, urls[:warmup], timeout)
    contenders = (["crawld", "plain"] + (["crawld-lean", "crawld-lean-warm"] if lean else [])
                  + (["crawld-base"] if baseline else []))
    runs: dict[str, list[Track]] = {who: [] for who in contenders}

    def run_one(who: str, gate: Callable[[], object] | None) -> Track:
        split = threads is not None
        if who == "crawld":
            spy = profile if (profile is not None and not runs["crawld"]) else None
            return run_crawld(env, transport, urls, timeout, spy, gate=gate, split=split)
        if who in ("crawld-lean", "crawld-lean-warm"):
            prepare = body_dirs_made if who == "crawld-lean-warm" else None
            return run_crawld(env, transport, urls, timeout, extra_env=LEAN_ENV, gate=gate, prepare=prepare,
                              split=split)
        if who == "crawld-base":
            return run_crawld(env, transport, urls, timeout,
                              extra_env={"PYTHONPATH": str(Path(baseline or "") / "daemon")}, gate=gate,
                              split=split)
        return run_plain(env, transport, urls, timeout, gate=gate, split=split)

    schedule = ([contenders if r % 2 == 0 else contenders[::-1] for r in range(rounds)] if together
                else [[who] for who in abba(rounds, contenders)])
    for i, group in enumerate(schedule):
        for who, result in zip(group, at_once(run_one, group)):
            runs[who].append(result)
            if result.done_t is None:
                section.notes.append(f"{transport} {who} round {i + 1}: only {result.final}/{n} rows before the timeout")
            if result.errors:
                section.notes.append(f"{transport} {who} round {i + 1}: {len(result.errors)} fetch error(s), "
                                     f"retried; first: {result.errors[0][:200]}")
            table.add(transport, who, len(runs[who]), result.final, result.wall_rate, result.steady_rate,
                      result.fetched, result.left, result.cpu_ms_all, result.cpu_ms_steady)
            if threads is not None and (by_thread := thread_split(result)) is not None:
                threads.add(transport, who, len(runs[who]), *(by_thread[k] for k in SPLIT_COLUMNS))
    summarise(transport, runs, section)


def summarise(transport: str, runs: dict[str, list[Track]], section: Section) -> None:
    rate = {w: mean([t.steady_rate for t in ts]) for w, ts in runs.items()}
    cpu = {w: mean([t.cpu_ms_steady for t in ts]) for w, ts in runs.items()}
    cpu_all = {w: mean([t.cpu_ms_all for t in ts]) for w, ts in runs.items()}
    for w in runs:
        section.data[f"{transport}_{w}_rate"] = rate[w]
        section.data[f"{transport}_{w}_cpu_ms"] = cpu[w]
        section.data[f"{transport}_{w}_cpu_ms_all"] = cpu_all[w]
    section.ratios.append(Ratio(f"crawld 1 worker / plain pipeline, {transport}, steady pages/s",
                                ratio(rate["crawld"], rate["plain"]), ">= 0.8x", 0.8))
    # Best round of each: the round a neighbour's load disturbed least (bench_publish does the same).
    best = {w: max((t.steady_rate for t in ts if t.steady_rate), default=None) for w, ts in runs.items()}
    section.ratios.append(Ratio(f"crawld / plain, {transport}, best round of each, steady pages/s",
                                ratio(best["crawld"], best["plain"])))
    section.ratios.append(Ratio(f"crawld / plain worker CPU per task (steady), {transport}",
                                ratio(cpu["crawld"], cpu["plain"]), "<= 1.25x", 1.25, higher_is_better=False))
    section.ratios.append(Ratio(f"crawld / plain worker CPU per task (whole process life), {transport}",
                                ratio(cpu_all["crawld"], cpu_all["plain"])))
    if "crawld-base" in runs:
        section.ratios.append(Ratio(f"crawld / crawld-base (this checkout vs the baseline), {transport}, steady pages/s",
                                    ratio(rate["crawld"], rate["crawld-base"])))
        section.ratios.append(Ratio(f"crawld / crawld-base worker CPU per task (steady), {transport}",
                                    ratio(cpu["crawld"], cpu["crawld-base"]), higher_is_better=False))
    for lean in ("crawld-lean", "crawld-lean-warm"):
        if lean not in runs:
            continue
        section.ratios.append(Ratio(f"{lean} (files, no events) / plain pipeline, {transport}, steady pages/s",
                                    ratio(rate[lean], rate["plain"])))
        section.ratios.append(Ratio(f"{lean} / plain worker CPU per task (steady), {transport}",
                                    ratio(cpu[lean], cpu["plain"]), higher_is_better=False))


def measure(env: Env, args: argparse.Namespace, section: Section) -> None:
    n = args.tasks or (2000 if args.quick else 8000)
    table = Table(f"crawld 1 worker vs the plain pipeline, {n:,} tasks from nginx (1 site, ~2 KB pages), "
                  f"{THREADS} threads, prefetch {PREFETCH}, ABBA rounds (--together: all at once)",
                  ["transport", "contender", "round", "rows", "wall/s", "steady/s",
                   "fetched", "left in broker", "CPU ms/task (all)", "CPU ms/task (steady)"])
    section.tables.append(table)         # first: a failed transport still shows the rows so far
    threads = None
    if args.threads:
        threads = Table("worker CPU (ms) and context switches (sw) per stored row, by thread, steady window "
                        "(/proc/<pid>/task; threads named by py-spy dump)", ["transport", "contender", "round", *SPLIT_COLUMNS])
        section.tables.append(threads)
    for transport in args.transports.split(","):
        compare(env, transport, n, args.rounds, table, section, Path(args.profile) if args.profile else None,
                args.lean, args.baseline, min(args.warmup, n), args.together, threads)
    if args.warmup:
        section.notes.append(f"before the rounds of each transport, one uncounted warm-up run of the plain "
                             f"pipeline and of crawld on the first {min(args.warmup, n):,} URLs (--warmup 0: none)")
    section.notes.append("crawld runs with its defaults for robots, the SSRF guard, the body store "
                         "(store.bodies = warc) and output.events (on); the plain pipeline writes one "
                         "file per body and publishes no events. CPU is user+system of the worker "
                         "process(es) from /proc; 'steady' is the same window as steady/s.")
    if args.together:
        section.notes.append("--together: in each round every contender ran at the same time (own queue or "
                             "stream, own store, the same nginx pages; all started once all had published), "
                             "so the machine's slow and fast phases hit them alike; steady/s and CPU (steady) "
                             "cover only the window in which all of them were storing rows. Each had a share "
                             "of the two cores: the rates are lower than alone, only their ratios compare.")
    if args.lean:
        section.notes.append("crawld-lean: the same crawld with CRAWLD_STORE_BODIES=files and "
                             "CRAWLD_OUTPUT_EVENTS=false, i.e. the outputs the plain pipeline lacks turned off. "
                             "crawld-lean-warm: the same with the files store's 65,536 directories (ab/cd/) made "
                             "before the run, as on a store past its first bodies (the plain pipeline's one "
                             "level has 256).")
    if args.profile:
        section.tables.extend(profile_tables(Path(args.profile)))
        section.notes.append(f"py-spy --native speedscope profile of the first crawld round of each transport in {args.profile} "
                             f"(py-spy pauses the process to sample: that round's rate is not comparable)")


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None,
        args: argparse.Namespace | None = None) -> Section:
    args = args or parse_args(["--quick"] if quick else [])
    return run_section(KEY, "crawld 1 worker vs the same work written plainly (nginx pages)",
                       command_line(args), lambda s: measure(env, args, s))


def command_line(args: argparse.Namespace) -> str:
    out = COMMAND + (" --quick" if args.quick else "")
    out += f" --tasks {args.tasks}" if args.tasks else ""
    out += f" --rounds {args.rounds}" if args.rounds != 2 else ""
    out += f" --transports {args.transports}" if args.transports != "amqp,jetstream" else ""
    out += " --lean" if args.lean else ""
    out += f" --warmup {args.warmup}" if args.warmup != WARMUP else ""
    out += f" --baseline {args.baseline}" if args.baseline else ""
    out += " --together" if args.together else ""
    out += " --threads" if args.threads else ""
    return out + (f" --profile {args.profile}" if args.profile else "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 tasks instead of 8,000")
    parser.add_argument("--tasks", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per transport")
    parser.add_argument("--transports", default="amqp,jetstream")
    parser.add_argument("--md", help="also write the section as markdown to this file")
    parser.add_argument("--lean", action="store_true",
                        help="also run crawld with store.bodies=files and output.events=false")
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help="tasks of one uncounted run of each kind before the rounds (0: none)")
    parser.add_argument("--baseline", help="also run crawld from this checkout (its daemon/ on PYTHONPATH)")
    parser.add_argument("--profile", help="py-spy the crawld worker in the first round of each transport into DIR")
    parser.add_argument("--threads", action="store_true",
                        help="also split each worker's CPU by thread (connection, commit, pool, other)")
    parser.add_argument("--together", action="store_true",
                        help="run the contenders of each round at the same time instead of one after another")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return transports_bench_main(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
