"""One forked worker as the supervisor sees it: its process, heartbeat pipe and last report.

Workers are started as ``python -m crawld worker`` with the effective config passed as
CRAWLD_* env overrides and the write end of a pipe; every heartbeat is one JSON line on
it. A pipe, not a file: gunicorn's heartbeat file on /tmp stalled on slow disks.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from crawld.config import Config, env_for, runtime_dir
from crawld.metrics import MULTIPROC_ENV
from crawld.process.heartbeat import HEARTBEAT_FD_ENV
from crawld.process.states import Phase


@dataclass
class Child:
    slot: int
    proc: subprocess.Popen
    generation: int
    pipe_r: int
    started_at: float = field(default_factory=time.monotonic)
    last_beat: float = field(default_factory=time.monotonic)
    status: dict[str, Any] = field(default_factory=dict)
    retiring: bool = False
    retire_deadline: float = 0.0
    ran: bool = False              # reported "running" at least once
    buffer: bytes = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def reported(self) -> str | None:
        """The phase of the last heartbeat, None before the first one."""
        return self.status.get("state")

    @property
    def running(self) -> bool:
        return self.reported in (Phase.RUNNING, Phase.DRAINING, Phase.PAUSED)

    @property
    def phase(self) -> str:
        """What the state file shows: RETIRING is the supervisor's word, not the worker's."""
        if self.retiring and self.reported == Phase.RUNNING:
            return Phase.RETIRING
        return self.status.get("state", Phase.STARTING)

    def feed(self, data: bytes) -> None:
        """Take bytes from the heartbeat pipe; the last complete line is the status."""
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        if not lines:
            return
        self.last_beat = time.monotonic()
        try:
            self.status = json.loads(lines[-1])
        except ValueError:
            pass
        self.ran = self.ran or self.reported == Phase.RUNNING

    def row(self, now: float) -> dict[str, Any]:
        """This worker's entry in the supervisor state file."""
        counter = self.status.get
        return {"pid": self.pid, "slot": self.slot, "generation": self.generation,
                "state": self.phase, "inflight": counter("inflight", 0),
                "waiting_for_site": counter("waiting_for_site", 0), "done": counter("done", 0),
                "retried": counter("retried", 0), "dead": counter("dead", 0),
                "redelivered": counter("redelivered", 0), "stats": counter("stats", {}),
                "deferred": counter("deferred", 0), "paused_reason": counter("paused_reason", ""),
                "paused_s": round(time.time() - counter("paused_since"), 1) if counter("paused_since") else 0.0,
                "shards": counter("shards", []), "handovers": counter("handovers", 0),
                "paused_sites": counter("paused_sites", {}),
                "age_s": round(now - self.started_at, 1), "last_beat_s": round(now - self.last_beat, 1)}


def spawn_worker(cfg: Config, slot: int, generation: int, metrics_dir: str) -> Child:
    """Start one ``crawld worker`` child with a heartbeat pipe."""
    pipe_r, pipe_w = os.pipe()
    set_nonblocking(pipe_r)
    set_nonblocking(pipe_w)
    env = dict(os.environ)
    env.update(env_for(cfg))
    env["CRAWLD_WORKERS_RUN_DIR"] = str(runtime_dir(cfg))
    env[HEARTBEAT_FD_ENV] = str(pipe_w)
    if metrics_dir:
        env[MULTIPROC_ENV] = metrics_dir
    cmd = [sys.executable, "-m", "crawld", "worker"]
    if cfg.source_path:
        cmd += ["-c", cfg.source_path]
    proc = subprocess.Popen(cmd, env=env, pass_fds=[pipe_w], stdin=subprocess.DEVNULL)
    os.close(pipe_w)
    return Child(slot=slot, proc=proc, generation=generation, pipe_r=pipe_r)


def signal_child(pid: int, sig: int) -> None:
    """A child that already exited is reaped later; signalling it is not an error."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def set_nonblocking(fd: int) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)


def drain_fd(fd: int) -> None:
    """Empty the wake-up pipe: one wake-up per tick is enough, however many signals came."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise
