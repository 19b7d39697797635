"""One fetch worker process: a transport, a thread pool, a store. Broker-agnostic.

The main thread owns the transport and only polls it; deliveries are handed to a
ThreadPoolExecutor; a pool thread runs the DeliveryHandler (parse, fetch, classify,
store) and hands its Settlement to the transport (ack / retry / dead). Ack comes
strictly after the store write, so a crash between the two is a duplicate, never a loss.

Signals only set flags (TERM/INT: drain, QUIT: fast stop); the loop does the work.
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from crawld.config import Config, runtime_dir, warc_directory
from crawld.fetch import Fetcher
from crawld.fetch.sites import SiteLimiter
from crawld.fleet.partition import HANDS_HELD, partition_key_of_host, shard_of_key, shard_pull_cap, site_of
from crawld.logs import get_logger
from crawld.metrics import Metrics
from crawld.output.sinks import BodySink, make_body_sink
from crawld.pipeline.breaker import HostEvidence, NetworkBreaker
from crawld.pipeline.faults import Fault
from crawld.pipeline.handler import DeliveryHandler
from crawld.pipeline.hooks import PageHooks
from crawld.pipeline.middleware import Middleware, MiddlewareChain, load_middleware
from crawld.pipeline.outcomes import Reason
from crawld.process.heartbeat import Heartbeat
from crawld.process.pause import Change, Pause, write_probe
from crawld.process.sitegate import SiteGate
from crawld.process.states import Phase
from crawld.stats import Stats
from crawld.store import Store
from crawld.task import MalformedMessage
from crawld.transports.base import Action, Delivery, Settlement, TopologyError, Transport

log = get_logger("crawld.worker")

EXIT_BOOT_ERROR = 3      # retrying cannot help: the supervisor stops instead of respawning
GC_YOUNG_THRESHOLD = 10_000   # allocations between young-generation collections (CPython: 700)


# The outcome counters of WorkerState: counted per thread without the lock (see _count).
OUTCOME_COUNTERS = ("done", "retried", "dead", "duplicates", "deferred")
COUNTER_OF_ACTION = {Action.ACK: "done", Action.SKIP: "done", Action.RETRY: "retried",
                     Action.DEAD: "dead", Action.DEFER: "deferred"}


@dataclass
class WorkerState:
    state: Phase = Phase.STARTING
    inflight: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    duplicates: int = 0
    redelivered: int = 0
    deferred: int = 0
    paused_reason: str = ""
    paused_since: float = 0.0
    started_at: float = 0.0


class Worker:
    def __init__(self, cfg: Config, transport: Transport, store: Store, fetcher: Fetcher,
                 metrics: Metrics | None = None, worker_id: str | None = None,
                 middleware: Middleware | None = None, sink: BodySink | None = None) -> None:
        self.cfg = cfg
        self.sink = sink or make_body_sink(cfg, store)     # in this process: a WARC file is ours
        self.transport = transport
        self.store = store
        self.fetcher = fetcher
        self.metrics = metrics or Metrics(enabled=False)
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.middleware = middleware or MiddlewareChain()
        self._stop = False
        self.breaker = NetworkBreaker(cfg.fetch.breaker_window, cfg.fetch.breaker_ratio,
                                      cfg.fetch.breaker_min_sites, cfg.fetch.connect_timeout_s,
                                      evidence=HostEvidence(runtime_dir(cfg) / "unreachable"))
        self.pause = Pause(self._probes(), cfg.workers.probe_max_s, lambda: self._stop)
        self.hooks = PageHooks(cfg, store)      # imported here, in this process, once
        self.handler = DeliveryHandler(cfg, store, fetcher, worker_id=self.worker_id,
                                       counts_deliveries=transport.counts_deliveries,
                                       metrics=self.metrics, middleware=self.middleware,
                                       sink=self.sink,
                                       pause=self.pause, breaker=self.breaker, hooks=self.hooks)
        self.pool = ThreadPoolExecutor(max_workers=cfg.workers.threads, thread_name_prefix="fetch")
        self.state = WorkerState(started_at=time.time())
        self._lock = threading.Lock()
        self._futures: dict[Future, Delivery] = {}
        # Outcomes counted by the pool threads, each in a table of its own: the worker's lock
        # is for in-flight bookkeeping only (16 threads took it twice more per task, and a
        # thread that lost the GIL while holding it stalled the others).
        self._outcomes = Stats()
        # A shard owner's tasks wait for their site without a thread (the only process that
        # may fetch them is this one); without partitioning politeness is per machine.
        self.gate = (SiteGate(cfg.fetch.per_host_concurrency, self._site_of)
                     if cfg.queue.partition != "none" else None)
        # More than a hand only where the shard pulls are capped (a large hand spread over
        # many shards): every task a SIGKILLed worker holds counts as a delivery, so a
        # small worker holds no more than it can start, as before.
        self._hands_held = HANDS_HELD if shard_pull_cap(cfg) is not None else 1
        self._fast_stop = False
        self._parent = os.getppid()
        self._beat = Heartbeat.from_env()

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

    def run(self) -> int:
        self.transport.set_stop_check(lambda: self._stop)
        self.transport.set_reconnect_listener(self.metrics.on_reconnect)
        self.transport.set_giveback_listener(self._on_giveback)
        self.transport.set_take_back(self._take_back)
        self.transport.set_shard_listener(self.fetcher.limiter.shard_acquired)
        self.transport.set_settled_listener(lambda _delivery, settlement: self._count(settlement))
        log.info("worker_starting", worker=self.worker_id, transport=self.transport.name,
                 threads=self.cfg.workers.threads, prefetch=self.cfg.queue.prefetch)
        if self.cfg.queue.prefetch > self.cfg.workers.threads:
            # Celery's ETA lesson: hoarded deliveries age against the broker's ack deadline
            # and all come back at once when this worker dies.
            log.warning("prefetch_exceeds_threads", prefetch=self.cfg.queue.prefetch,
                        threads=self.cfg.workers.threads)
        self.middleware.after_worker_boot(self)
        self._set_state(Phase.CONNECTING)
        self.transport.connect()     # declares crawl.events / CRAWL_EVENTS too (output.events)
        self.transport.start_consuming(self._on_delivery, self._free_slots)
        self._set_state(Phase.RUNNING)
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
        self.middleware.on_tick(self)
        change = self.pause.poll()
        if change is not None and not self._stop:
            self._on_pause_change(change)
        self.breaker.refresh()
        self._heartbeat()

    # -- faults of our own -------------------------------------------------------------
    def _probes(self) -> dict[str, Any]:
        """How each fault is tested while paused: the write that failed, for real."""
        body_dir = warc_directory(self.cfg.store) if self.cfg.store.bodies == "warc" else str(self.store.body_dir)

        def disk() -> None:
            write_probe(body_dir)       # where the body sink writes
            self.store.probe_write()
        return {Fault.DISK: disk, Fault.STORE: self.store.probe_write, Fault.NETWORK: self.breaker.probe}

    def _on_pause_change(self, change: Change) -> None:
        """One event per state change. Paused: stop taking deliveries (what is still
        prefetched is deferred by the handler at once, so nothing ages unacked against
        AckWait or consumer_timeout). Resumed: write owed forgiveness, consume again."""
        self.metrics.set_paused(change.reason, change.paused)
        with self._lock:
            self.state.paused_reason = change.reason if change.paused else ""
            self.state.paused_since = time.time() if change.paused else 0.0
        if change.paused:
            log.warning("worker_paused", worker=self.worker_id, reason=change.reason, error=change.error,
                        inflight=self._inflight())
            self.transport.stop_consuming()
            self._set_state(Phase.PAUSED)
            return
        self.breaker.reset()
        forgotten = self.fetcher.network_back() if change.reason == Fault.NETWORK else 0
        self.pool.submit(self.handler.guard.flush)
        log.info("worker_resumed", worker=self.worker_id, reason=change.reason,
                 paused_s=change.paused_for_s, probes=change.probes, deferred=self._counted().deferred,
                 robots_forgotten=forgotten)
        self.transport.start_consuming(self._on_delivery, self._free_slots)
        self._set_state(Phase.RUNNING)

    def _on_giveback(self, deliveries: list[Delivery]) -> None:
        """I/O thread: a lost connection or a close handed these back; forgive them. The
        parked ones are dropped: the broker delivers them again, fetching them here would
        be for nothing (their settlement could no longer reach the broker)."""
        ids = {id(d) for d in deliveries}
        self._take_back(lambda d: id(d) in ids)
        self.handler.forgive(deliveries)
        log.info("deliveries_forgiven", worker=self.worker_id, count=len(deliveries),
                 reason="connection lost or closed")
        if not self._stop:
            self.pool.submit(self.handler.guard.flush)

    def _take_back(self, matches: Callable[[Delivery], bool]) -> list[Delivery]:
        """I/O thread: the parked deliveries that ``matches``, out of the gate unstarted
        (the transport hands them back or over); none while nothing is parked."""
        if self.gate is None:
            return []
        with self._lock:
            taken = self.gate.discard(matches)
            self.state.inflight -= len(taken)
        return taken

    def _drain(self) -> int:
        """Stop taking work, finish what started, give back what did not, close."""
        started = time.monotonic()
        self._set_state(Phase.DRAINING)
        self.transport.stop_consuming()
        released = self._release_parked() + self._release_unstarted()
        deadline = started + self.cfg.workers.drain_timeout_s
        while (self._inflight() or self.transport.pending_settlements()) and time.monotonic() < deadline:
            self.transport.poll(0.1)
            released += self._release_parked()      # a pull answered during the drain
            self._heartbeat()
        leftover = self._inflight()
        self.transport.close()
        self.handler.guard.flush()       # what close() gave back, before the pool goes
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._close_outputs(leftover)
        state = self._counted()
        log.info("worker_drained", worker=self.worker_id, released=released, unfinished=leftover,
                 drain_s=round(time.monotonic() - started, 3), done=state.done,
                 redelivered=state.redelivered, duplicates=state.duplicates)
        self._set_state(Phase.STOPPED)
        return 0

    def _close_outputs(self, leftover: int) -> None:
        """The body sink. With fetches still running (drain timeout) the WARC file stays
        open for them; the next worker start recovers it."""
        if leftover:
            log.warning("warc_left_open", worker=self.worker_id, unfinished=leftover)
            return
        self.hooks.close()     # after the last page: nothing can want its link publisher now
        try:
            self.sink.close()
        except OSError as exc:
            log.error("body_sink_close_failed", worker=self.worker_id, error=repr(exc))

    def _stop_fast(self) -> int:
        log.info("worker_fast_stop", worker=self.worker_id, inflight=self._inflight())
        self.transport.close()
        self.handler.guard.flush()
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
        released = 0
        for future, delivery in self._unstarted():
            if future.cancel():      # its done-callback (_forget) fixes the in-flight count
                self.transport.settle(delivery, self.handler.release(delivery))
                released += 1
        return released

    def _release_parked(self) -> int:
        """Deliveries parked for their site go back at once: they never started."""
        if self.gate is None:
            return 0
        with self._lock:
            parked = self.gate.take_parked()
            self.state.inflight -= len(parked)
        for delivery in parked:
            self.transport.settle(delivery, self.handler.release(delivery))
        return len(parked)

    def _unstarted(self) -> list[tuple[Future, Delivery]]:
        """Still queued in the pool: a pool thread marks its future running before it calls
        _process, and a running future cannot be cancelled."""
        with self._lock:
            return [(f, d) for f, d in self._futures.items() if not (f.running() or f.done())]

    # -- deliveries ------------------------------------------------------------------
    def _free_slots(self) -> int:
        """How many more deliveries a pull transport may take: queue.prefetch bounds what a
        worker may start (as basic.qos does for AMQP), the thread count what it can start.
        Deliveries parked for their sites take no thread, so more may come while the threads
        are busy with others: with a large hand over many shards, up to HANDS_HELD hands in
        all, as the AMQP shard windows of a fair share allow, so that every site has tasks
        of its own waiting. (Counting only the running ones against one hand let a pull in
        only when a thread came free: every shard then got the same share of the threads,
        its sites' number aside, and the sites of big shards fell behind: 500 sites, 0.88.)
        Also while draining: a pull already answered is better processed than given back."""
        if self.pause.reason:
            return 0
        limit = min(self.cfg.workers.threads, self.cfg.queue.prefetch)
        return max(0, self._hands_held * limit - self._inflight())

    def _inflight(self) -> int:
        return self.state.inflight      # one attribute read: atomic, no lock needed

    def _on_delivery(self, delivery: Delivery) -> None:
        """I/O thread: never does the work, only hands it to the pool."""
        self.metrics.on_received(delivery.redelivered)
        with self._lock:
            self.state.inflight += 1
            self.state.redelivered += delivery.redelivered
            if self.gate is not None and self.gate.park(delivery):
                futures = self._start_parked()
            else:
                futures = [self._submit(delivery)]
        for future in futures:      # outside the lock: a future already done calls _forget now
            future.add_done_callback(self._forget)
        self.metrics.set_inflight(self._inflight())

    def _submit(self, delivery: Delivery) -> Future:
        """Under the lock."""
        future = self.pool.submit(self._process, delivery)
        self._futures[future] = delivery
        return future

    def _start_parked(self) -> list[Future]:
        """Under the lock: parked deliveries for the threads that are free, the sites with
        the fewest fetches running first."""
        started = []
        while len(self._futures) < self.cfg.workers.threads:
            delivery = self.gate.next() if self.gate is not None else None
            if delivery is None:
                break
            started.append(self._submit(delivery))
        return started

    def _site_of(self, delivery: Delivery) -> str | None:
        try:
            task = self.handler.parse(delivery)
        except MalformedMessage:
            return None
        return site_of(task.url) or None

    def _forget(self, future: Future) -> None:
        started: list[Future] = []
        with self._lock:
            delivery = self._futures.pop(future, None)
            if delivery is None:
                return
            self.state.inflight -= 1
            if self.gate is not None:
                self.gate.finished(delivery)
                if not self._stop:     # draining: the drain gives the parked ones back
                    started = self._start_parked()
        for successor in started:
            successor.add_done_callback(self._forget)

    def _process(self, delivery: Delivery) -> None:
        """Pool thread: handle one delivery and settle it exactly once."""
        settlement = self.handler.handle(delivery)
        self.middleware.before_settle(delivery, settlement)
        self.transport.settle(delivery, settlement)
        if settlement.event is None:     # else counted once the transport knows (run())
            self._count(settlement)

    def _count(self, settlement: Settlement) -> None:
        duplicate = settlement.reason == Reason.DUPLICATE
        outcome = "duplicate" if duplicate else settlement.action.value
        counter = COUNTER_OF_ACTION.get(settlement.action)
        if counter is not None:
            self._outcomes.inc(counter)
            if duplicate:
                self._outcomes.inc("duplicates")
        self.metrics.on_settled(outcome, settlement.reason)
        self._count_stats(settlement)

    def _counted(self) -> WorkerState:
        """The state with the outcome counters summed over the pool threads' tables."""
        counts = self._outcomes.snapshot()
        for name in OUTCOME_COUNTERS:
            setattr(self.state, name, int(counts.get(name, 0)))
        return self.state

    def _count_stats(self, settlement: Settlement) -> None:
        """Scrapy's retry stat names, on the fetcher's stats object."""
        stats = self.fetcher.stats
        if settlement.action is Action.RETRY:
            stats.inc("retry/count")
            stats.inc(f"retry/reason_count/{settlement.reason}")
        elif settlement.action is Action.DEAD:
            stats.inc(f"dead/reason_count/{settlement.reason}")
            if settlement.reason == Reason.RETRIES_EXHAUSTED:
                stats.inc("retry/max_reached")

    # -- liveness ----------------------------------------------------------------------
    def _set_state(self, state: Phase) -> None:
        self.state.state = state
        self._heartbeat(force=True)

    def _heartbeat(self, force: bool = False) -> None:
        """One status line to the supervisor's pipe; its absence means a stuck loop."""
        if not self._beat.due(force):
            return
        state = self._counted()
        with self._lock:
            snapshot = dict(state.__dict__, pid=os.getpid(), connected=self.transport.connected,
                            waiting_for_site=self.gate.parked if self.gate is not None else 0)
        snapshot["stats"] = self.fetcher.stats.snapshot()
        snapshot.update(self._fleet())
        self.metrics.set_inflight(snapshot["inflight"])
        self.metrics.set_fleet(len(snapshot["shards"]), len(snapshot["paused_sites"]), snapshot["handovers"])
        self._beat.send(snapshot)

    def _fleet(self) -> dict[str, Any]:
        """Shards served here and the sites paused by their owner (this worker)."""
        paused = self.fetcher.limiter.paused_sites()
        return {"shards": self.transport.owned_shards(), "handovers": self.transport.handovers,
                "paused_sites": dict(sorted(paused.items(), key=lambda kv: -kv[1])[:20])}


def site_limiter(cfg: Config) -> SiteLimiter | None:
    """In-process politeness for a shard owner; None (flock files) without partitioning."""
    if cfg.queue.partition == "none":
        return None
    # A quarter of the pool may wait for one site; the rest stays free for the others.
    return SiteLimiter(cfg.fetch.per_host_concurrency, cfg.fetch.per_host_delay_s,
                       max_waiting=max(1, cfg.workers.threads // 4),
                       max_not_before_s=cfg.fetch.retry_after_max_s,
                       shard_of=lambda host: shard_of_key(partition_key_of_host(host, cfg.queue.partition),
                                                          cfg.queue.shards))


def run_worker(cfg: Config) -> int:
    """Entry point of `crawld worker` and of each supervisor child."""
    from crawld.process.boot import open_store_when_ready
    from crawld.store import open_store
    from crawld.transports import make_transport
    worker_id = f"{socket.gethostname()}:{os.getpid()}"
    middleware = load_middleware(cfg.pipeline.middleware)   # ConfigError: exit 2, names the key
    try:
        # Writes go through one group-commit thread; the pool serves has_result() reads.
        store = open_store_when_ready(cfg, lambda: open_store(cfg.store, pool_size=min(cfg.workers.threads + 2, 6)))
        store.enable_group_commit()
    except Exception as exc:
        log.error("worker_boot_failed", reason="store", error=repr(exc))
        return EXIT_BOOT_ERROR
    fetcher = Fetcher(cfg.fetch, pool_size=cfg.workers.threads, run_dir=str(runtime_dir(cfg)),
                      stats=Stats(), limiter=site_limiter(cfg))
    transport = make_transport(cfg, worker_id)
    try:
        sink = make_body_sink(cfg, store)
    except OSError as exc:
        log.error("worker_boot_failed", reason="body_sink", error=repr(exc))
        store.close()
        return EXIT_BOOT_ERROR
    worker = Worker(cfg, transport, store, fetcher, Metrics(), worker_id, middleware,
                    sink=sink)
    worker.install_signal_handlers()
    _tune_gc()
    try:
        return worker.run()
    except TopologyError as exc:
        log.error("worker_boot_failed", reason="topology", error=str(exc))
        return EXIT_BOOT_ERROR
    finally:
        fetcher.close()
        store.close()
        if worker.breaker.evidence is not None:
            worker.breaker.evidence.close()


def _tune_gc() -> None:
    """What boot made (modules, config, pools) lives as long as the worker: out of the
    collector's sight. A page's garbage is mostly freed by reference counting, so young
    collections can run ~15x less often than CPython's default (700 allocations)."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
