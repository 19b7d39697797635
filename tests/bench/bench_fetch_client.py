"""Fetch throughput per worker process: urllib3 (our Fetcher and raw PoolManager) vs httpx.Client.

    python tests/bench/bench_fetch_client.py [--requests 3000] [--threads 8] [--server nginx|asyncio]

The server is a private Debian nginx (nginx_site.py, a ~2 KB static page; the default when
nginx is installed) or a zero-latency keep-alive asyncio server in a child process that
answers every request with the same small 200 (``--server asyncio``). Either runs in
its own process, so it never shares our GIL. Each client uses one shared client object
and the same number of threads, as a crawld worker does, and gets the same number of
requests (each to a URL of its own, ``?n=<i>``, as a crawl's are) after a warm-up, in
interleaved rounds (machine noise and drift then hit every client alike). The numbers are requests per second of one
worker process, so they measure client overhead (parsing, pooling, locking, and for the
Fetcher: SSRF guard, robots.txt cache, host-wide flock politeness, deadline watchdog).
Bounded: each client stops after --requests or --max-seconds, whichever comes first.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Callable, Iterator

SERVER = textwrap.dedent(r"""
    import asyncio, sys
    BODY = b"<html><body>zero latency</body></html>\n"
    RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: "
                + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buf = transport, b""
        def data_received(self, data):
            self.buf += data
            while True:     # GET requests only: a request ends at the blank line
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                self.buf = self.buf[end + 4:]
                self.transport.write(RESPONSE)

    async def main():
        server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0, backlog=512)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def run_load(get: Callable[[str], int], url: str, requests: int, threads: int,
             max_seconds: float) -> tuple[int, float, int]:
    """``requests`` GETs from ``threads`` threads; returns (count, seconds, failures)."""
    lock = threading.Lock()
    issued, failures = [0], [0]
    deadline = time.monotonic() + max_seconds

    def worker() -> None:
        while True:
            with lock:
                if issued[0] >= requests or time.monotonic() > deadline:
                    return
                issued[0] += 1
                n = issued[0]
            if get(f"{url}?n={n}") != 200:     # a new URL each time, as in a crawl
                with lock:
                    failures[0] += 1
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    started = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return issued[0], time.perf_counter() - started, failures[0]


def crawld_fetcher(threads: int, run_dir: str, partition: str) -> tuple[Callable[[str], int], Callable[[], None]]:
    """The Fetcher as a worker builds it: a shard owner's in-memory SiteLimiter for
    ``partition = "host"`` (the default), the machine-wide flock HostLimiter for "none"."""
    from crawld.config import Config, FetchConfig, QueueConfig, WorkersConfig
    from crawld.fetch import Fetcher
    from crawld.process.worker import site_limiter
    cfg = Config(fetch=FetchConfig(allow_networks=("127.0.0.0/8",), obey_robots=True,
                                   per_host_concurrency=threads),
                 queue=QueueConfig(partition=partition), workers=WorkersConfig(threads=threads))
    fetcher = Fetcher(cfg.fetch, pool_size=threads, run_dir=run_dir, limiter=site_limiter(cfg))
    return (lambda url: fetcher.fetch(url).http_status or 0), fetcher.close


def raw_urllib3(threads: int) -> tuple[Callable[[str], int], Callable[[], None]]:
    import urllib3
    pool = urllib3.PoolManager(maxsize=threads, retries=False)
    return (lambda url: pool.request("GET", url).status), pool.clear


