"""Zero-latency HTTP/1.1 keep-alive site for the benchmarks (asyncio, one process, stdlib only).

    python tests/bench/benchsite.py          # prints the port it listens on, serves until killed

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
``/stats``                         JSON: total requests, requests in flight, peak in flight
=================================  ===============================================
"""
from __future__ import annotations

import asyncio
import json
import sys

ROBOTS = b"User-agent: *\nDisallow: /private/\n"
MAX_SLEEP_S = 120.0
HITS: dict[str, int] = {}
COUNTERS = {"requests": 0, "in_flight": 0, "peak": 0}


def page(status: int, path: str) -> tuple[int, bytes, str]:
    body = (f"<!doctype html><html><head><title>{status} {path}</title></head>"
            f"<body><h1>{status}</h1><p>path: {path}</p></body></html>").encode()
    return status, body, "text/html; charset=utf-8"


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


async def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", port, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
