"""Body stores side by side: WARC files vs one file per body, same run, same site.

    python tests/bench/bench_output.py [--quick]

1. End to end: ``crawld run`` (AMQP, 1 and 2 workers) over N /fast/ pages with
   ``store.bodies = "files"`` and ``"warc"`` (events off in both, so only the body store
   differs), interleaved files, warc, files, warc and the best steady rate of each kept;
   plus WARC with result events on (the new default) for reference.
2. Files on disk for 100,000 pages, counted after actually writing them: the files store
   (``Store.save_body``: one file per body plus its two directory levels) and the WARC
   writer (``WarcFileWriter`` at the default 1 GiB ``warc_max_bytes``) with the same
   100,000 bodies of ~30 KB HTML (64 templates, each page made unique by its URL line, so
   gzip sees realistic text and no payload is deduplicated into a revisit).
"""
from __future__ import annotations

import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import (Env, Ratio, Section, Table, amqp_delete_setup, bench_main, crawld_publish,
                      crawld_setup, ratio, run_section, start_crawld, stop_proc, wait_rows)

KEY = "output"
COMMAND = "python tests/bench/bench_output.py"
PAGE_BYTES = 30_000
COUNT_PAGES = 100_000


def e2e(env: Env, bodies: str, events: bool, workers: int, n: int) -> float | None:
    setup = crawld_setup(env, f"out-{bodies}", workers=workers)
    try:
        urls = [f"{env.site}/fast/{setup.queue}/{i}" for i in range(n)]
        crawld_publish(setup, urls)
        started = time.perf_counter()
        proc = start_crawld(env, setup, workers, extra_env={
            "CRAWLD_STORE_BODIES": bodies, "CRAWLD_OUTPUT_EVENTS": "true" if events else "false"})
        progress = wait_rows(setup.db, n, started, timeout=60 + n / 40, proc=proc)
        stop_proc(proc, timeout=90)
        if progress.done_t is None:
            raise RuntimeError(f"{bodies}: only {progress.final}/{n} results (log {setup.dir}/run.log)")
        return progress.steady_rate
    finally:
        amqp_delete_setup(setup)


def measure_e2e(env: Env, quick: bool, section: Section) -> None:
    n = 1500 if quick else 5000
    table = Table(f"crawld run, {n:,} /fast/ pages, AMQP, 16 threads per worker: steady results/s "
                  "(best of 2 interleaved runs)",
                  ["workers", "files", "warc", "warc / files", "warc + events", "(warc+events) / files"])
    for workers in (1, 2):
        best: dict[str, float] = {}
        for _ in range(2):
            for bodies in ("files", "warc"):
                rate = e2e(env, bodies, False, workers, n) or 0.0
                best[bodies] = max(best.get(bodies, 0.0), rate)
        with_events = e2e(env, "warc", True, workers, n)
        table.add(workers, best["files"], best["warc"], ratio(best["warc"], best["files"]),
                  with_events, ratio(with_events, best["files"]))
        section.ratios.append(Ratio(f"WARC / files body store, {workers} worker(s)",
                                    ratio(best["warc"], best["files"]), ">= 1.0x", 1.0))
    section.tables.append(table)


def html_templates(count: int = 64) -> list[bytes]:
    rng = random.Random(15)
    words = ["crawl", "archive", "page", "link", "index", "record", "worker", "queue", "fetch",
             "store", "the", "of", "and", "to", "in", "a", "is", "that", "for", "with", "news",
             "article", "market", "science", "weather", "sport", "music", "policy", "data"]
    out = []
    for _ in range(count):
        parts, size = [b"<!doctype html><html><head><title>t</title></head><body>"], 0
        while size < PAGE_BYTES:
            para = " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
            href = f'<a href="/p/{rng.randrange(10**9)}">{rng.choice(words)}</a>'
            chunk = f"<p class=\"c{rng.randrange(50)}\">{para} {href}</p>\n".encode()
            parts.append(chunk)
            size += len(chunk)
        out.append(b"".join(parts) + b"</body></html>")
    return out


def pages(templates: list[bytes]) -> Any:
    for i in range(COUNT_PAGES):
        yield f"http://site{i % 500}.example/p/{i}", templates[i % len(templates)] + f"<!-- {i} -->".encode()


def count_files(root: Path) -> tuple[int, int, int]:
    """(regular files, directories below root, bytes)."""
    files = dirs = size = 0
    for _base, dirnames, filenames in os.walk(root):
        dirs += len(dirnames)
        files += len(filenames)
        size += sum(os.path.getsize(os.path.join(_base, f)) for f in filenames)
    return files, dirs, size


def measure_files(env: Env, section: Section) -> None:
    from crawld.output.warc import Exchange, WarcFileWriter
    from crawld.store import SQLiteStore
    templates = html_templates()
    root = env.scenario_dir("count")
    table = Table(f"Files on disk for {COUNT_PAGES:,} pages of ~{PAGE_BYTES // 1000} KB HTML "
                  "(written for real, then counted)",
                  ["body store", "files", "directories", "MB on disk", "write s"])
    body_dir = root / "bodies"
    store = SQLiteStore(root / "x.db", str(body_dir))
    started = time.perf_counter()
    for _url, body in pages(templates):
        store.save_body(body)
    files_s = time.perf_counter() - started
    store.close()
    files, dirs, size = count_files(body_dir)
    table.add("files (body_dir/ab/cd/sha256)", files, dirs, size / 1e6, files_s)
    shutil.rmtree(body_dir)

    warc_dir = root / "warc"
    headers = [("Content-Type", "text/html; charset=utf-8")]
    started = time.perf_counter()
    with WarcFileWriter(str(warc_dir)) as writer:
        for url, body in pages(templates):
            writer.write_fetch([Exchange(url, 200, "OK", response_headers=headers, payload=body,
                                         request_headers=[("User-Agent", "crawld")],
                                         ip_address="192.0.2.1")])
    warc_s = time.perf_counter() - started
    files, dirs, size = count_files(warc_dir)
    table.add("warc (warc_max_bytes 1 GiB)", files, dirs, size / 1e6, warc_s)
    shutil.rmtree(warc_dir)
    section.tables.append(table)
    section.notes.append("The files store also leaves a SQLite row per page either way; the WARC "
                         "figure includes every request record and the warcinfo record of each file.")


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None) -> Section:
    def body(section: Section) -> None:
        measure_e2e(env, quick, section)
        measure_files(env, section)
    return run_section(KEY, "Body store: WARC files vs one file per body",
                       COMMAND + (" --quick" if quick else ""), body)


def main(argv: list[str] | None = None) -> int:
    return bench_main(KEY, run, needs=("rabbit", "site"), argv=argv)


if __name__ == "__main__":
    sys.exit(main())