def httpx_client(threads: int) -> tuple[Callable[[str], int], Callable[[], None]]:
    import httpx
    client = httpx.Client(limits=httpx.Limits(max_connections=threads, max_keepalive_connections=threads))
    return (lambda url: client.get(url).status_code), client.close


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per client")
    parser.add_argument("--max-seconds", type=float, default=15.0, help="per client, all rounds")
    parser.add_argument("--server", choices=["nginx", "asyncio"], default=default_server())
    parser.add_argument("--no-httpx", action="store_true", help="only the crawld Fetcher and raw urllib3")
    args = parser.parse_args(argv)

    with serve(args.server) as url:
        with tempfile.TemporaryDirectory(prefix="crawld-bench-") as run_dir:
            clients = {"crawld Fetcher, shard owner": crawld_fetcher(args.threads, run_dir, "host"),
                       "crawld Fetcher, flock (none)": crawld_fetcher(args.threads, run_dir, "none"),
                       "urllib3 PoolManager (raw)": raw_urllib3(args.threads)}
            if not args.no_httpx:
                clients["httpx.Client"] = httpx_client(args.threads)
            try:
                rows = measure(clients, url, args)
            finally:
                for _, close in clients.values():
                    close()
    report(rows, args.threads, args.server)
    return 0 if all(row["failures"] == 0 for row in rows) else 1


def measure(clients: dict[str, tuple[Callable[[str], int], Callable[[], None]]], url: str,
            args: argparse.Namespace) -> list[dict]:
    """Warm every client up, then interleave them in rounds so drift hits all alike."""
    for get, _ in clients.values():
        for _ in range(100):                    # connections, robots.txt, lazy imports
            get(url)
    totals = {name: [0, 0.0, 0] for name in clients}
    per_round = max(1, args.requests // args.rounds)
    for _ in range(args.rounds):
        for name, (get, _) in clients.items():
            count, seconds, failures = run_load(get, url, per_round, args.threads,
                                                args.max_seconds / args.rounds)
            totals[name][0] += count
            totals[name][1] += seconds
            totals[name][2] += failures
    return [{"client": name, "requests": n, "seconds": sec, "rps": n / sec, "failures": fail}
            for name, (n, sec, fail) in totals.items()]


def default_server() -> str:
    from nginx_site import NGINX
    return "nginx" if os.path.exists(NGINX) else "asyncio"


@contextlib.contextmanager
def serve(kind: str) -> Iterator[str]:
    """The URL every client GETs, served by nginx (a ~2 KB page) or the asyncio server."""
    if kind == "nginx":
        from nginx_site import NginxSite
        with tempfile.TemporaryDirectory(prefix="crawld-bench-nginx-") as tmp:
            with NginxSite(tmp, pages=10) as site:
                yield site.page_url(1)
        return
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(server.stdout.readline())}/page"
    finally:
        server.kill()
        server.wait()


def report(rows: list[dict], threads: int, server: str = "asyncio") -> None:
    raw = next(r for r in rows if r["client"].startswith("urllib3"))
    httpx_row = next((r for r in rows if r["client"] == "httpx.Client"), None)
    owner, flock = rows[0], rows[1]
    what = ("private nginx, ~2 KB static page" if server == "nginx"
            else "local zero-latency keep-alive server")
    print(f"\nfetch throughput, one process, {threads} threads, {what} "
          f"(python {sys.version.split()[0]}, {os.cpu_count()} CPUs)\n")
    print(f"{'client':<28}{'requests':>9}{'seconds':>9}{'req/s':>9}{'vs raw urllib3':>16}{'failures':>10}")
    for r in rows:
        print(f"{r['client']:<28}{r['requests']:>9}{r['seconds']:>9.2f}{r['rps']:>9.0f}"
              f"{r['rps'] / raw['rps']:>15.2f}x{r['failures']:>10}")
    if httpx_row is not None:
        print(f"\nratio urllib3 raw / httpx.Client      = {raw['rps'] / httpx_row['rps']:.2f}")
        print(f"ratio crawld Fetcher / httpx.Client   = {owner['rps'] / httpx_row['rps']:.2f}")
    print(f"ratio crawld Fetcher / urllib3 raw    = {owner['rps'] / raw['rps']:.2f} "
          f"(shard owner, partition = \"host\": guard + robots + in-memory politeness + deadlines)")
    print(f"ratio flock Fetcher / urllib3 raw     = {flock['rps'] / raw['rps']:.2f} "
          f"(partition = \"none\": politeness in flock files shared by the machine's workers)")


if __name__ == "__main__":
    sys.exit(main())
