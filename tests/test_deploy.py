"""deploy/: the shipped systemd unit, supervisord program and cluster configs, checked for real.

* systemd: ``systemd-analyze verify`` on the unit (ExecStart pointed at the real crawld), plus
  the relationships that make a stop graceful and the hardening compatible with the config.
* crawld configs: ``crawld check-config`` on every shipped TOML.
* NATS: the three cluster node configs started for real (ports and store_dir rewritten in
  a temp copy) until JetStream has a meta leader; an R3 publish through crawld.
* supervisord: the shipped ``[program:crawld]`` run by a real supervisord against a real
  RabbitMQ: 3 workers, numprocs 3 -> 5 via reread/update, a stop under load that drains
  every worker, and after the restart every task stored exactly once.
"""
from __future__ import annotations

import configparser
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from crawld_proc import Crawld, parse_events
from harness import (free_port, jetstream_ready, leftover_processes, make_config,
                     nats_server_binary, port_open, run_async, wait_until)

from crawld.config import load_config, warc_directory
from crawld.process.supervisor import KILL_GRACE_S
from crawld.transports.base import TopologyError
from crawld.transports.jetstream.topology import add_stream_when_placed

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "crawld.service"
UNIT_TOML = DEPLOY / "systemd" / "crawld.toml"
HOST_TOML = DEPLOY / "cluster" / "crawld-host.toml"
SUPERVISOR_CONF = DEPLOY / "supervisord" / "crawld.conf"
NATS_CONFS = [DEPLOY / "cluster" / f"nats-node{i}.conf" for i in (1, 2, 3)]
SHIPPED_TOMLS = [UNIT_TOML, HOST_TOML]


# -- helpers ----------------------------------------------------------------------------
def _bin(name: str) -> str:
    """A console script of this interpreter's environment (not a pyenv shim)."""
    path = Path(sys.executable).parent / name
    if os.access(path, os.X_OK):
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found next to {sys.executable} or on PATH")
    return found


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without CRAWLD_* overrides from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRAWLD_")}
    env.update(extra)
    return env


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax: sections, repeated keys kept in order, '\\' continuations."""
    out: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def timespan_s(value: str) -> float:
    """systemd time span ('60', '90s', '1min 30s', '2m', '500ms') in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "second": 1, "seconds": 1, "ms": 0.001, "msec": 0.001,
             "m": 60, "min": 60, "minute": 60, "minutes": 60, "h": 3600, "hr": 3600,
             "hour": 3600, "hours": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value.strip())
    assert parts, f"not a time span: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def unit_values() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit.get(section, {}).get(key)
    assert values, f"[{section}] {key}= is missing"
    return values[-1]


