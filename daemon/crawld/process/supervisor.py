"""The prefork supervisor (`crawld run`), in the manner of gunicorn's arbiter.

Signal handlers only queue the signal and wake the loop through a pipe; the main
loop dispatches ``handle_<sig>``, reaps children, reads worker heartbeats, replaces
stuck workers, and brings the worker count to the configured number every tick.

* TERM / INT: every worker drains (finish in-flight, ack, exit); then exit 0.
* QUIT: fast stop; unacked work goes back to the broker.
* HUP: re-read the config and replace workers one at a time (new count applies).
* TTIN / TTOU: one worker more / less (the removed one drains).
* A crashed worker is respawned with per-slot exponential backoff and jitter; a slot
  that crashes ``workers.crash_limit`` times in a row stops the supervisor with a
  clear error instead of fork-storming.

How a worker is started and what its heartbeats say is in children.py; the pid and
state files are in files.py.
"""
from __future__ import annotations

import os
import random
import select
import signal
import sys
import tempfile
import time
from typing import Any, Callable

from crawld.config import Config, ConfigError, runtime_dir
from crawld.logs import get_logger
from crawld.metrics import MULTIPROC_ENV, mark_worker_dead
from crawld.process.children import (Child, drain_fd, set_nonblocking, signal_child,
                                     spawn_worker)
from crawld.process.files import remove_quietly, state_file, write_pid_file, write_state
from crawld.process.states import Phase, StopMode
from crawld.process.worker import EXIT_BOOT_ERROR

log = get_logger("crawld.supervisor")

SIGNAL_NAMES = {signal.SIGHUP: "hup", signal.SIGQUIT: "quit", signal.SIGINT: "int",
                signal.SIGTERM: "term", signal.SIGTTIN: "ttin", signal.SIGTTOU: "ttou",
                signal.SIGCHLD: "chld"}
TICK_S = 0.5
STABLE_AFTER_S = 10.0          # a worker that ran this long resets its slot's crash count
BACKOFF_BASE_S = 0.5
KILL_GRACE_S = 10.0            # on top of drain_timeout_s before TERM escalates to KILL


class CrashLoop(RuntimeError):
    pass


