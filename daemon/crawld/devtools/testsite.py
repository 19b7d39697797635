"""A small local website for tests and for ``crawld demo`` (stdlib only).

Every page is deterministic from its path, so tests choose the behaviour they need by URL
and keep themselves isolated with a unique ``<key>`` segment:

=================================  ===============================================
``/robots.txt``                    disallows ``/private/``
``/fast/<any>``                    200 small HTML page that names the path
``/slow/<seconds>/<any>``          sleeps, then 200
``/status/<code>/<any>``           answers with that status code
``/404/<any>``, ``/500/<any>``     always 404 / always 500
``/flaky/<n>/<key>``               500 for the first n hits of that exact path, then 200
``/redirect/<n>/<key>``            302 chain of n hops ending at ``/fast/<key>``
``/private/<any>``                 200, but disallowed by robots.txt
``/retry-after/<seconds>/<key>``   first hit 429 with ``Retry-After: seconds``, then 200
``/big/<bytes>/<key>``             200 with a body of that many bytes
``/chunked/<bytes>/<key>``         random bytes (seeded by the path), chunked, no Content-Length
``/unique/<bytes>/<key>``          200, that many bytes unique to the path (one body file each)
``/site/<key>/<n>/p/<i>``          page i of a generated n-page site to crawl (see ``site_page``)
``/demo/<n>/home``, ``/hub/<j>``   the demo's crawl: home -> hubs -> ``demo_paths(n)``
=================================  ===============================================

The server counts hits per path and records how many requests were in flight at once,
overall and per path prefix, so politeness (per-host concurrency) can be asserted.
"""
from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

ROBOTS_TXT = "User-agent: *\nDisallow: /private/\n"
MAX_SLEEP_S = 600.0
SLEEP_STEP_S = 0.05
MAX_BIG_BYTES = 64 * 1024 * 1024
CHUNK_BYTES = 16 * 1024