# -- systemd ------------------------------------------------------------------------------
def test_systemd_unit_verifies_with_systemd_analyze(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (apt-get install systemd); "
                    "the configparser checks in the next test still ran")
    crawld = _bin("crawld")
    unit = tmp_path / "crawld.service"
    # ExecStart/ExecStartPre must name an existing executable for verify to pass.
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/crawld", crawld))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)
    # verify exits 0 on unknown keys / unparsable values and only warns: treat any line
    # about our unit as a failure.
    complaints = [line for line in (done.stdout + done.stderr).splitlines()
                  if "crawld.service" in line or str(unit) in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


def test_systemd_unit_relationships() -> None:
    text = UNIT.read_text()
    # Plain configparser (strict=False: repeated keys such as Environment= are allowed).
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    assert {"Unit", "Service", "Install"} <= set(parser.sections())

    unit = unit_values()
    cfg = load_config(str(UNIT_TOML), env={})
    svc = lambda key: one(unit, "Service", key)  # noqa: E731

    assert svc("Type") == "simple"
    assert svc("User") == "crawld"
    assert re.fullmatch(r"/\S+/crawld run -c /etc/crawld/crawld\.toml", svc("ExecStart"))
    assert re.fullmatch(r"/bin/kill -(s )?(SIG)?HUP \$MAINPID", svc("ExecReload"))
    assert svc("KillSignal") == "SIGTERM"
    assert svc("KillMode") == "mixed"
    stop_s = timespan_s(svc("TimeoutStopSec"))
    assert stop_s > cfg.workers.drain_timeout_s + KILL_GRACE_S, (
        f"TimeoutStopSec={stop_s}s would SIGKILL the supervisor before it finished draining "
        f"(drain_timeout_s {cfg.workers.drain_timeout_s} + kill grace {KILL_GRACE_S})")
    assert svc("Restart") == "on-failure"
    assert timespan_s(svc("RestartSec")) > 0
    assert "PYTHONUNBUFFERED=1" in " ".join(unit["Service"]["Environment"])

    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectControlGroups"):
        assert svc(key) == "yes", key
    assert svc("ProtectSystem") == "strict"
    assert "MemoryDenyWriteExecute" not in unit["Service"], "breaks libffi in Python wheels"
    assert "PrivateNetwork" not in unit["Service"], "a crawler needs the network"

    # ProtectSystem=strict makes everything read-only except these: every path the shipped
    # config writes must be below one of them, and the runtime dir must be the unit's.
    writable = " ".join(unit["Service"]["ReadWritePaths"]).split()
    assert {"/var/lib/crawld", "/run/crawld"} <= set(writable)
    assert svc("RuntimeDirectory") == "crawld" and svc("StateDirectory") == "crawld"
    assert cfg.workers.run_dir == "/run/crawld"
    assert cfg.workers.pid_file == "/run/crawld/crawld.pid"
    db_path = "/" + cfg.store.url[len("sqlite://"):].lstrip("/")
    for path in (db_path, cfg.store.body_dir, warc_directory(cfg.store), cfg.workers.run_dir,
                 cfg.workers.pid_file):
        assert any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable), path
    assert cfg.log.format == "json"
    assert (cfg.metrics.host, cfg.metrics.port) == ("127.0.0.1", 9464)
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


@pytest.mark.parametrize("path", SHIPPED_TOMLS, ids=lambda p: p.name)
def test_shipped_configs_pass_check_config(path: Path) -> None:
    done = subprocess.run([_bin("crawld"), "check-config", "-c", str(path)],
                          capture_output=True, text=True, timeout=60, env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "config ok" in done.stdout


def test_cluster_host_config_is_multi_host_ready() -> None:
    cfg = load_config(str(HOST_TOML), env={})
    assert cfg.store.url.startswith("postgresql://")
    assert cfg.queue.type == "quorum" and cfg.queue.replicas == 3
    assert cfg.workers.run_dir == "/run/crawld"


# -- NATS cluster ------------------------------------------------------------------------
def _rewrite_nats_conf(text: str, ports: dict[int, int], store_dir: Path) -> str:
    text = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{ports[int(m.group(1))]}", text)
    text, n = re.subn(r'(?m)^(\s*store_dir:\s*).*$', lambda m: f'{m.group(1)}"{store_dir}"', text)
    assert n == 1, "store_dir not found"
    return text


async def _stream_replicas(url: str, stream: str) -> int:
    import nats
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0,
                            allow_reconnect=False)
    try:
        info = await nc.jetstream().stream_info(stream)
        return 1 + len(info.cluster.replicas or []) if info.cluster else 1
    finally:
        await nc.close()


async def _add_r3_stream(url: str, wait_s: float) -> None:
    import nats
    from nats.js.api import StreamConfig
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0,
                            allow_reconnect=False)
    try:
        await add_stream_when_placed(nc.jetstream(), StreamConfig(
            name="PROBE", subjects=["probe.>"], num_replicas=3), wait_s=wait_s)
    finally:
        await nc.close()


