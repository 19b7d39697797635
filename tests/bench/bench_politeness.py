"""Host-wide politeness (fetch/politeness.py, the flock files of ``partition = none``): the
cost of one request's slot and start time when worker processes share a host.

    python tests/bench/bench_politeness.py [--quick] [--baseline CHECKOUT] [--md FILE]

P processes (1, 2, 3) x 16 threads, one host, per_host_concurrency 256 (and 32 at P = 2):
each thread takes a slot, holds it 1 ms (a request), lets it go, N times. For each process:
``open`` and ``flock`` calls per request (counted by wrapping the module's ``os.open`` and
``fcntl.flock``) and its CPU per request (process time). ``--baseline CHECKOUT`` runs the
same from another checkout's ``daemon/`` (e.g. a ``git worktree`` of the commit before a
change), for a before/after. No broker and no site: HostLimiter alone, real flock files in
a temporary run_dir.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import PY, REPO_DIR, Env, Section, Table, run_section

KEY = "politeness"
COMMAND = "python tests/bench/bench_politeness.py"
THREADS = 16
SHAPES = ((1, 256), (2, 256), (3, 256), (2, 32))      # (processes, per_host_concurrency)

# One process of the run: counts its own opens and flocks, prints one JSON line.
CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from crawld.fetch import politeness
run_dir, concurrency, threads, requests, go = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
calls = {"open": 0, "flock": 0}
real_open, real_flock = os.open, politeness.fcntl.flock

class Os:
    def __getattr__(self, name):
        return getattr(os, name)
    @staticmethod
    def open(path, *args):
        calls["open"] += 1
        return real_open(path, *args)

class Fcntl:
    LOCK_EX, LOCK_NB, LOCK_UN = politeness.fcntl.LOCK_EX, politeness.fcntl.LOCK_NB, politeness.fcntl.LOCK_UN
    @staticmethod
    def flock(fd, op):
        calls["flock"] += 1
        return real_flock(fd, op)

politeness.os, politeness.fcntl = Os(), Fcntl
limiter = politeness.HostLimiter(run_dir, concurrency)

def work():
    for _ in range(requests):
        with limiter.acquire("127.0.0.1", wait_s=60):
            time.sleep(0.001)

while not os.path.exists(go):       # all processes start together
    time.sleep(0.005)
workers = [threading.Thread(target=work) for _ in range(threads)]
cpu = time.process_time()
for t in workers:
    t.start()
for t in workers:
    t.join()
n = threads * requests
print(json.dumps({"open": calls["open"] / n, "flock": calls["flock"] / n,
                  "cpu_us": 1e6 * (time.process_time() - cpu) / n}))
"""


def one_shape(daemon: Path, processes: int, concurrency: int, requests: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="crawld-bench-politeness-") as tmp:
        go = Path(tmp) / "go"
        procs = [subprocess.Popen([PY, "-c", CHILD, str(daemon), str(Path(tmp) / "run"), str(concurrency),
                                   str(THREADS), str(requests), str(go)], stdout=subprocess.PIPE, text=True)
                 for _ in range(processes)]
        go.touch()
        return [json.loads(p.communicate(timeout=600)[0]) for p in procs]


def measure(args: argparse.Namespace, section: Section) -> None:
    requests = 100 if args.quick else 300
    checkouts = [("this checkout", REPO_DIR / "daemon")]
    if args.baseline:
        checkouts.append(("baseline", Path(args.baseline) / "daemon"))
    table = Table(f"HostLimiter, {THREADS} threads per process on one host, {requests} requests each "
                  f"(hold 1 ms): per request, each process", ["daemon", "processes", "per_host_concurrency",
                                                              "open", "flock", "CPU us"])
    section.tables.append(table)
    for processes, concurrency in SHAPES:
        for name, daemon in checkouts:
            for r in one_shape(daemon, processes, concurrency, requests):
                table.add(name, processes, concurrency, r["open"], r["flock"], r["cpu_us"])
    section.notes.append("with no gap to keep (per_host_delay_s 0, no Crawl-delay, as here) a request "
                         "reads the host's state record through a mapping, with no open and no lock of "
                         "it (since the twentieth session; the state file was opened and locked once "
                         "per request before); every open and flock counted is then a slot file's")


def run(env: Env | None, quick: bool, ctx: dict[str, Section] | None = None,
        args: argparse.Namespace | None = None) -> Section:
    args = args or parse_args(["--quick"] if quick else [])
    command = COMMAND + (" --quick" if args.quick else "") + (f" --baseline {args.baseline}" if args.baseline else "")
    return run_section(KEY, "host-wide politeness: slot and start-time cost per request", command,
                       lambda s: measure(args, s))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 requests per thread instead of 300")
    parser.add_argument("--baseline", help="also run HostLimiter from this checkout (its daemon/)")
    parser.add_argument("--md", help="also write the section as markdown to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    section = run(None, False, args=args)
    if args.md:
        Path(args.md).write_text(section.markdown())
    return 1 if section.error else 0


if __name__ == "__main__":
    sys.exit(main())
