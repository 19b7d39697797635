"""Debian nginx as the benchmark web site: static pages far faster than any Python site.

    python tests/bench/nginx_site.py [--pages 100] [--sites 3]   # start, print URLs, serve until ^C

A private nginx (``nginx -c FILE -p DIR -e LOG``, ``daemon off``) with its pid file, error
log and every temp path inside its own directory, ``access_log off``, one worker process and
``keepalive_requests 100000`` (a crawler keeps its connections; nginx's default of 1000 would
close them under load). It serves a generated tree:

* ``/p/N`` for N < pages: a ~2 KB HTML page naming N (``text/html``);
* ``/robots.txt``: allow all.

Many sites: one ``server`` block listens on ``127.0.0.K:PORT`` for K in 1..sites (Linux routes
all of 127/8 to lo, so no address needs configuring). Each address is its own host name for
crawld's politeness and partitioning, which key on the host without the port.

Install: ``apt-get install -y nginx-light`` (or ``nginx``). Nothing in CI needs it.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
MAX_SITES = 250             # 127.0.0.1 .. 127.0.0.250, each a separate host name
PAGE_BYTES = 2048
ROBOTS = "User-agent: *\nAllow: /\n"
TEMP_DIRS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def page_html(n: int, size: int = PAGE_BYTES) -> bytes:
    """A ~size-byte HTML page naming N (distinct bodies: the body store sees distinct hashes)."""
    head = (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>page {n}</title></head>\n"
            f"<body><h1>page {n}</h1>\n")
    tail = f"<p><a href=\"/p/{n + 1}\">next</a></p>\n</body></html>\n"
    filler_line = f"<p>benchmark page {n}: lorem ipsum dolor sit amet, consectetur.</p>\n"
    filler = ""
    while len(head) + len(filler) + len(filler_line) + len(tail) <= size:
        filler += filler_line
    return (head + filler + tail).encode()


def write_tree(root: Path, pages: int) -> None:
    (root / "p").mkdir(parents=True, exist_ok=True)
    (root / "robots.txt").write_text(ROBOTS)
    for n in range(pages):
        (root / "p" / str(n)).write_bytes(page_html(n))


WORKER_CONNECTIONS = 8192
OPEN_FILE_CACHE = 4096      # descriptors of recently served pages kept open


def render_config(directory: Path, port: int, sites: int) -> str:
    """nginx.conf: everything private to ``directory``; one listen per loopback address."""
    listens = "\n".join(f"        listen 127.0.0.{k}:{port} backlog=4096;"
                        for k in range(1, sites + 1))
    temps = "\n".join(f"    {name}_temp_path {directory / 'tmp' / name};" for name in TEMP_DIRS)
    # Cached page descriptors plus connections must fit the worker's descriptor limit: with
    # a cache of 20,000 under a limit of 20,000, a 20,000-page run had nginx answer 500
    # (open: too many open files) and fail accept4, and clients waited for a timeout.
    return f"""daemon off;
worker_processes 1;
worker_rlimit_nofile {OPEN_FILE_CACHE + WORKER_CONNECTIONS + 1024};
pid {directory / 'nginx.pid'};
error_log {directory / 'error.log'} warn;
{'user root;' if os.geteuid() == 0 else ''}
events {{
    worker_connections {WORKER_CONNECTIONS};
}}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    keepalive_timeout 120s;
    open_file_cache max={OPEN_FILE_CACHE} inactive=60s;
    server_tokens off;
{temps}
    types {{
        text/plain txt;
    }}
    default_type text/html;
    server {{
{listens}
        root {directory / 'www'};
        location = /robots.txt {{ default_type text/plain; }}
        location /p/ {{ default_type text/html; }}
    }}
}}
"""


class NginxSite:
    """A private nginx serving ``pages`` pages on ``sites`` loopback addresses, one port."""

    def __init__(self, directory: str | os.PathLike, pages: int = 1000, sites: int = 1,
                 port: int | None = None) -> None:
        if not 1 <= sites <= MAX_SITES:
            raise ValueError(f"sites must be 1..{MAX_SITES}")
        self.dir = Path(directory)
        self.pages = pages
        self.sites = sites
        self.port = port or 0
        self.proc: subprocess.Popen | None = None
        self.start_seconds = 0.0

    # -- URLs --------------------------------------------------------------------------
    def base(self, site: int = 1) -> str:
        """``http://127.0.0.<site>:PORT`` (site counts from 1)."""
        return f"http://127.0.0.{site}:{self.port}"

    def page_url(self, n: int, site: int = 1) -> str:
        return f"{self.base(site)}/p/{n % self.pages}"

    @property
    def url(self) -> str:
        return self.base(1)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 15) -> float:
        started = time.monotonic()
        if not Path(NGINX).exists():
            raise RuntimeError("nginx is not installed: apt-get install -y nginx-light")
        self.dir.mkdir(parents=True, exist_ok=True)
        write_tree(self.dir / "www", self.pages)
        for name in TEMP_DIRS:
            (self.dir / "tmp" / name).mkdir(parents=True, exist_ok=True)
        # A port free on 127.0.0.1 may still be taken on another 127.0.0.K: retry a few.
        for attempt in range(5):
            port = self.port or _free_port()
            if self._try_start(port, timeout):
                self.port = port
                self.start_seconds = time.monotonic() - started
                return self.start_seconds
            if self.port:
                break
        raise RuntimeError(f"nginx did not start: {self.log_tail()}")

    def _try_start(self, port: int, timeout: float) -> bool:
        conf = self.dir / "nginx.conf"
        conf.write_text(render_config(self.dir, port, self.sites))
        # -e: the compiled-in error log is opened before the config is read.
        self.proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(self.dir), "-e",
                                      str(self.dir / "error.log")], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        last = min(self.sites, MAX_SITES)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if _port_open("127.0.0.1", port) and _port_open(f"127.0.0.{last}", port):
                return True
            time.sleep(0.02)
        self.stop()
        return False

    def stop(self, timeout: float = 10) -> None:
        """SIGQUIT: graceful stop (workers finish their requests), then KILL past timeout."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)   # master and worker share its session
            proc.wait(5)

    def log_tail(self, chars: int = 800) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "error.log").read_text(errors="replace")[-chars:]
        return ""

    def pids(self) -> list[int]:
        """The master and its worker (for CPU accounting)."""
        if self.proc is None:
            return []
        from crawld.devtools.procs import children_of
        return [self.proc.pid, *children_of(self.proc.pid)]

    def __enter__(self) -> "NginxSite":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def main(argv: list[str] | None = None) -> int:
    import tempfile
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=100)
    parser.add_argument("--sites", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3600, help="serve this long at most")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="crawld-nginx-") as tmp:
        site = NginxSite(tmp, args.pages, args.sites)
        site.start()
        print(f"nginx serving {args.pages} pages on {site.base(1)} .. {site.base(args.sites)} "
              f"(started in {site.start_seconds:.2f} s)", flush=True)
        try:
            time.sleep(args.seconds)
        except KeyboardInterrupt:
            pass
        finally:
            site.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
