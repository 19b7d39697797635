"""One fetch worker process: a transport, a thread pool, a store. Broker-agnostic.

The main thread owns the transport and only polls it; deliveries are handed to a
ThreadPoolExecutor; a pool thread parses, fetches, classifies and stores, then asks
the transport to settle (ack / retry / dead). Ack comes strictly after the store
write, so a crash between the two is a duplicate, never a loss.

Signals only set flags (TERM/INT: drain, QUIT: fast stop); the loop does the work.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from crawld.pipeline.classify import Decision, Verdict, classify
from crawld.config import Config, runtime_dir
from crawld.fetch.fetcher import Fetcher, FetchResult
from crawld.logs import get_logger
from crawld.metrics import Metrics
from crawld.stats import Stats
from crawld.store.base import DeadRow, ResultRow, Store
from crawld.task import MalformedMessage, Task, parse_message
from crawld.transports.base import Action, Delivery, Settlement, TopologyError, Transport

log = get_logger("crawld.worker")

HEARTBEAT_FD_ENV = "CRAWLD_HEARTBEAT_FD"
FAULT_ENV = "CRAWLD_TEST_FAULT"      # test-only crash points, see _fault()
FAULT_ONCE_ENV = "CRAWLD_TEST_FAULT_ONCE_FILE"   # fire once per test run, not per process
HEARTBEAT_EVERY_S = 1.0


@dataclass
class WorkerState:
    state: str = "starting"
    inflight: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    duplicates: int = 0
    redelivered: int = 0
    started_at: float = 0.0


class Worker:
    def __init__(self, cfg: Config, transport: Transport, store: Store, fetcher: Fetcher,
                 metrics: Metrics | None = None, worker_id: str | None = None) -> None:
        self.cfg = cfg
        self.transport = transport
        self.store = store
        self.fetcher = fetcher
        self.metrics = metrics or Metrics(enabled=False)
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.pool = ThreadPoolExecutor(max_workers=cfg.workers.threads, thread_name_prefix="fetch")
        self.state = WorkerState(started_at=time.time())
        self._lock = threading.Lock()
        self._futures: dict[Future, Delivery] = {}
        self._active_ids: dict[str, threading.Event] = {}
        self._started: set[int] = set()         # id() of deliveries a pool thread picked up
        self._stop = False
        self._fast_stop = False
        self._parent = os.getppid()
        self._heartbeat_fd = _int_env(HEARTBEAT_FD_ENV)
        self._last_beat = 0.0
        self._faults = set(filter(None, os.environ.get(FAULT_ENV, "").split(",")))

    # -- life cycle ------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_drain_signal)
        signal.signal(signal.SIGINT, self._on_drain_signal)
        signal.signal(signal.SIGQUIT, self._on_fast_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)   # the supervisor rolls workers instead

    def _on_drain_signal(self, signum: int, frame: Any) -> None:
        self._stop = True                               # no logging here: not reentrant-safe

    def _on_fast_signal(self, signum: int, frame: Any) -> None:
        self._stop = self._fast_stop = True

    def request_stop(self) -> None:
        self._stop = True

    def run(self) -> int:
        self.transport.set_stop_check(lambda: self._stop)
        self.transport.set_reconnect_listener(self.metrics.on_reconnect)
        log.info("worker_starting", worker=self.worker_id, transport=self.transport.name,
                 threads=self.cfg.workers.threads, prefetch=self.cfg.queue.prefetch)
        if self.cfg.queue.prefetch > self.cfg.workers.threads:
            # Celery's ETA lesson: hoarded deliveries age against the broker's ack deadline
            # and all come back at once when this worker dies.
            log.warning("prefetch_exceeds_threads", prefetch=self.cfg.queue.prefetch,
                        threads=self.cfg.workers.threads)
        self._fault("boot")
        self._set_state("connecting")
        self.transport.connect()
        self.transport.start_consuming(self._on_delivery, self._free_slots)
        self._set_state("running")
        while not self._stop:
            self.transport.poll(0.2)
            self._tick()
        if self._fast_stop:
            return self._stop_fast()
        return self._drain()

    def _tick(self) -> None:
        if os.getppid() != self._parent:
            log.warning("supervisor_gone", worker=self.worker_id)
            self._stop = True
        if "stuck" in self._faults and _fault_armed():
            time.sleep(3600)          # test-only: a main loop that stops turning
        self._heartbeat()

    def _drain(self) -> int:
        """Stop taking work, finish what started, give back what did not, close."""
        started = time.monotonic()
        self._set_state("draining")
        self.transport.stop_consuming()
        released = self._release_unstarted()
        deadline = started + self.cfg.workers.drain_timeout_s
        while (self._inflight() or self.transport.pending_settlements()) and time.monotonic() < deadline:
            self.transport.poll(0.1)
            self._heartbeat()
        leftover = self._inflight()
        self.transport.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        log.info("worker_drained", worker=self.worker_id, released=released, unfinished=leftover,
                 drain_s=round(time.monotonic() - started, 3), done=self.state.done,
                 redelivered=self.state.redelivered, duplicates=self.state.duplicates)
        self._set_state("stopped")
        self._heartbeat(force=True)
        return 0

    def _stop_fast(self) -> int:
        log.info("worker_fast_stop", worker=self.worker_id, inflight=self._inflight())
        self.transport.close()
        os._exit(0)

    def _release_unstarted(self, grace_s: float = 1.0) -> int:
        """Deliveries still queued in the pool go back to the broker at once.

        With prefetch <= threads a queued delivery is only waiting for a thread that is
        finishing its previous task, so it gets a short grace to start; giving it back
        would be a redelivery caused by the stop.
        """
        deadline = time.monotonic() + min(grace_s, self.cfg.workers.drain_timeout_s)
        while self._unstarted() and time.monotonic() < deadline:
            self.transport.poll(0.02)
        waiting = self._unstarted()
        released = 0
        for future, delivery in waiting:
            if future.cancel():      # its done-callback (_forget) fixes the in-flight count
                self._prepay_redelivery(delivery)
                self.transport.settle(delivery, Settlement(Action.RELEASE, reason="draining"))
                released += 1
        return released

    def _prepay_redelivery(self, delivery: Delivery) -> None:
        """A delivery given back on purpose must not count toward the crash guard."""
        if self.transport.counts_deliveries:
            return
        try:
            task = parse_message(delivery.body, delivery.message_id, self.cfg.queue.max_message_bytes)
            self.store.bump_redelivery(task.task_id, delta=-1)
        except Exception:    # malformed or store trouble: the guard may count it once more
            pass

    def _unstarted(self) -> list[tuple[Future, Delivery]]:
        with self._lock:
            return [(f, d) for f, d in self._futures.items() if id(d) not in self._started]

    # -- deliveries ------------------------------------------------------------------
    def _free_slots(self) -> int:
        """How many more deliveries a pull transport may take: queue.prefetch bounds what a
        worker holds (as basic.qos does for AMQP), the thread count what it can start.
        Also while draining: a pull already answered is better processed than given back."""
        limit = min(self.cfg.workers.threads, self.cfg.queue.prefetch)
        return max(0, limit - self._inflight())

    def _inflight(self) -> int:
        with self._lock:
            return self.state.inflight

    def _on_delivery(self, delivery: Delivery) -> None:
        """I/O thread: never does the work, only hands it to the pool."""
        self.metrics.on_received(delivery.redelivered)
        with self._lock:
            self.state.inflight += 1
            self.state.redelivered += delivery.redelivered
            future = self.pool.submit(self._process, delivery)
            self._futures[future] = delivery
        future.add_done_callback(self._forget)
        self.metrics.set_inflight(self._inflight())

    def _forget(self, future: Future) -> None:
        with self._lock:
            delivery = self._futures.pop(future, None)
            if delivery is not None:
                self.state.inflight -= 1
                self._started.discard(id(delivery))

    def _process(self, delivery: Delivery) -> None:
        """Pool thread: handle one delivery and always settle it exactly once."""
        with self._lock:
            self._started.add(id(delivery))
        try:
            settlement = self._handle(delivery)
        except Exception as exc:  # a bug in our code: dead, never retried in a loop
            settlement = self._internal_error(delivery, exc)
        self._fault("before_settle")
        self.transport.settle(delivery, settlement)
        self._count(settlement)

    def _handle(self, delivery: Delivery) -> Settlement:
        try:
            task = parse_message(delivery.body, delivery.message_id, self.cfg.queue.max_message_bytes)
        except MalformedMessage as exc:
            return self._malformed(delivery, exc)
        with self._claim(task.task_id):
            return self._handle_task(delivery, task)

    @contextmanager
    def _claim(self, task_id: str) -> Iterator[None]:
        """A redelivered copy of a task this process is still fetching (e.g. after a
        reconnect) waits for the first copy instead of fetching the page twice."""
        with self._lock:
            running = self._active_ids.get(task_id)
            mine = None if running else self._active_ids.setdefault(task_id, threading.Event())
        if running is not None:
            running.wait(self.cfg.fetch.timeout_s + 5)
            yield
            return
        try:
            yield
        finally:
            with self._lock:
                self._active_ids.pop(task_id, None)
            mine.set()

    def _handle_task(self, delivery: Delivery, task: Task) -> Settlement:
        bound = log.bind(task_id=task.task_id, url=task.url, attempt=delivery.attempt)
        if self.store.has_result(task.task_id):
            bound.info("duplicate_skipped", redelivered=delivery.redelivered)
            return Settlement(Action.ACK, reason="duplicate", task=task)
        guard = self._delivery_limit(delivery, task)
        if guard is not None:
            bound.error("delivery_limit_reached", reason=guard.reason, error=guard.error)
            return self._dead(delivery, task, guard)
        self._fault("after_receive")
        if "poison" in self._faults and "/poison/" in task.url:
            os._exit(17)              # test-only: a task that kills every worker it reaches
        self._early_ack_demo(delivery, task)
        result = self.fetcher.fetch(task.url)
        self.metrics.on_fetch(result.elapsed_s, result.http_status)
        decision = classify(result, delivery.attempt, self.cfg.queue.max_deliver,
                            self.cfg.queue.retry_delays_s, self.cfg.fetch.retry_after_max_s)
        return self._record(delivery, task, result, decision, bound)

    def _delivery_limit(self, delivery: Delivery, task: Task) -> Decision | None:
        """Stop a task that keeps killing its worker from being redelivered forever."""
        limit = self.cfg.queue.max_deliver
        if delivery.attempt > limit:
            return Decision(Verdict.DEAD, reason="retries_exhausted",
                            error=f"delivered {delivery.attempt} times (max_deliver {limit})")
        count = delivery.broker_redeliveries
        if count is None and delivery.redelivered and not self.transport.counts_deliveries:
            count = self.store.bump_redelivery(task.task_id)
        if count is not None and count >= limit:
            return Decision(Verdict.DEAD, reason="redelivery_limit",
                            error=f"redelivered {count} times without being settled (worker crashes?)")
        return None

    def _record(self, delivery: Delivery, task: Task, result: FetchResult, decision: Decision,
                bound: Any) -> Settlement:
        if decision.verdict in (Verdict.RESULT, Verdict.SKIP):
            self._store_result(delivery, task, result, decision)
            action = Action.ACK if decision.verdict is Verdict.RESULT else Action.SKIP
            return Settlement(action, reason=decision.status, task=task)
        self.store.put_attempt(task.task_id, delivery.attempt, task.url, decision.error or decision.reason,
                               result.http_status, decision.delay_s, self.worker_id)
        if decision.verdict is Verdict.RETRY:
            bound.warning("fetch_retry", reason=decision.reason, error=decision.error,
                          delay_s=decision.delay_s, http_status=result.http_status)
            return Settlement(Action.RETRY, delay_s=decision.delay_s, reason=decision.reason,
                              error=decision.error, task=task)
        bound.error("fetch_dead", reason=decision.reason, error=decision.error,
                    http_status=result.http_status)
        return self._dead(delivery, task, decision)

    def _store_result(self, delivery: Delivery, task: Task, result: FetchResult,
                      decision: Decision) -> None:
        digest = self.store.save_body(result.body) if result.body else ""
        self._fault("before_store")
        self.store.put_result(ResultRow(
            task_id=task.task_id, url=task.url, final_url=result.final_url or task.url,
            status=decision.status, http_status=result.http_status,
            reason=decision.reason if decision.verdict is Verdict.SKIP else "",
            content_type=result.content_type, bytes=len(result.body), body_sha256=digest,
            attempts=delivery.attempt, fetched_at=time.time(), worker=self.worker_id,
            round=task.round, source=task.source, redirects=result.redirects,
            enqueued_at=task.enqueued_at, stream_seq=delivery.stream_seq))
        self._fault("after_store")

    def _dead(self, delivery: Delivery, task: Task, decision: Decision) -> Settlement:
        self.store.put_dead(DeadRow(
            task_id=task.task_id, url=task.url, reason=decision.reason, error=decision.error,
            attempts=delivery.attempt, origin=delivery.origin, dead_at=time.time(),
            body=delivery.body.decode("utf-8", "replace"), round=task.round, source=task.source))
        return Settlement(Action.DEAD, reason=decision.reason, error=decision.error, task=task)

    def _malformed(self, delivery: Delivery, exc: MalformedMessage) -> Settlement:
        task_id = delivery.message_id or "malformed-" + hashlib.sha256(delivery.body).hexdigest()[:24]
        log.error("message_malformed", task_id=task_id, url="", attempt=delivery.attempt,
                  reason=exc.reason, error=exc.detail, origin=delivery.origin)
        self.store.put_dead(DeadRow(
            task_id=task_id, url="", reason=f"malformed:{exc.reason}", error=exc.detail[:500],
            attempts=delivery.attempt, origin=delivery.origin, dead_at=time.time(),
            body=delivery.body[:4096].decode("utf-8", "replace")))
        return Settlement(Action.DEAD, reason=f"malformed:{exc.reason}", error=exc.detail)

    def _internal_error(self, delivery: Delivery, exc: Exception) -> Settlement:
        log.exception("internal_error", task_id=delivery.message_id, attempt=delivery.attempt,
                      error=repr(exc))
        try:
            task = parse_message(delivery.body, delivery.message_id, self.cfg.queue.max_message_bytes)
            return self._dead(delivery, task, Decision(Verdict.DEAD, reason="internal_error",
                                                       error=repr(exc)[:500]))
        except Exception as store_exc:
            # The store itself is failing: do not ack; a delayed retry keeps the task safe.
            log.error("store_unavailable", task_id=delivery.message_id, attempt=delivery.attempt,
                      error=repr(store_exc))
            return Settlement(Action.RETRY, delay_s=self.cfg.queue.retry_delays_s[0] if
                              self.cfg.queue.retry_delays_s else 1.0,
                              reason="store_unavailable", error=repr(store_exc)[:500])

    def _count(self, settlement: Settlement) -> None:
        outcome = {"duplicate": "duplicate"}.get(settlement.reason, settlement.action.value)
        with self._lock:
            if settlement.action in (Action.ACK, Action.SKIP):
                self.state.done += 1
                self.state.duplicates += settlement.reason == "duplicate"
            elif settlement.action is Action.RETRY:
                self.state.retried += 1
            elif settlement.action is Action.DEAD:
                self.state.dead += 1
        self.metrics.on_settled(outcome, settlement.reason)
        self._count_stats(settlement)

    def _count_stats(self, settlement: Settlement) -> None:
        """Scrapy's retry stat names, on the fetcher's stats object."""
        stats = self.fetcher.stats
        if settlement.action is Action.RETRY:
            stats.inc("retry/count")
            stats.inc(f"retry/reason_count/{settlement.reason}")
        elif settlement.action is Action.DEAD:
            stats.inc(f"dead/reason_count/{settlement.reason}")
            if settlement.reason == "retries_exhausted":
                stats.inc("retry/max_reached")

    # -- liveness and test hooks -------------------------------------------------------
    def _set_state(self, state: str) -> None:
        self.state.state = state
        self._heartbeat(force=True)

    def _heartbeat(self, force: bool = False) -> None:
        """One status line to the supervisor's pipe; its absence means a stuck loop."""
        now = time.monotonic()
        if self._heartbeat_fd is None or (not force and now - self._last_beat < HEARTBEAT_EVERY_S):
            return
        self._last_beat = now
        with self._lock:
            snapshot = dict(self.state.__dict__, pid=os.getpid(),
                            connected=self.transport.connected)
        snapshot["stats"] = self.fetcher.stats.snapshot()
        self.metrics.set_inflight(snapshot["inflight"])
        try:
            os.write(self._heartbeat_fd, (json.dumps(snapshot) + "\n").encode())
        except BlockingIOError:
            pass            # supervisor is behind; the next beat will do
        except OSError:
            self._heartbeat_fd = None

    def _early_ack_demo(self, delivery: Delivery, task: Task) -> None:
        """Test-only ``early_ack`` mode: ack before storing, then die. Shows the loss we avoid."""
        if "early_ack" not in self._faults or not _fault_armed():
            return
        self.transport.settle(delivery, Settlement(Action.ACK, task=task))
        while self.transport.pending_settlements():
            time.sleep(0.01)
        time.sleep(0.2)
        os._exit(17)

    def _fault(self, point: str) -> None:
        """Test-only: die at a named point (``CRAWLD_TEST_FAULT=after_store``)."""
        if point in self._faults and _fault_armed():
            os._exit(17)


