"""Where one crawld worker's pool threads spend CPU per task, stage by stage.

    python tests/bench/bench_stages.py [--transport amqp|jetstream] [--tasks 8000] [--defaults]

One ``crawld run --workers 1`` (16 threads, prefetch 16, as bench_plain.py) works through
nginx pages twice: once plain, for its rate and CPU per task, and once with the stage
profiler (stageprof/sitecustomize.py on PYTHONPATH), which adds each wrapped method's
thread CPU and wall time per call. The table gives, per stored task, calls, thread CPU and
wall time of each stage, inclusive (``Fetcher.fetch`` contains ``Fetcher._exchange``).
The wrappers cost ~1-2 us a call: compare stages, and read the unprofiled run for scale.
crawld runs lean (files, no events, a warm body store) unless ``--defaults``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from bench_plain import LEAN_ENV, body_dirs_made, run_crawld
from benchlib import Env

STAGEPROF = Path(__file__).resolve().parent / "stageprof"


def stage_table(directory: Path) -> tuple[int, list[tuple[str, float, float, float]]]:
    """(tasks, [(stage, calls per task, CPU us per task, wall us per task)]) of the worker
    whose dump counted the most tasks (the supervisor writes none)."""
    tasks, best = 0, {}
    for path in directory.glob("stages-*.json"):
        table = json.loads(path.read_text())
        n = table.get("Worker._process", [0])[0]
        if n > tasks:
            tasks, best = n, table
    rows = [(label, calls / tasks, cpu / tasks / 1e3, wall / tasks / 1e3)
            for label, (calls, cpu, wall) in best.items()] if tasks else []
    return tasks, sorted(rows, key=lambda row: -row[2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=("amqp", "jetstream"), default="amqp")
    parser.add_argument("--tasks", type=int, default=8000)
    parser.add_argument("--defaults", action="store_true", help="crawld's defaults (WARC, events)")
    args = parser.parse_args(argv)
    lean = {} if args.defaults else dict(LEAN_ENV)
    prepare = None if args.defaults else body_dirs_made
    with Env(("rabbit",) if args.transport == "amqp" else ()) as env:
        site = env.nginx(pages=args.tasks)
        urls = [site.page_url(i) for i in range(args.tasks)]
        dump = env.scenario_dir("stages")
        print(f"[stages] warm-up, then unprofiled, then profiled: {args.tasks} tasks each, "
              f"{args.transport}, {'defaults' if args.defaults else 'lean (files, no events)'}", flush=True)
        run_crawld(env, args.transport, urls[:1000], 300, extra_env=lean, prepare=prepare)
        runs = {}
        for name, extra in (("unprofiled", {}), ("profiled", {
                "CRAWLD_STAGEPROF": str(dump),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(STAGEPROF), os.environ.get("PYTHONPATH")]))})):
            runs[name] = run_crawld(env, args.transport, urls, 300, extra_env={**lean, **extra}, prepare=prepare)
            print(f"[stages] {name}: steady {runs[name].steady_rate:.0f} pages/s, "
                  f"worker CPU {runs[name].cpu_ms_steady:.2f} ms per task", flush=True)
        tasks, rows = stage_table(dump)
        shutil.rmtree(dump, ignore_errors=True)
    if not tasks:
        print("no stage dump found: did the worker start with the profiler?", file=sys.stderr)
        return 1
    print(f"\nper task, over {tasks} tasks of the profiled run (inclusive)")
    print(f"{'stage':36s} {'calls':>6s} {'CPU us':>8s} {'wall us':>9s}")
    for label, calls, cpu, wall in rows:
        print(f"{label:36s} {calls:6.2f} {cpu:8.1f} {wall:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
