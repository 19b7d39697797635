"""Real-component test harness: private RabbitMQ, NATS and PostgreSQL servers on loopback.

No mocks. Each server gets free 127.0.0.1 ports and its own temp directory, so several test
sessions (and other people's tests) can run side by side on one machine. Import it from
tests (``from harness import ...``; conftest puts tests/ on sys.path) or from tests/bench/.

RabbitNode and NatsServer are the servers `crawld demo` embeds (crawld.devtools.servers)
with what only tests do to them; PostgreSQL and clusters exist only here.
Every server records how long its start took in ``start_seconds`` and prints it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Mapping

import pika

from crawld.devtools import servers
from crawld.devtools.procs import (  # noqa: F401  (re-exported for tests and benchmarks)
    ProcInfo, children_of, kill_leftovers, kill_pid, leftover_processes)
from crawld.devtools.servers import (  # noqa: F401  (re-exported for tests and benchmarks)
    RABBITMQ_SERVER, RABBITMQCTL, announce, chown_tree, free_port, jetstream_ready, log_tail,
    nats_server_binary, port_open, run_async, stop_at_exit, wait_until)


def _newest_pg_bin() -> Path:
    """Debian installs PostgreSQL under /usr/lib/postgresql/<major>/bin (15 on bookworm)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else Path("/usr/lib/postgresql/15/bin")


PG_BIN = _newest_pg_bin()


# ---------------------------------------------------------------------------------------
# brokers: crawld's embedded servers plus what only tests do to them
# ---------------------------------------------------------------------------------------
class RabbitNode(servers.RabbitNode):
    """The demo's private RabbitMQ node, plus outages and queue inspection for tests."""

    def stop_app(self, timeout: float = 30) -> None:
        """Stop the RabbitMQ application (the Erlang node stays up); AMQP goes away."""
        self.ctl("stop_app", timeout=timeout)
        wait_until(lambda: not port_open(self.port), timeout, what="AMQP listener to close")

    def start_app(self, timeout: float = 60) -> None:
        self.ctl("start_app", timeout=timeout)
        self.wait_amqp(timeout)

    def restart(self, timeout: float = 60) -> float:
        """Full node stop and start on the same dirs and port (durable data survives)."""
        self.shutdown(timeout=timeout)
        return self.start(timeout)

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

    def work_depth(self, name: str, shards: int = 64) -> int:
        """Tasks waiting for work: the intake queue ``name`` plus its shard queues (those
        that exist), whatever the partitioning."""
        from crawld.fleet.partition import shard_label
        names = [name] + [f"{name}.shard.{shard_label(i, shards)}" for i in range(shards)]
        total = 0
        conn = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            ch = conn.channel()
            for queue in names:
                try:
                    total += ch.queue_declare(queue, passive=True).method.message_count
                except pika.exceptions.ChannelClosedByBroker:
                    ch = conn.channel()      # a missing queue closes the channel
        finally:
            with contextlib.suppress(pika.exceptions.AMQPError):
                conn.close()
        return total

    def delete_topology(self, config_path: str | os.PathLike[str]) -> None:
        """Delete every queue and exchange crawld declares for the config at ``config_path``
        (the session node would otherwise collect 64 quorum shard queues per test)."""
        delete_crawld_topology(self.url, config_path)

    def delete_topology_of(self, cfg: Any) -> None:
        delete_topology_for(self.url, cfg)

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


def delete_crawld_topology(amqp_url: str, config_path: str | os.PathLike[str]) -> None:
    """Delete the queues and exchanges crawld declares for the config at ``config_path``
    from the node at ``amqp_url``; nothing if the node is gone (a test's own node)."""
    import tomllib

    from crawld.config import Config, QueueConfig, _build_section
    # Only [queue] names the topology: the rest (hooks, middleware) may not even import here.
    raw = tomllib.loads(Path(config_path).read_text())
    delete_topology_for(amqp_url, Config(queue=_build_section("queue", QueueConfig, raw.get("queue", {}))))


def delete_topology_for(amqp_url: str, cfg: Any) -> None:
    """Delete the queues and exchanges crawld declares for ``cfg`` (a Config)."""
    from crawld.transports.amqp.topology import shard_retry_exchange, topology
    try:
        conn = pika.BlockingConnection(pika.URLParameters(amqp_url + "?connection_attempts=1&socket_timeout=5"))
    except pika.exceptions.AMQPError:
        return
    try:
        ch = conn.channel()
        for queue, _args in topology(cfg):
            ch.queue_delete(queue)
        ch.exchange_delete(shard_retry_exchange(cfg.queue.name))
    except pika.exceptions.AMQPError:
        pass        # the node went away with the test (restarts, kills): nothing to clean
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError):
            conn.close()


@contextlib.contextmanager
def running_rabbit() -> Iterator[RabbitNode]:
    """A private RabbitMQ node for the block, stopped (files removed) however it ends."""
    node = RabbitNode()
    try:
        node.start()
        yield node
    finally:
        node.stop()


class NatsServer(servers.NatsServer):
    """The demo's nats-server, plus the crash and restart tests inflict on it."""

    def kill(self) -> None:
        """SIGKILL: a crash without any flush or goodbye."""
        self.signal_and_wait(signal.SIGKILL, timeout=10)

    def restart(self, timeout: float = 30) -> float:
        """Stop and start on the same store dir and port (file streams survive)."""
        self.stop()
        return self.start(timeout)


# ---------------------------------------------------------------------------------------
# config files
# ---------------------------------------------------------------------------------------
DEFAULT_FETCH = {"allow_networks": ["127.0.0.0/8"]}  # the test site is on loopback (SSRF guard)


def older_database(request: Any, tmp_path: Path, *statements: str) -> str:
    """The URL of a database an older crawld left (its ``statements`` run in it), on the
    back end ``request.param`` names: "sqlite" or "postgresql" (the session's server)."""
    import sqlite3
    import uuid
    if request.param == "sqlite":
        path = tmp_path / "old.db"
        with sqlite3.connect(path) as conn:
            for statement in statements:
                conn.execute(statement)
        return f"sqlite:///{path}"
    import psycopg
    url = request.getfixturevalue("postgres").create_database(f"o{uuid.uuid4().hex[:10]}")
    with psycopg.connect(url) as conn:
        for statement in statements:
            conn.execute(statement)
    return url


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
        announce(f"nats cluster {self.cluster_name} ({len(self.nodes)} nodes)", self.start_seconds)
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
        stop_at_exit(self.stop)

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
        chown_tree(self.base, "postgres")
        with open(self.log_file, "ab") as out:
            proc = self._run_as_postgres(
                [str(PG_BIN / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
                 "--auth=trust", "-E", "UTF8", "--no-sync", "--no-instructions"],
                stdout=out, stderr=subprocess.STDOUT)
            if proc.wait(120) != 0:
                raise RuntimeError("initdb failed:\n" + log_tail(self.log_file))

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
        announce(f"postgres on :{self.port}", self.start_seconds)
        return self.start_seconds

    def _accepting(self) -> bool:
        import psycopg

        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {self._proc.returncode}:\n"
                               + log_tail(self.log_file))
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
