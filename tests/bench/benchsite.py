"""Zero-latency HTTP/1.1 keep-alive site for the benchmarks (asyncio, one process, stdlib only).

    python tests/bench/benchsite.py [PORT]               # prints the port it listens on, serves until killed
    python tests/bench/benchsite.py [PORT] --hosts 500   # the same port on 500 loopback addresses

Runs in a child process of the benchmark so it never shares a GIL with the code under
test. The routes mirror crawld.testsite (same URL shapes), but every answer is written
from the event loop without a thread per connection, so the server itself stays far
faster than any client it is compared against:

=================================  ===============================================
``/robots.txt``                    disallows ``/private/``
``/fast/<any>``                    200 small HTML page naming the path (unique bodies)
``/slow/<seconds>/<any>``          200 after ``seconds`` (asyncio.sleep, no thread)
``/hang-once/<seconds>/<key>``     first hit of that path waits ``seconds``, later hits at once
``/flaky/<n>/<key>``               500 for the first n hits of that exact path, then 200
``/500/<any>``                     always 500
``/tree/<key>/<n>/<fanout>/<i>``   page i of an n-page site to crawl: links to its children
                                   fanout*i+1.., home, parent, a 40-link menu, off-site links
``/stats``                         JSON: total requests, requests in flight, peak in flight
=================================  ===============================================

``--hosts N`` (1..500) listens on one port of N loopback addresses, ``loopback_host(k)``
for k = 1..N: 127.0.0.1 .. 127.0.0.250, then 127.0.1.1 .. 127.0.1.250 (Linux routes all
of 127/8 to lo). crawld keys politeness and partitioning on the host name without the
port, so each address is a separate site. Only loopback addresses are ever bound.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys

ROBOTS = b"User-agent: *\nDisallow: /private/\n"
MAX_SLEEP_S = 120.0
HITS: dict[str, int] = {}
COUNTERS = {"requests": 0, "in_flight": 0, "peak": 0}
HOSTS_PER_BLOCK = 250           # 127.0.B.1 .. 127.0.B.250 (.0 and .255 left out)
MAX_HOSTS = 2 * HOSTS_PER_BLOCK
BIND_ATTEMPTS = 5


def page(status: int, path: str) -> tuple[int, bytes, str]:
    body = (f"<!doctype html><html><head><title>{status} {path}</title></head>"
            f"<body><h1>{status}</h1><p>path: {path}</p></body></html>").encode()
    return status, body, "text/html; charset=utf-8"


def tree_page(key: str, n: int, fanout: int, i: int) -> tuple[int, bytes, str]:
    """A page shaped like a real one: ~100 links (children, menu, footer, off-site), ~12 KB."""
    if not 0 <= i < n:
        return page(404, f"/tree/{key}/{n}/{fanout}/{i}")
    root = f"/tree/{key}/{n}/{fanout}"
    children = [c for c in range(fanout * i + 1, fanout * i + fanout + 1) if c < n]
    menu = [m for m in range(1, 41) if m < n]
    links = [f'<li><a href="{root}/{c}">item {c}</a> <p>{"Lorem ipsum dolor sit amet. " * 3}</p></li>'
             for c in children]
    links += [f'<a href="{root}/{m}" class="nav">section {m}</a>' for m in menu]
    links += [f'<a href="{root}/0">home</a>', f'<a href="{root}/{max(0, (i - 1) // fanout)}">up</a>']
    links += [f'<a href="https://example{k}.invalid/page/{i}" rel="nofollow">ad {k}</a>' for k in range(10)]
    links += [f'<a href="https://social{k}.invalid/share?u={i}">share</a>' for k in range(30)]
    body = (f"<!doctype html><html><head><title>page {i}</title><link rel=canonical href=\"{root}/{i}\">"
            f"<meta name=viewport content=\"width=device-width\"></head><body><nav>{''.join(links[len(children):])}"
            f"</nav><main><h1>page {i}</h1><ul>{''.join(links[:len(children)])}</ul>"
            f"<p>{'Some text of the article. ' * 100}</p></main></body></html>").encode()
    return 200, body, "text/html; charset=utf-8"


def route(path: str) -> tuple[float, tuple[int, bytes, str]]:
    """(delay seconds, (status, body, content type)) for one GET."""
    hit = HITS[path] = HITS.get(path, 0) + 1
    if path == "/robots.txt":
        return 0.0, (200, ROBOTS, "text/plain")
    if path == "/stats":
        return 0.0, (200, json.dumps(COUNTERS).encode(), "application/json")
    parts = path.strip("/").split("/")
    try:
        kind = parts[0]
        if kind == "fast":
            return 0.0, page(200, path)
        if kind == "slow":
            return min(float(parts[1]), MAX_SLEEP_S), page(200, path)
        if kind == "hang-once":
            return (min(float(parts[1]), MAX_SLEEP_S) if hit == 1 else 0.0), page(200, path)
        if kind == "flaky":
            return 0.0, page(500 if hit <= int(parts[1]) else 200, path)
        if kind == "500":
            return 0.0, page(500, path)
        if kind == "tree":
            return 0.0, tree_page(parts[1], int(parts[2]), int(parts[3]), int(parts[4]))
    except (IndexError, ValueError):
        return 0.0, page(400, path)
    return 0.0, page(404, path)


def render(status: int, body: bytes, ctype: str) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Conn(asyncio.Protocol):
    """One keep-alive connection; answers in request order even when some are delayed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buf = b""
        self.tail: asyncio.Task | None = None   # the last delayed answer still pending

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > 65536:
                    self.transport.close()
                return
            head, self.buf = self.buf[:end], self.buf[end + 4:]
            line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            target = line[1] if len(line) > 1 else "/"
            path = target.split("?", 1)[0]
            COUNTERS["requests"] += 1
            delay, answer = route(path)
            if delay <= 0 and (self.tail is None or self.tail.done()):
                self.transport.write(render(*answer))
                continue
            COUNTERS["in_flight"] += 1
            COUNTERS["peak"] = max(COUNTERS["peak"], COUNTERS["in_flight"])
            self.tail = asyncio.get_running_loop().create_task(self._later(self.tail, delay, answer))

    async def _later(self, before: asyncio.Task | None, delay: float, answer: tuple) -> None:
        try:
            if before is not None:
                await asyncio.shield(before)
            if delay > 0:
                await asyncio.sleep(delay)
            if not self.transport.is_closing():
                self.transport.write(render(*answer))
        finally:
            COUNTERS["in_flight"] -= 1


