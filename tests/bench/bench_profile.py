"""Profile one crawld worker under the end-to-end load with py-spy (sampling, from outside).

    python tests/bench/bench_profile.py [--quick] [--keep DIR]

``crawld run --workers 1`` works through a backlog of /fast/ pages (as in bench_e2e.py);
once it is storing results, py-spy samples the worker process twice:

* ``--idle`` (all threads, waiting included): where the worker's threads spend wall time;
* ``--gil`` (only the thread holding the GIL): what uses the interpreter.

Each table lists the top leaf frames (self) and the top crawld functions (inclusive), in
percent of samples. The raw collapsed stacks are kept with --keep DIR (flamegraph input).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchlib import (Env, Section, Table, amqp_delete_setup, children_of, crawld_publish, crawld_setup,
                      db_count, run_section, start_crawld, stop_proc, wait_rows, wait_until)

KEY = "profile"
COMMAND = "python tests/bench/bench_profile.py"
TOP = 12


def summarise(path: Path) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """(samples, top self frames with line, top inclusive crawld functions) from py-spy raw output."""
    self_count: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f for f in stack.split(";") if "(" in f]
        if not frames:
            continue
        self_count[frames[-1]] += n
        seen = set()
        for frame in frames:
            name, _, where = frame.partition(" (")
            file = where.rsplit(":", 1)[0]
            if file.startswith("crawld/"):
                seen.add(f"{name} ({file})")
        for key in seen:
            incl[key] += n
    pct = lambda c: [(k, 100.0 * v / total) for k, v in c.most_common(TOP)]   # noqa: E731
    return total, pct(self_count), pct(incl)


def pyspy(pid: int, out: Path, seconds: int, mode: str) -> str:
    cmd = ["py-spy", "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200",
           "--format", "raw", "--output", str(out), "--nonblocking", mode]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-500:]}")
    return out.read_text()


def measure(env: Env, quick: bool, section: Section, keep: str | None = None) -> None:
    if shutil.which("py-spy") is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    seconds = 4 if quick else 8
    n = 4000 if quick else 9000
    setup = crawld_setup(env, "prof")
    try:
        crawld_publish(setup, [f"{env.site}/fast/{setup.queue}/{i}" for i in range(n)])
        started = time.perf_counter()
        sup = start_crawld(env, setup, 1)
        wait_until(lambda: children_of(sup.pid), 30, what="the worker process")
        worker = children_of(sup.pid)[0]
        wait_until(lambda: db_count(setup.db) > 300, 60, what="the worker to store results")
        outputs = {}
        for mode in ("--idle", "--gil"):
            out = setup.dir / f"pyspy{mode.replace('-', '_')}.txt"
            pyspy(worker, out, seconds, mode)
            outputs[mode] = out
        progress = wait_rows(setup.db, n, started, timeout=300, proc=sup)
        stop_proc(sup, timeout=60)
        section.data["steady"] = progress.steady_rate
        for mode, label in (("--idle", "all threads, waiting included (wall time)"),
                            ("--gil", "thread holding the GIL (interpreter time)")):
            total, self_top, incl_top = summarise(outputs[mode])
            table = Table(f"py-spy {mode}: {label}; {total:,} samples over {seconds} s",
                          ["leaf frame (self)", "% self", "crawld function (inclusive)", "% incl"])
            for i in range(TOP):
                s = self_top[i] if i < len(self_top) else ("", None)
                c = incl_top[i] if i < len(incl_top) else ("", None)
                table.add(s[0], s[1], c[0], c[1])
            section.tables.append(table)
            section.data[f"top{mode}"] = self_top[:5]
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for out in outputs.values():
                shutil.copy(out, Path(keep) / out.name)
            section.notes.append(f"raw collapsed stacks kept in {keep} (e.g. flamegraph.pl or speedscope)")
        section.notes.append(f"Worker throughput during the run (with py-spy attached, --nonblocking): "
                             f"{progress.steady_rate:,.0f} results/s.")
    finally:
        amqp_delete_setup(setup)


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None, keep: str | None = None) -> Section:
    return run_section(KEY, "Profile of a crawld worker under the E2E load (py-spy)",
                       COMMAND + (" --quick" if quick else ""), lambda s: measure(env, quick, s, keep))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep", help="copy the raw py-spy stacks into this directory")
    args = parser.parse_args(argv)
    with Env(("rabbit", "site")) as env:
        section = run(env, args.quick, keep=args.keep)
    return 1 if section.error else 0


if __name__ == "__main__":
    sys.exit(main())
