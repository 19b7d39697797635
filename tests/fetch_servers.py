"""Small local HTTP(S) servers with hostile and special behaviours, for the fetcher tests.

Everything binds to 127.0.0.1 on port 0. ``forbid_external_network`` makes any attempt
to connect or send a datagram to a non-loopback address (or to resolve a real name
through the system) fail *and* be recorded,
so tests can prove that refusals happen before a single packet leaves.
"""
from __future__ import annotations

import errno
import gzip
import ipaddress
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

Route = Callable[["Handler"], None]


@dataclass
class Seen:
    at: float                 # time.monotonic() when the request line arrived
    path: str
    headers: dict[str, str]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"       # keep-alive, like real servers
    disable_nagle_algorithm = True      # headers and body go out in separate writes
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        self.server.owner._dispatch(self)

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    owner: "LocalServer"

    def handle_error(self, request: object, client_address: object) -> None:
        pass        # clients hanging up on drips and bombs is the point of these servers


class _Server6(_Server):
    address_family = socket.AF_INET6


class LocalServer:
    """A ThreadingHTTPServer on 127.0.0.1 with per-path routes and a request log."""

    def __init__(self, routes: dict[str, Route] | None = None, *, tls: tuple[str, str] | None = None,
                 bind: str = "127.0.0.1") -> None:
        self.routes: dict[str, Route] = dict(routes or {})
        self.seen: list[Seen] = []
        self.sni: list[str | None] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()
        server_cls = _Server6 if ":" in bind else _Server
        self._httpd = server_cls((bind, 0), Handler)
        self.bind = bind
        self._httpd.owner = self
        if tls:
            self._wrap_tls(*tls)
        self.port = self._httpd.server_address[1]
        self.scheme = "https" if tls else "http"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def _wrap_tls(self, certfile: str, keyfile: str) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(certfile, keyfile)
        ctx.sni_callback = lambda sock, name, _ctx: self.sni.append(name)
        self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True)

    def __enter__(self) -> "LocalServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def url(self, path: str = "/", host: str | None = None) -> str:
        host = host or (f"[{self.bind}]" if ":" in self.bind else self.bind)
        return f"{self.scheme}://{host}:{self.port}{path}"

    def hits(self, path: str) -> int:
        with self._lock:
            return sum(1 for s in self.seen if s.path == path)

    def times(self, prefix: str) -> list[float]:
        with self._lock:
            return [s.at for s in self.seen if s.path.startswith(prefix)]

    def _dispatch(self, h: Handler) -> None:
        path = h.path.split("?", 1)[0]
        with self._lock:
            self.seen.append(Seen(time.monotonic(), path, dict(h.headers.items())))
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            route = self.routes.get(path) or self.routes.get("*") or page(b"default page")
            route(h)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            h.close_connection = True
        finally:
            with self._lock:
                self.active -= 1


# ----------------------------------------------------------------------------- responses
def send(h: Handler, status: int = 200, body: bytes = b"", headers: dict[str, str] | None = None,
         content_type: str = "text/html; charset=utf-8") -> None:
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    for name, value in (headers or {}).items():
        h.send_header(name, value)
    if not any(k.lower() == "content-length" for k in (headers or {})):
        h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def page(body: bytes = b"<html>ok</html>", status: int = 200, headers: dict[str, str] | None = None,
         content_type: str = "text/html; charset=utf-8") -> Route:
    return lambda h: send(h, status, body, headers, content_type)


def robots(text: str, status: int = 200) -> Route:
    return page(text.encode(), status, content_type="text/plain")


def redirect(location: str, status: int = 301) -> Route:
    return lambda h: send(h, status, b"moved", {"Location": location})


def slow(seconds: float, body: bytes = b"slow ok", status: int = 200) -> Route:
    def route(h: Handler) -> None:
        time.sleep(seconds)
        send(h, status, body)
    return route


def drip_body(interval: float, total: int = 10_000) -> Route:
    """Headers at once, then one byte every ``interval`` (never finishing in a test)."""
    def route(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(total))
        h.end_headers()
        for _ in range(total):
            h.wfile.write(b"x")
            h.wfile.flush()
            time.sleep(interval)
    return route


def drip_headers(interval: float, count: int = 10_000) -> Route:
    """A status line, then one header byte every ``interval``: a slow-loris response."""
    def route(h: Handler) -> None:
        h.wfile.write(b"HTTP/1.1 200 OK\r\n")
        h.wfile.flush()
        for _ in range(count):
            h.wfile.write(b"X-Drip: a\r\n")
            h.wfile.flush()
            time.sleep(interval)
    return route


def encoded(body: bytes, encoding: str) -> Route:
    if encoding == "gzip":
        data = gzip.compress(body)
    elif encoding == "deflate":
        data = zlib.compress(body)
    elif encoding == "br":
        import brotli
        data = brotli.compress(body)
    else:
        raise ValueError(encoding)
    return page(data, headers={"Content-Encoding": encoding}, content_type="text/plain")