def test_nats_cluster_configs_form_a_jetstream_cluster(tmp_path: Path, site: Any) -> None:
    binary = nats_server_binary()
    for conf in NATS_CONFS:     # the shipped files themselves: syntax and semantics
        done = subprocess.run([binary, "-c", str(conf), "-t"], capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, f"{conf.name}: {done.stdout}{done.stderr}"

    texts = [conf.read_text() for conf in NATS_CONFS]
    names = [re.search(r"(?m)^server_name:\s*(\S+)", t).group(1) for t in texts]  # type: ignore[union-attr]
    assert len(set(names)) == 3, "server_name must differ per node"
    cluster_names = {re.search(r"(?ms)^cluster\s*\{.*?^\s*name:\s*(\S+)", t).group(1)  # type: ignore[union-attr]
                     for t in texts}
    assert len(cluster_names) == 1, "one cluster name for all nodes"
    fixed = sorted({int(p) for t in texts for p in re.findall(r"127\.0\.0\.1:(\d+)", t)})
    ports = {p: free_port() for p in fixed}    # never bind the shipped fixed ports
    client_ports = [ports[int(re.search(r"(?m)^listen:\s*127\.0\.0\.1:(\d+)", t).group(1))]  # type: ignore[union-attr]
                    for t in texts]

    procs: list[subprocess.Popen[bytes]] = []
    daemon: Crawld | None = None
    publishing: subprocess.Popen[str] | None = None

    def boot(i: int) -> None:
        conf = tmp_path / f"nats-node{i}.conf"
        conf.write_text(_rewrite_nats_conf(texts[i - 1], ports, tmp_path / f"js{i}"))
        procs.append(subprocess.Popen(
            [binary, "-c", str(conf), "-l", str(tmp_path / f"nats-node{i}.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))

    def listening(count: int) -> bool:
        for i, proc in enumerate(procs, 1):
            if proc.poll() is not None:
                log = (tmp_path / f"nats-node{i}.log").read_text(errors="replace")
                raise AssertionError(f"node {i} exited {proc.returncode}:\n{log[-3000:]}")
        return all(port_open(p) for p in client_ports[:count])

    def meta_leader(count: int) -> None:
        for port in client_ports[:count]:   # JetStream answers once a meta leader is elected
            wait_until(lambda: jetstream_ready(f"nats://127.0.0.1:{port}"), 30, interval=0.2,
                       what=f"JetStream meta leader via :{port}")

    try:
        # Two of three nodes are a quorum: JetStream answers, but an R3 stream has no
        # placement until the third is current. Hosts and NATS nodes boot together, so
        # crawld waits for it instead of failing (err_code 10005).
        t0 = time.monotonic()
        boot(1)
        boot(2)
        wait_until(lambda: listening(2), 20, what="two NATS nodes listening")
        meta_leader(2)
        print(f"\nNATS 2 of 3 nodes: meta leader in {time.monotonic() - t0:.2f}s")
        with pytest.raises(TopologyError, match=r"err_code 10005\) for 1s: queue.replicas = 3 needs"):
            run_async(_add_r3_stream(f"nats://127.0.0.1:{client_ports[0]}", wait_s=1.0))

        # crawld against it as documented: every node in broker.url, queue.replicas = 3.
        urls = ",".join(f"nats://127.0.0.1:{p}" for p in client_ports)
        cfg = make_config(tmp_path, broker_url=urls, transport="jetstream",
                          queue={"name": f"t{uuid.uuid4().hex[:12]}", "replicas": 3},
                          store={"url": f"sqlite:///{tmp_path / 'crawld.db'}",
                                 "body_dir": str(tmp_path / "bodies")},
                          log={"format": "json"})
        daemon = Crawld(cfg, env=_clean_env(CRAWLD_LOG_FORMAT="json"))
        publish_log = tmp_path / "publish.log"
        publishing = daemon.start_publish(
            [site.url(f"/fast/r3-{uuid.uuid4().hex[:8]}-{i}") for i in range(5)], publish_log)
        wait_until(lambda: "jetstream_stream_placement_wait" in publish_log.read_text()
                   or publishing.poll() is not None, 20, what="the publisher waiting for placement")
        assert publishing.poll() is None, publish_log.read_text()

        boot(3)
        wait_until(lambda: listening(3), 20, what="three NATS nodes listening")
        out = publishing.communicate(timeout=60)[0] + publish_log.read_text()
        print(f"NATS 3-node JetStream cluster: stream placed {time.monotonic() - t0:.2f}s after boot")
        assert publishing.returncode == 0 and "confirmed 5" in out, out
        waits = parse_events(out, "jetstream_stream_placement_wait")
        assert waits and all(e["replicas"] == 3 and e["stream"] == "CRAWL" for e in waits), out
        assert run_async(_stream_replicas(f"nats://127.0.0.1:{client_ports[1]}", "CRAWL")) == 3
    finally:
        if publishing is not None and publishing.poll() is None:
            publishing.kill()
            publishing.wait(10)
        if daemon is not None:
            daemon.close()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    assert all(p.returncode is not None for p in procs)
    assert leftover_processes(str(tmp_path), names=("nats-server",)) == []


# -- supervisord ---------------------------------------------------------------------------
def test_supervisord_program_relationships() -> None:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.read_string(SUPERVISOR_CONF.read_text())
    prog = parser["program:crawld"]
    cfg = load_config(str(UNIT_TOML), env={})
    assert re.fullmatch(r"/\S+/crawld worker -c /etc/crawld/crawld\.toml", prog["command"])
    assert prog["numprocs"] == "3"
    assert "%(process_num)" in prog["process_name"]
    assert prog["stopsignal"] == "TERM"
    assert int(prog["stopwaitsecs"]) > cfg.workers.drain_timeout_s
    assert prog["autorestart"] == "true"
    assert prog["stopasgroup"] == "false" and prog["killasgroup"] == "true"
    assert int(prog["startsecs"]) > 0 and int(prog["startretries"]) > 0
    assert 'CRAWLD_LOG_FORMAT="json"' in prog["environment"]
    assert "%(process_num)" in prog["stdout_logfile"]


class Supervisord:
    """A real supervisord with a temp copy of deploy/supervisord/crawld.conf included."""

    def __init__(self, base: Path, crawld_config: Path) -> None:
        self.base = base
        self.logs = base / "logs"
        self.logs.mkdir()
        # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be long.
        self.sock_dir = Path(tempfile.mkdtemp(prefix="crawld-sv-"))
        self.program = base / "conf.d" / "crawld.conf"
        self.program.parent.mkdir()
        self.program.write_text(self._program_copy(crawld_config))
        self.conf = base / "supervisord.conf"
        self.conf.write_text(f"""\
[unix_http_server]
file={self.sock_dir}/supervisor.sock
chmod=0700

[supervisord]
logfile={base}/supervisord.log
pidfile={base}/supervisord.pid
childlogdir={self.logs}
nodaemon=true
user=root
identifier=crawldtest

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{self.sock_dir}/supervisor.sock

[include]
files = {self.program}
""")
        self.proc: subprocess.Popen[bytes] | None = None

    def _program_copy(self, crawld_config: Path) -> str:
        """Only paths change (command, config, directory, logs) and the user (there is no
        `crawld` account here); numprocs, stopsignal, stopwaitsecs, ... stay as shipped."""
        text = SUPERVISOR_CONF.read_text()
        subs = {
            "command": f"{_bin('crawld')} worker -c {crawld_config}",
            "directory": str(self.base),
            "stdout_logfile": f"{self.logs}/%(program_name)s-%(process_num)02d.log",
        }
        for key, value in subs.items():
            text, n = re.subn(rf"(?m)^{key}=.*$", lambda _m: f"{key}={value}", text)
            assert n == 1, f"{key}= not found in {SUPERVISOR_CONF}"
        text, n = re.subn(r"(?m)^user=.*$", "; user= removed by the test (no crawld account)", text)
        assert n == 1
        return text

    def start(self) -> None:
        out = open(self.base / "supervisord.out", "ab")
        self.proc = subprocess.Popen([_bin("supervisord"), "-n", "-c", str(self.conf)],
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     env=_clean_env(), start_new_session=True)
        out.close()
        wait_until(lambda: self._alive() and self.ctl("pid").returncode == 0, 20,
                   interval=0.1, what="supervisord answering on its socket")

    def _alive(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"supervisord exited {self.proc.returncode}:\n"
                                 + (self.base / "supervisord.out").read_text(errors="replace"))
        return True

    def ctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([_bin("supervisorctl"), "-c", str(self.conf), *args],
                              capture_output=True, text=True, timeout=timeout, env=_clean_env())

    def status(self) -> dict[str, tuple[str, int | None]]:
        """{name: (state, pid)} from `supervisorctl status` (its exit code is 3 when any
        process is not RUNNING, so it is not checked)."""
        out: dict[str, tuple[str, int | None]] = {}
        for line in self.ctl("status").stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].startswith("crawld:"):
                pid = re.search(r"pid (\d+)", line)
                out[parts[0]] = (parts[1], int(pid.group(1)) if pid else None)
        return out

    def wait_running(self, n: int, timeout: float = 30) -> dict[str, tuple[str, int | None]]:
        def ok() -> bool:
            st = self.status()
            return len(st) == n and all(state == "RUNNING" for state, _ in st.values())
        wait_until(ok, timeout, interval=0.2, what=f"{n} RUNNING crawld workers ({self.status()})")
        return self.status()

    def set_numprocs(self, n: int) -> None:
        text, count = re.subn(r"(?m)^numprocs=\d+$", f"numprocs={n}", self.program.read_text())
        assert count == 1
        self.program.write_text(text)

    def log_files(self) -> list[Path]:
        return sorted(self.logs.glob("crawld-*.log"))

    def offsets(self) -> dict[Path, int]:
        return {p: p.stat().st_size for p in self.log_files()}

    def events(self, name: str | None = None, since: dict[Path, int] | None = None
               ) -> dict[Path, list[dict[str, Any]]]:
        """JSON log events per worker log file, optionally only those written after ``since``."""
        out: dict[Path, list[dict[str, Any]]] = {}
        for path in self.log_files():
            with open(path, "rb") as fh:
                fh.seek((since or {}).get(path, 0))
                data = fh.read().decode(errors="replace")
            out[path] = parse_events(data, name)
        return out

    def shutdown(self, timeout: float = 90) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:   # supervisord runs in its own session; its group holds only itself
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def test_supervisord_numprocs_scale_and_graceful_stop(tmp_path: Path, rabbit: Any, site: Any,
                                                      queue_name: str) -> None:
    t_start = time.monotonic()
    run_dir = tmp_path / "run"
    # One site shared by every worker: the unpartitioned layout (test_fleet.py scales a
    # partitioned fleet with supervisorctl).
    config = make_config(
        tmp_path, broker_url=rabbit.url, transport="amqp",
        queue={"name": queue_name, "prefetch": 4, "partition": "none"},
        # prefetch == threads: nothing waits in a worker, so a drain gives nothing back.
        workers={"threads": 4, "drain_timeout_s": 20, "run_dir": str(run_dir)},
        fetch={"per_host_concurrency": 64},
        store={"url": f"sqlite:///{tmp_path / 'crawld.db'}", "body_dir": str(tmp_path / "bodies")},
        log={"format": "json"})
    daemon = Crawld(config, env=_clean_env(CRAWLD_LOG_FORMAT="json"))
    sv = Supervisord(tmp_path, config)
    key = uuid.uuid4().hex[:8]
    timings: dict[str, float] = {}
    try:
        sv.start()
        first = sv.wait_running(3)
        assert sorted(first) == [f"crawld:crawld-{i:02d}" for i in range(3)]
        for _, pid in first.values():   # really `crawld worker` processes, not wrappers
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"worker" in cmdline and str(config).encode() in cmdline, cmdline
        timings["3 workers RUNNING"] = time.monotonic() - t_start

        fast = [site.url(f"/fast/{key}-{i}") for i in range(30)]
        published = daemon.publish(fast)
        assert published.returncode == 0 and "confirmed 30" in published.stdout, published.stdout
        daemon.wait_finished(30, timeout=30)

        # -- scale 3 -> 5: supervisord replaces the whole group (its known limitation) ------
        t0 = time.monotonic()
        sv.set_numprocs(5)
        reread = sv.ctl("reread")
        assert reread.returncode == 0 and "crawld: changed" in reread.stdout, reread.stdout
        before_update = sv.offsets()
        update = sv.ctl("update")
        assert update.returncode == 0, update.stdout + update.stderr
        second = sv.wait_running(5)
        timings["numprocs 3->5 (reread+update+RUNNING)"] = time.monotonic() - t0
        assert sorted(second) == [f"crawld:crawld-{i:02d}" for i in range(5)]
        old_pids = {pid for _, pid in first.values()}
        assert not old_pids & {pid for _, pid in second.values()}, "whole group restarted"
        drained_on_update = [e for evs in sv.events("worker_drained", before_update).values()
                             for e in evs]
        assert len(drained_on_update) == 3 and all(e["unfinished"] == 0 for e in drained_on_update)

        # -- stop under load: every worker drains ----------------------------------------------
        slow = [site.url(f"/slow/1/{key}-{i}") for i in range(60)]
        published = daemon.publish(slow)
        assert published.returncode == 0 and "confirmed 60" in published.stdout, published.stdout
        wait_until(lambda: site.total_hits(f"/slow/1/{key}") >= 15, 30, interval=0.05,
                   what="slow fetches in flight on the 5 workers")
        before_stop = sv.offsets()
        t0 = time.monotonic()
        stop = sv.ctl("stop", "crawld:*")
        timings["supervisorctl stop crawld:* (drain)"] = stop_s = time.monotonic() - t0
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert all(state == "STOPPED" for state, _ in sv.status().values()), sv.status()
        assert stop_s < 20, f"drain of 1 s fetches took {stop_s:.1f}s"
        drained = sv.events("worker_drained", before_stop)
        assert len(drained) == 5 and all(len(evs) == 1 for evs in drained.values()), drained
        for path, (event,) in drained.items():
            assert event["unfinished"] == 0, (path.name, event)
            assert event["released"] == 0, (path.name, event)
        supervisord_log = (tmp_path / "supervisord.log").read_text()
        assert "SIGKILL" not in supervisord_log
        assert len(re.findall(r"stopped: crawld-\d+ \(exit status 0\)", supervisord_log)) >= 8
        stored_at_stop = daemon.count("results")
        assert stored_at_stop < 90, "the stop came while work was still queued"
        assert rabbit.queue_depth(queue_name) > 0

        # -- start again; everything finishes exactly once -----------------------------------
        t0 = time.monotonic()
        start = sv.ctl("start", "crawld:*")
        assert start.returncode == 0, start.stdout + start.stderr
        sv.wait_running(5)
        daemon.wait_finished(90, timeout=60)
        timings["restart + finish the rest"] = time.monotonic() - t0
        assert daemon.count("results") == 90
        assert daemon.count("results", "status = 'fetched'") == 90
        assert daemon.count("results", "writes > 1") == 0
        assert daemon.count("dead") == 0
        assert [e for evs in sv.events("duplicate_skipped").values() for e in evs] == []
        assert all(site.hits(f"/slow/1/{key}-{i}") == 1 for i in range(60)), "a fetch was redone"
        rc, rec = daemon.reconcile()
        assert rc == 0 and rec["lost"] == [] and rec["done"] == 90, rec
        workers = {row[0] for row in daemon.store.query("SELECT DISTINCT worker FROM results")}
        assert len(workers) >= 5, workers

        # -- shut supervisord down: nothing of crawld may be left ---------------------------------
        pids = {pid for _, pid in sv.status().values() if pid}
        t0 = time.monotonic()
        assert sv.shutdown() == 0
        timings["supervisord shutdown"] = time.monotonic() - t0
        wait_until(lambda: not leftover_processes(str(config)), 10,
                   what=f"no crawld worker left ({leftover_processes(str(config))})")
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
                 and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]
        assert alive == []
        final = [e for evs in sv.events("worker_drained").values() for e in evs]
        assert all(e["unfinished"] == 0 for e in final)
    finally:
        sv.kill()
        daemon.close()
        for info in leftover_processes(str(config)):
            os.kill(info.pid, signal.SIGKILL)
        rabbit.delete_queues(queue_name)
    print("\n" + "\n".join(f"  {what:<42} {secs:6.2f}s" for what, secs in timings.items()))