def loopback_host(k: int) -> str:
    """Address of site k (1-based): 127.0.0.k for k <= 250, then 127.0.1.(k - 250)."""
    if not 1 <= k <= MAX_HOSTS:
        raise ValueError(f"site {k} outside 1..{MAX_HOSTS}")
    block, offset = divmod(k - 1, HOSTS_PER_BLOCK)
    return f"127.0.{block}.{offset + 1}"


def loopback_hosts(n: int) -> list[str]:
    hosts = [loopback_host(k) for k in range(1, n + 1)]
    # A hard rule: this test server must never listen beyond the loopback interface.
    assert all(ipaddress.ip_address(h).is_loopback for h in hosts)
    return hosts


async def serve_many(hosts: list[str], port: int) -> int:
    """Listen on ``port`` of every host; with port 0, one port free on all of them (a port
    free on 127.0.0.1 may be taken on another address, so a clash picks a new one)."""
    loop = asyncio.get_running_loop()
    for _ in range(BIND_ATTEMPTS):
        first = await loop.create_server(Conn, hosts[0], port, backlog=1024)
        chosen = first.sockets[0].getsockname()[1]
        try:
            if hosts[1:]:
                await loop.create_server(Conn, hosts[1:], chosen, backlog=1024)
            return chosen
        except OSError:
            first.close()
            if port:
                raise
    raise OSError(f"no port free on all {len(hosts)} loopback addresses")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="benchmark HTTP site on loopback")
    parser.add_argument("port", nargs="?", type=int, default=0)
    parser.add_argument("--hosts", type=int, default=0,
                        help=f"listen on 1..{MAX_HOSTS} loopback addresses (127.0.0.1 .. 127.0.1.250)")
    return parser.parse_args(argv)


async def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.hosts:
        if not 1 <= args.hosts <= MAX_HOSTS:
            raise SystemExit(f"--hosts must be 1..{MAX_HOSTS}")
        print(await serve_many(loopback_hosts(args.hosts), args.port), flush=True)
    else:
        server = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", args.port, backlog=1024)
        print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