def gzip_zeros(decoded_size: int) -> bytes:
    """gzip of ``decoded_size`` zero bytes, compressed in 1 MiB steps (small memory)."""
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    parts = [co.compress(block) for _ in range(decoded_size // len(block))]
    parts.append(co.compress(bytes(decoded_size % len(block))))
    parts.append(co.flush())
    return b"".join(parts)


def gzip_bomb(compressed: bytes, chunk: int = 16 * 1024) -> Route:
    """Stream a pre-compressed bomb (e.g. 100 MB of zeros as ~100 KB of gzip)."""
    def route(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Encoding", "gzip")
        h.send_header("Content-Length", str(len(compressed)))
        h.end_headers()
        for start in range(0, len(compressed), chunk):
            h.wfile.write(compressed[start:start + chunk])
    return route


def raw_response(head: bytes, body: bytes = b"") -> Route:
    """Send ``head`` (status line and header lines, CRLFs as given), a blank line and
    ``body``, byte for byte, then hang up: for heads a stdlib server would not write."""
    def route(h: Handler) -> None:
        h.wfile.write(head + b"\r\n" + body)
        h.wfile.flush()
        h.close_connection = True
    return route


def truncated(declared: int, sent: bytes) -> Route:
    """Announce ``declared`` bytes, send fewer, hang up."""
    def route(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(declared))
        h.end_headers()
        h.wfile.write(sent)
        h.wfile.flush()
        h.close_connection = True
    return route


def sequence(*routes: Route) -> Route:
    """Answer with routes[0] the first time, routes[1] the second, ... then repeat the last."""
    calls = iter(range(1 << 30))
    lock = threading.Lock()

    def route(h: Handler) -> None:
        with lock:
            n = next(calls)
        routes[min(n, len(routes) - 1)](h)
    return route


# ----------------------------------------------------------------------------- network fence
@dataclass
class NetSpy:
    connects: list[tuple] = field(default_factory=list)    # every connect() attempted
    blocked: list[tuple] = field(default_factory=list)     # the non-loopback ones (refused)
    lookups: list[str] = field(default_factory=list)       # names (not literals) given to getaddrinfo
    datagrams: list[tuple] = field(default_factory=list)   # every sendto() destination (DNS over UDP)


def forbid_external_network(monkeypatch) -> NetSpy:  # type: ignore[no-untyped-def]
    """Refuse and record connects/datagrams to non-loopback addresses and system DNS of real names.

    ``sendto`` is fenced too: dnspython asks its servers over unconnected UDP sockets, so a
    resolver pointed at a real server would otherwise slip past a connect-only fence.
    """
    spy = NetSpy()
    real_connect, real_connect_ex, real_gai = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo
    real_sendto = socket.socket.sendto

    def allowed(sock: socket.socket, address: object) -> bool:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return True
        spy.connects.append(address)  # type: ignore[arg-type]
        ip = ipaddress.ip_address(str(address[0]).split("%")[0])  # type: ignore[index]
        if ip.is_loopback:
            return True
        spy.blocked.append(address)  # type: ignore[arg-type]
        return False

    def connect(sock: socket.socket, address: object) -> None:
        if not allowed(sock, address):
            raise OSError(errno.ENETUNREACH, f"test fence: connect to {address} refused")
        real_connect(sock, address)

    def connect_ex(sock: socket.socket, address: object) -> int:
        return real_connect_ex(sock, address) if allowed(sock, address) else errno.ENETUNREACH

    def sendto(sock: socket.socket, data: bytes, *args: object) -> int:
        address = args[-1]
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            spy.datagrams.append(address)  # type: ignore[arg-type]
            if not ipaddress.ip_address(str(address[0]).split("%")[0]).is_loopback:  # type: ignore[index]
                spy.blocked.append(address)  # type: ignore[arg-type]
                raise OSError(errno.ENETUNREACH, f"test fence: datagram to {address} refused")
        return real_sendto(sock, data, *args)  # type: ignore[arg-type]

    def getaddrinfo(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        name = host.decode() if isinstance(host, bytes) else host
        if name is not None:
            try:
                ipaddress.ip_address(name.strip("[]").split("%")[0])
            except ValueError:      # a name, not an address literal: that would be DNS
                spy.lookups.append(name)
                if name != "localhost":
                    raise socket.gaierror(socket.EAI_NONAME, f"test fence: no DNS for {name}")
        return real_gai(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket.socket, "sendto", sendto)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return spy


def closed_port() -> int:
    """A loopback port with nothing listening (connect gets ECONNREFUSED)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cert(directory: str, hostname: str) -> tuple[str, str] | None:
    """Self-signed cert for ``hostname`` via the openssl CLI; None if openssl is missing."""
    if shutil.which("openssl") is None:
        return None
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "2", "-subj", f"/CN={hostname}",
                    "-addext", f"subjectAltName=DNS:{hostname}"],
                   check=True, capture_output=True)
    return cert, key