def _fault_armed() -> bool:
    """With CRAWLD_TEST_FAULT_ONCE_FILE set, only the first process to get here fires."""
    marker = os.environ.get(FAULT_ONCE_ENV)
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value else None
    except ValueError:
        return None


EXIT_BOOT_ERROR = 3      # retrying cannot help: the supervisor stops instead of respawning


def run_worker(cfg: Config) -> int:
    """Entry point of `crawld worker` and of each supervisor child."""
    from crawld.store.base import open_store
    from crawld.transports import make_transport
    worker_id = f"{socket.gethostname()}:{os.getpid()}"
    try:
        # Writes go through one group-commit thread; the pool serves has_result() reads.
        store = open_store(cfg.store, pool_size=min(cfg.workers.threads + 2, 6))
        store.enable_group_commit()
    except Exception as exc:
        log.error("worker_boot_failed", reason="store", error=repr(exc))
        return EXIT_BOOT_ERROR
    fetcher = Fetcher(cfg.fetch, pool_size=cfg.workers.threads, run_dir=str(runtime_dir(cfg)),
                      stats=Stats())
    auto_ack = "auto_ack" in os.environ.get(FAULT_ENV, "").split(",")   # test-only demonstration
    transport = make_transport(cfg, worker_id, **({"auto_ack": True} if auto_ack else {}))
    worker = Worker(cfg, transport, store, fetcher, Metrics(), worker_id)
    worker.install_signal_handlers()
    try:
        return worker.run()
    except TopologyError as exc:
        log.error("worker_boot_failed", reason="topology", error=str(exc))
        return EXIT_BOOT_ERROR
    finally:
        fetcher.close()
        store.close()