class Supervisor:
    def __init__(self, cfg: Config, reload_config: Callable[[], Config]) -> None:
        self.cfg = cfg
        self.reload_config = reload_config
        self.generation = 1
        self.children: dict[int, Child] = {}
        self.slot_crashes: dict[int, int] = {}
        self.slot_not_before: dict[int, float] = {}
        self.signals: list[int] = []
        self.stopping = StopMode.NONE
        self.exit_code = 0
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            set_nonblocking(fd)
        self.metrics_server: Any = None
        self.metrics_dir: str = ""
        self.spawned = 0

    # -- signals: only queue and wake ------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if len(self.signals) < 20:
            self.signals.append(signum)
        try:
            os.write(self.wake_w, b".")
        except OSError:
            pass

    def install_signals(self) -> None:
        for signum in SIGNAL_NAMES:
            signal.signal(signum, self._on_signal)

    # -- main loop --------------------------------------------------------------------
    def run(self) -> int:
        self.install_signals()
        if self.cfg.workers.pid_file:
            write_pid_file(self.cfg.workers.pid_file)
        self._start_metrics()
        log.info("supervisor_starting", workers=self.cfg.workers.count, transport=self.cfg.broker.transport,
                 queue=self.cfg.queue.name, config=self.cfg.source_path or "(defaults)")
        try:
            while True:
                self._dispatch_signals()
                self._reap()
                if self.stopping is not StopMode.NONE:
                    break
                self._check_liveness()
                self._manage_workers()
                self._write_state()
                self._sleep(TICK_S)
            self._shutdown()
        except CrashLoop as exc:
            log.error("crash_loop", error=str(exc))
            print(f"crawld: {exc}", file=sys.stderr)
            self.stopping = StopMode.FAST
            self._shutdown()
            self.exit_code = 1
        finally:
            self._cleanup()
        return self.exit_code

    def _dispatch_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            getattr(self, f"handle_{SIGNAL_NAMES[signum]}")()

    def handle_term(self) -> None:
        log.info("supervisor_draining", workers=len(self.children))
        self.stopping = StopMode.GRACEFUL

    handle_int = handle_term

    def handle_quit(self) -> None:
        log.info("supervisor_fast_stop", workers=len(self.children))
        self.stopping = StopMode.FAST

    def handle_chld(self) -> None:
        pass    # reaping happens every tick

    def handle_ttin(self) -> None:
        self.cfg = self.cfg.replace("workers", count=self.cfg.workers.count + 1)
        log.info("workers_resize", count=self.cfg.workers.count, signal="TTIN")

    def handle_ttou(self) -> None:
        if self.cfg.workers.count > 0:
            self.cfg = self.cfg.replace("workers", count=self.cfg.workers.count - 1)
        log.info("workers_resize", count=self.cfg.workers.count, signal="TTOU")

    def handle_hup(self) -> None:
        try:
            new_cfg = self.reload_config()
        except ConfigError as exc:
            log.error("reload_failed", error=str(exc), keeping="previous config")
            return
        self.cfg = new_cfg
        self.generation += 1
        log.info("reloading", generation=self.generation, workers=new_cfg.workers.count)

    def _sleep(self, timeout: float) -> None:
        """Wait for a signal, a heartbeat, or the tick."""
        fds = [self.wake_r] + [c.pipe_r for c in self.children.values()]
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        for fd in ready:
            if fd == self.wake_r:
                drain_fd(fd)
        self._read_heartbeats([fd for fd in ready if fd != self.wake_r])

    # -- children ---------------------------------------------------------------------
    def _spawn(self, slot: int) -> Child:
        child = spawn_worker(self.cfg, slot, self.generation, self.metrics_dir)
        self.children[child.pid] = child
        self.spawned += 1
        log.info("worker_spawned", worker_pid=child.pid, slot=slot, generation=self.generation)
        return child

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            child.proc.returncode = os.waitstatus_to_exitcode(status)
            self._read_heartbeats([child.pipe_r])
            os.close(child.pipe_r)
            mark_worker_dead(pid)
            self._on_child_exit(child)

    def _on_child_exit(self, child: Child) -> None:
        code = child.proc.returncode
        lived = time.monotonic() - child.started_at
        if child.retiring or self.stopping is not StopMode.NONE:
            log.info("worker_exited", worker_pid=child.pid, slot=child.slot, exit_code=code,
                     lived_s=round(lived, 1))
            self.slot_crashes.pop(child.slot, None)
            return
        if code == EXIT_BOOT_ERROR and not child.ran:
            # gunicorn's rule: a worker that cannot boot will not boot on retry either.
            raise CrashLoop(f"worker slot {child.slot} failed to boot (exit code {code}): the broker "
                            f"or store refused our setup; see the worker_boot_failed event above")
        crashes = 1 if lived >= STABLE_AFTER_S else self.slot_crashes.get(child.slot, 0) + 1
        self.slot_crashes[child.slot] = crashes
        backoff = min(self.cfg.workers.backoff_max_s, BACKOFF_BASE_S * 2 ** (crashes - 1))
        delay = backoff * random.uniform(0.5, 1.5)
        self.slot_not_before[child.slot] = time.monotonic() + delay
        log.error("worker_died", worker_pid=child.pid, slot=child.slot, exit_code=code,
                  lived_s=round(lived, 1), crashes_in_a_row=crashes, backoff_s=backoff,
                  respawn_in_s=round(delay, 2))
        if crashes >= self.cfg.workers.crash_limit:
            raise CrashLoop(f"worker slot {child.slot} crashed {crashes} times in a row "
                            f"(last exit code {code}); stopping instead of respawning. "
                            f"Check the worker log above (broker/store reachable? config?)")

    def _read_heartbeats(self, fds: list[int]) -> None:
        by_fd = {c.pipe_r: c for c in self.children.values()}
        for fd in fds:
            child = by_fd.get(fd)
            if child is None:
                continue
            try:
                data = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                continue
            if data:
                child.feed(data)

    def _check_liveness(self) -> None:
        """A worker whose loop stopped beating is killed; the reaper respawns it."""
        limit = self.cfg.workers.liveness_timeout_s
        now = time.monotonic()
        for child in list(self.children.values()):
            if child.reported in (None, Phase.STARTING, Phase.CONNECTING):
                continue        # connect() may legitimately back off for long
            if now - child.last_beat > limit:
                log.error("worker_stuck", worker_pid=child.pid, slot=child.slot,
                          silent_s=round(now - child.last_beat, 1))
                signal_child(child.pid, signal.SIGKILL)
            if child.retiring and now > child.retire_deadline:
                log.warning("worker_drain_timeout", worker_pid=child.pid, slot=child.slot)
                signal_child(child.pid, signal.SIGKILL)

    def _retire(self, child: Child) -> None:
        child.retiring = True
        child.retire_deadline = time.monotonic() + self.cfg.workers.drain_timeout_s + KILL_GRACE_S
        log.info("worker_retiring", worker_pid=child.pid, slot=child.slot, generation=child.generation)
        signal_child(child.pid, signal.SIGTERM)

    def _manage_workers(self) -> None:
        desired = self.cfg.workers.count
        active = [c for c in self.children.values() if not c.retiring]
        old = sorted((c for c in active if c.generation < self.generation), key=lambda c: c.started_at)
        new = [c for c in active if c.generation == self.generation]
        retiring = any(c.retiring for c in self.children.values())
        if old:
            self._roll_step(desired, old, new, retiring)
            return
        if len(new) < desired:
            for _ in range(desired - len(new)):
                if not self._spawn_free_slot():
                    break
        elif len(new) > desired and not retiring:
            self._retire(min(new, key=lambda c: c.started_at))

    def _roll_step(self, desired: int, old: list[Child], new: list[Child], retiring: bool) -> None:
        """Replace old-generation workers one at a time, never more than one draining."""
        if retiring or any(not c.running for c in new):
            return
        if len(old) + len(new) > desired:
            self._retire(old[0])
        elif len(new) < desired:
            self._spawn_free_slot()

    def _spawn_free_slot(self) -> bool:
        used = {c.slot for c in self.children.values() if not c.retiring}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        if time.monotonic() < self.slot_not_before.get(slot, 0.0):
            return False
        self._spawn(slot)
        return True

    # -- shutdown ---------------------------------------------------------------------
    def _shutdown(self) -> None:
        sig = signal.SIGTERM if self.stopping is StopMode.GRACEFUL else signal.SIGQUIT
        wait_s = self.cfg.workers.drain_timeout_s + KILL_GRACE_S if sig == signal.SIGTERM else 5.0
        for child in self.children.values():
            signal_child(child.pid, sig)
        deadline = time.monotonic() + wait_s
        while self.children and time.monotonic() < deadline:
            if sig == signal.SIGTERM and self._escalated():
                sig, deadline = signal.SIGQUIT, min(deadline, time.monotonic() + 5.0)
                log.info("supervisor_fast_stop", workers=len(self.children), during="drain")
                for child in self.children.values():
                    signal_child(child.pid, sig)
            self._reap()
            self._write_state()
            self._sleep(0.1)
        for child in list(self.children.values()):
            log.warning("worker_killed", worker_pid=child.pid, reason="did not stop in time")
            signal_child(child.pid, signal.SIGKILL)
        while self.children:
            self._reap()
            time.sleep(0.05)
        log.info("supervisor_stopped", spawned=self.spawned)

    def _escalated(self) -> bool:
        """QUIT, or a second INT (Ctrl-C twice), during a graceful drain means: now."""
        pending, self.signals = self.signals, []
        return any(sig in (signal.SIGQUIT, signal.SIGINT) for sig in pending)

    def _cleanup(self) -> None:
        if self.cfg.workers.pid_file:
            remove_quietly(self.cfg.workers.pid_file)
        remove_quietly(state_file(self.cfg))
        if self.metrics_server is not None:
            self.metrics_server.shutdown()

    # -- state file and metrics -------------------------------------------------------
    def _write_state(self) -> None:
        now = time.monotonic()
        workers = [c.row(now) for c in sorted(self.children.values(), key=lambda c: c.slot)]
        write_state(state_file(self.cfg), {
            "pid": os.getpid(), "updated_at": time.time(), "generation": self.generation,
            "desired": self.cfg.workers.count, "stopping": self.stopping, "workers": workers})

    def _start_metrics(self) -> None:
        if not self.cfg.metrics.port:
            return
        from crawld.metrics import dead_rate_probe, serve_aggregate
        from crawld.store import open_store
        self.metrics_dir = tempfile.mkdtemp(prefix="crawld-metrics-", dir=runtime_dir(self.cfg))
        os.environ[MULTIPROC_ENV] = self.metrics_dir
        store_cfg = self.cfg.store
        self.metrics_server = serve_aggregate(self.cfg.metrics.host, self.cfg.metrics.port,
                                              dead_rate_probe(lambda: open_store(store_cfg)))
        log.info("metrics_listening", host=self.cfg.metrics.host, port=self.cfg.metrics.port)