class _Stats:
    """Hit counters and a start/end event log, guarded by one lock.

    The event log (rather than fixed counters) lets ``max_concurrent`` answer for any
    prefix after the fact; it holds two small tuples per request, fine for test volumes.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hits: dict[str, int] = {}
        self.events: list[tuple[int, str]] = []
        self.starts: list[tuple[float, str]] = []   # (monotonic time, path) of every request
        self.active: Counter[str] = Counter()  # paths in flight right now
        self.peak = 0

    def enter(self, path: str) -> int:
        with self.lock:
            count = self.hits.get(path, 0) + 1
            self.hits[path] = count
            self.events.append((1, path))
            self.starts.append((time.monotonic(), path))
            self.active[path] += 1
            self.peak = max(self.peak, self.active.total())
            return count

    def leave(self, path: str) -> None:
        with self.lock:
            self.events.append((-1, path))
            self.active[path] -= 1
            if not self.active[path]:
                del self.active[path]

    def max_concurrent(self, prefix: str | None) -> int:
        with self.lock:
            if prefix is None:
                return self.peak
            events = list(self.events)
        current = best = 0
        for delta, path in events:
            if path.startswith(prefix):
                current += delta
                best = max(best, current)
        return best

    def reset(self) -> None:
        with self.lock:
            self.hits.clear()
            # Requests still in flight keep counting: seed the log with their starts.
            self.events = [(1, path) for path in self.active.elements()]
            self.starts.clear()
            self.peak = self.active.total()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like real sites; every answer has a length
    server_version = "crawld-testsite/1"
    timeout = 30  # idle keep-alive connections give their thread back eventually
    site: "TestSite"  # set on a per-site subclass

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # quiet: no stderr line per request

    def setup(self) -> None:
        super().setup()
        self.site._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.site._track(self.connection, add=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def _serve(self, send_body: bool) -> None:
        path = urlsplit(self.path).path
        stats = self.site._stats
        hit = stats.enter(path)
        try:
            status, headers, body = self.site._route(path, hit)
            self._respond(status, headers, body, send_body)
        finally:
            stats.leave(path)

    def _respond(self, status: int, headers: dict[str, str], body: bytes, send_body: bool) -> None:
        try:
            self.send_response(status)
            headers.setdefault("Content-Type", "text/html; charset=utf-8")
            for name, value in headers.items():
                self.send_header(name, value)
            chunked = headers.get("Transfer-Encoding") == "chunked"
            if status not in (204, 304) and not chunked:  # bodiless by definition (RFC 9110)
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body and chunked:
                for start in range(0, len(body), CHUNK_BYTES):
                    piece = body[start:start + CHUNK_BYTES]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.write(b"0\r\n\r\n")
            elif send_body:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (e.g. its timeout): not our error


Response = tuple[int, dict[str, str], bytes]


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hangs up mid-request (a killed worker, a deadline) is normal here."""
        import sys
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class TestSite:
    """A threaded HTTP server on 127.0.0.1 serving the pages described in the module doc."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._stats = _Stats()
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._routes: dict[str, Callable[[list[str], str, int], Response]] = {
            "fast": self._fast,
            "slow": self._slow,
            "status": self._status,
            "404": lambda parts, path, hit: self._page(404, path),
            "500": lambda parts, path, hit: self._page(500, path),
            "flaky": self._flaky,
            "redirect": self._redirect,
            "private": lambda parts, path, hit: self._page(200, path),
            "retry-after": self._retry_after,
            "big": self._big,
            "chunked": self._chunked,
            "unique": self._unique,
            "site": self._site,
            "demo": self._demo,
        }

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "TestSite":
        handler = type("SiteHandler", (_Handler,), {"site": self})
        self._stop.clear()
        self._server = _QuietServer((self.host, self.port), handler)
        self._server.daemon_threads = True  # a stuck request never blocks interpreter exit
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
            name=f"testsite-{self.port}", daemon=True,
        )
        self._thread.start()
        return self

    def refuse(self) -> None:
        """Unreachable from now on, at once: new connections are refused and open ones
        dropped, without waiting for the serving thread (``stop`` finishes the job). Many
        sites that must go down together call this on each first: stopping them one by
        one takes a poll interval each, and under load the first would be down for
        seconds while the others still answer."""
        if self._server is None:
            return
        self._stop.set()  # wakes /slow/ sleepers
        try:
            self._server.socket.shutdown(socket.SHUT_RDWR)   # Linux: stops listening
        except OSError:
            pass
        self._drop_connections()

    def stop(self) -> None:
        if self._server is None:
            return
        self._stop.set()  # wakes /slow/ sleepers
        self._server.shutdown()
        self._server.server_close()
        self._drop_connections()   # keep-alive connections would otherwise stay open
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> "TestSite":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- addresses and counters --------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + ("" if path.startswith("/") else "/") + path

    def hits(self, path: str) -> int:
        """Requests seen for this exact path (query string ignored)."""
        with self._stats.lock:
            return self._stats.hits.get(urlsplit(path).path, 0)

    def total_hits(self, prefix: str = "/") -> int:
        with self._stats.lock:
            return sum(n for p, n in self._stats.hits.items() if p.startswith(prefix))

    def max_concurrent(self, prefix: str | None = None) -> int:
        """Most requests in flight at once, overall or for paths starting with ``prefix``."""
        return self._stats.max_concurrent(prefix)

    def _drop_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def start_times(self, prefix: str = "/") -> list[float]:
        """``time.monotonic()`` of each request for paths starting with ``prefix``, in order."""
        with self._stats.lock:
            return [t for t, path in self._stats.starts if path.startswith(prefix)]

    def in_flight(self) -> int:
        """Requests being handled right now."""
        with self._stats.lock:
            return self._stats.active.total()

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until no request is in flight (a client may have its response before the
        server thread has finished its bookkeeping); True if idle in time."""
        deadline = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.in_flight() == 0

    def reset(self) -> None:
        """Forget hits and concurrency peaks (requests in flight keep counting)."""
        self._stats.reset()

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(conn)

    # -- pages -------------------------------------------------------------------------
    def _route(self, path: str, hit: int) -> Response:
        if path == "/robots.txt":
            return 200, {"Content-Type": "text/plain; charset=utf-8"}, ROBOTS_TXT.encode()
        parts = path.strip("/").split("/")
        route = self._routes.get(parts[0])
        if route is None:
            return self._page(404, path)
        try:
            return route(parts[1:], path, hit)
        except (ValueError, IndexError):
            return self._page(400, path)  # e.g. /slow/abc/x: a bad test URL, say so

    @staticmethod
    def _page(status: int, path: str, note: str = "") -> Response:
        body = (
            f"<!doctype html><html><head><title>{status} {path}</title></head>"
            f"<body><h1>{status}</h1><p>path: {path}</p>{note}</body></html>"
        )
        return status, {}, body.encode()

    def _fast(self, parts: list[str], path: str, hit: int) -> Response:
        return self._page(200, path, '<a href="/fast/next">next</a>')

    def _slow(self, parts: list[str], path: str, hit: int) -> Response:
        seconds = min(float(parts[0]), MAX_SLEEP_S)
        deadline = time.monotonic() + seconds
        # Small steps so stop() is prompt even while a long sleep is in progress.
        while not self._stop.is_set() and time.monotonic() < deadline:
            time.sleep(min(SLEEP_STEP_S, max(0.0, deadline - time.monotonic())))
        return self._page(200, path)

    def _status(self, parts: list[str], path: str, hit: int) -> Response:
        code = int(parts[0])
        if not 200 <= code <= 599:  # 1xx are interim answers, not a page
            raise ValueError(code)
        if code in (204, 304):  # these must not carry a body
            return code, {}, b""
        return self._page(code, path)

    def _flaky(self, parts: list[str], path: str, hit: int) -> Response:
        return self._page(500 if hit <= int(parts[0]) else 200, path)

    def _redirect(self, parts: list[str], path: str, hit: int) -> Response:
        hops, key = int(parts[0]), "/".join(parts[1:])
        if hops <= 0:
            return self._page(200, path)
        target = f"/fast/{key}" if hops == 1 else f"/redirect/{hops - 1}/{key}"
        return 302, {"Location": target}, b""

    def _retry_after(self, parts: list[str], path: str, hit: int) -> Response:
        seconds = str(int(parts[0]))  # Retry-After is whole seconds (RFC 9110)
        if hit == 1:
            status, headers, body = self._page(429, path)
            headers["Retry-After"] = seconds
            return status, headers, body
        return self._page(200, path)

    def _big(self, parts: list[str], path: str, hit: int) -> Response:
        size = min(int(parts[0]), MAX_BIG_BYTES)
        return 200, {"Content-Type": "application/octet-stream"}, b"x" * size

    def _chunked(self, parts: list[str], path: str, hit: int) -> Response:
        size = min(int(parts[0]), MAX_BIG_BYTES)
        return 200, {"Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"}, \
            random.Random(path).randbytes(size)   # incompressible, the same on every hit
    def _unique(self, parts: list[str], path: str, hit: int) -> Response:
        size = min(int(parts[0]), MAX_BIG_BYTES)
        line = (path + "\n").encode()
        return 200, {"Content-Type": "application/octet-stream"}, (line * (size // len(line) + 1))[:size]

    def _site(self, parts: list[str], path: str, hit: int) -> Response:
        key, n, kind, i = parts[0], int(parts[1]), parts[2], int(parts[3])
        if kind != "p" or not 0 <= i < n:
            return self._page(404, path)
        return site_page(self.base_url, key, n, i)

    def _demo(self, parts: list[str], path: str, hit: int) -> Response:
        n, kind = int(parts[0]), parts[1]
        if kind == "home":
            return demo_home(self.base_url, n)
        return demo_hub(self.base_url, n, int(parts[2]))


# -- crawlable sites ----------------------------------------------------------------------
SITE_FANOUT = 5     # page i links to pages 5i+1 .. 5i+5: 500 pages lie within depth 4


def site_depth(i: int) -> int:
    depth = 0
    while i > 0:
        i = (i - 1) // SITE_FANOUT
        depth += 1
    return depth


def site_children(n: int, i: int) -> list[int]:
    return [c for c in range(SITE_FANOUT * i + 1, SITE_FANOUT * i + SITE_FANOUT + 1) if c < n]


def site_page(base_url: str, key: str, n: int, i: int) -> Response:
    """Page i of the generated site ``/site/<key>/<n>/p/<i>`` (home is i = 0).

    Every child is linked under several spellings of one URL (relative through
    ``<base href>``, absolute with an upper-case scheme, a ``#fragment``, a ``./``
    segment, an ``<area>``), next to links a crawler must never follow: another host
    name (``localhost``, fetchable, so a wrong follow shows up as a hit on
    ``/site/<key>/offsite/``), ``rel=nofollow`` (``/site/<key>/nofollow/``), and from
    the leaves at depth 4 one level deeper (``/site/<key>/deep/``). The last page says
    ``<meta name=robots content=nofollow>``, the one before it ``X-Robots-Tag: nofollow``;
    both link to ``/site/<key>/blocked/``.
    """
    root, port = f"/site/{key}/{n}", base_url.rsplit(":", 1)[1]
    links = []
    for c in site_children(n, i):
        links += [f'<a href="p/{c}">child {c}</a>',                       # via <base href>
                  f'<a href="HTTP://127.0.0.1:{port}{root}/p/{c}#top">again</a>',
                  f'<a href="{root}/./p/{c}?#">and again</a>',
                  f'<map><area href="{root}/p/{c}#map" alt="map"></map>']
    links += [f'<a href="{root}/p/0">home</a>', f'<a href="#content">skip</a>',
              f'<a href="http://localhost:{port}/site/{key}/offsite/{i}">elsewhere</a>',
              f'<a rel="external nofollow" href="/site/{key}/nofollow/{i}">sponsored</a>',
              '<a href="mailto:webmaster@example.invalid">mail</a>']
    if site_depth(i) >= 4:
        links.append(f'<a href="/site/{key}/deep/{i}">deeper</a>')
    head = f'<base href="{root}/"><link rel="canonical" href="{root}/p/{i}">'
    headers: dict[str, str] = {}
    if i == n - 1:
        head += '<meta name="robots" content="noindex, nofollow">'
    if i in (n - 1, n - 2):
        links.append(f'<a href="/site/{key}/blocked/{i}">blocked</a>')
    if i == n - 2:
        headers["X-Robots-Tag"] = "noarchive, nofollow"
    body = (f"<!doctype html><html><head><title>page {i}</title>{head}</head>"
            f"<body><h1 id=content>page {i} of {n}</h1>{''.join(links)}</body></html>")
    return 200, headers, body.encode()


def demo_paths(n: int) -> list[tuple[str, str]]:
    """(kind, path) of the demo's n pages: its home, hubs, and some of every kind of page."""
    hubs = demo_hubs(n)
    kinds = [("always-500", "/500/p{i}", max(1, n // 25)),
             ("slow", "/slow/3/p{i}", max(1, n // 25)),
             ("404", "/404/p{i}", max(1, n // 20)),
             ("500-then-ok", "/flaky/1/p{i}", max(1, n // 10)),
             ("redirect", "/redirect/2/p{i}", max(1, n // 10)),
             ("robots-disallowed", "/private/p{i}", max(1, n // 20))]
    out = [("home", f"/demo/{n}/home")] + [("hub", f"/demo/{n}/hub/{j}") for j in range(hubs)]
    for kind, pattern, count in kinds:
        out += [(kind, pattern.format(i=i)) for i in range(count)]
    out += [("fast", f"/fast/p{i}") for i in range(max(0, n - len(out)))]
    return out[:n]


def demo_hubs(n: int) -> int:
    return max(1, min(8, n // 40))


def demo_home(base_url: str, n: int) -> Response:
    port = base_url.rsplit(":", 1)[1]
    links = [f'<a href="/demo/{n}/hub/{j}">section {j}</a>' for j in range(demo_hubs(n))]
    links += [f'<a href="http://localhost:{port}/offsite/home">a friend</a>',
              '<a href="https://example.invalid/">elsewhere</a>',
              '<a rel="nofollow" href="/fast/nofollow-home">ads</a>']
    return 200, {}, f"<!doctype html><title>demo</title><h1>demo site</h1>{''.join(links)}".encode()


def demo_hub(base_url: str, n: int, j: int) -> Response:
    hubs = demo_hubs(n)
    paths = [p for k, p in demo_paths(n) if k not in ("home", "hub")][j::hubs]
    links = [f'<a href="{p}#from-hub-{j}">{p}</a>' for p in paths]
    links += [f'<a rel="nofollow" href="/fast/nofollow-{j}">sponsored</a>',
              f'<a href="http://localhost:{base_url.rsplit(":", 1)[1]}/offsite/{j}">partner</a>']
    return 200, {}, f"<!doctype html><title>hub {j}</title>{''.join(links)}".encode()
