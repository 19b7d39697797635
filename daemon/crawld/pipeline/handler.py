"""One delivery in, one Settlement out: the whole delivery path, top to bottom.

    parse → claim (one copy per task id in this process) → duplicate? → delivery limit
    → fetch → classify → store (body sink, then result, attempt or dead row)
    → hooks + discovered URLs (confirmed) → Settlement (+ the result event)

The handler writes the store but never talks to the broker: the worker hands the
Settlement to its transport. Every store write happens before the Settlement is
returned, so the ack that follows it can only ever turn a crash into a duplicate.
The result event rides on the Settlement: the transport acks only once the broker
confirmed it, on the delivery's own connection, without holding a pool thread.
No broker, no threads of its own: tests drive it with a plain Delivery.
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from crawld.config import Config
from crawld.fetch import Fetcher, FetchResult
from crawld.fetch.reasons import Reason as FetchReason
from crawld.fetch.urls import BadURL, parse_url
from crawld.hooks import Page
from crawld.logs import get_logger
from crawld.metrics import Metrics
from crawld.output.events import event_body
from crawld.output.sinks import BodyFiles, BodySink
from crawld.pipeline.breaker import NetworkBreaker, Site, site_of
from crawld.pipeline.classify import Decision, Verdict, classify, retry_delay
from crawld.pipeline.crashguard import CrashGuard
from crawld.pipeline.faults import Fault, local_fault
from crawld.pipeline.hooks import REFETCH, HookOutcome, PageHooks, Refetch
from crawld.pipeline.middleware import Middleware
from crawld.pipeline.outcomes import Reason, malformed
from crawld.process.pause import Pause
from crawld.store import DeadRow, ResultRow, Store
from crawld.task import MalformedMessage, Task, parse_message
from crawld.transports.base import Action, Delivery, ResultEvent, Settlement

log = get_logger("crawld.pipeline")

CLAIM_GRACE_S = 5.0       # beyond fetch.timeout_s, how long a second copy waits for the first


class DeliveryHandler:
    """Thread-safe: pool threads call ``handle`` concurrently."""

    def __init__(self, cfg: Config, store: Store, fetcher: Fetcher, *, worker_id: str,
                 counts_deliveries: bool, metrics: Metrics | None = None,
                 middleware: Middleware | None = None, sink: BodySink | None = None,
                 pause: Pause | None = None,
                 breaker: NetworkBreaker | None = None, hooks: PageHooks | None = None) -> None:
        self.cfg = cfg
        self.hooks = hooks
        self.sink = sink or BodyFiles(store)
        self.announces = cfg.output.events
        self.store = store
        self.fetcher = fetcher
        self.worker_id = worker_id
        # True when Delivery.attempt already counts crash redeliveries (JetStream);
        # otherwise the store keeps the count for the crash-loop guard.
        self.counts_deliveries = counts_deliveries
        self.metrics = metrics or Metrics(enabled=False)
        self.middleware = middleware or Middleware()
        self._claims = _Claims(cfg.fetch.timeout_s + CLAIM_GRACE_S)
        self.pause = pause or Pause({}, cfg.workers.probe_max_s, lambda: False)
        self.breaker = breaker or NetworkBreaker(cfg.fetch.breaker_window, cfg.fetch.breaker_ratio,
                                                 cfg.fetch.breaker_min_sites)
        self.guard = CrashGuard(cfg, store, counts_deliveries=counts_deliveries, worker_id=worker_id)
        self.partitioned = cfg.queue.partition != "none"

    # -- the path -----------------------------------------------------------------------
    def handle(self, delivery: Delivery) -> Settlement:
        """Never raises: a bug in our code becomes a dead row, never a retry loop."""
        try:
            settlement = self._handle(delivery)
        except Exception as exc:
            fault = local_fault(exc)
            if fault is not None:
                return self._defer(delivery, fault, repr(exc))
            return self._internal_error(delivery, exc)
        if self.guard.owed and not self.pause.reason:
            self.guard.flush()
        return settlement

    def _handle(self, delivery: Delivery) -> Settlement:
        try:
            task = self.parse(delivery)
        except MalformedMessage as exc:
            return self._malformed(delivery, exc)
        if self.pause.reason:      # paused: hand back what was already prefetched, untouched
            return self._defer(delivery, self.pause.reason, "", task)
        with self._claims.hold(task.task_id):
            return self._handle_task(delivery, task)

    def _handle_task(self, delivery: Delivery, task: Task) -> Settlement:
        bound = log.bind(task_id=task.task_id, url=task.url, attempt=delivery.attempt)
        if self.store.has_result(task.task_id):        # dedup by task id, never by broker hints
            pending = self._pending_hooks(task)
            if pending is not REFETCH:
                return self._duplicate(delivery, task, pending, bound)
            bound.info("hooks_refetch", redelivered=delivery.redelivered)
        guard = self.guard.check(delivery, task)
        if guard.attempt != delivery.attempt:     # deliveries forgiven: the attempt it really is
            delivery = dataclasses.replace(delivery, attempt=guard.attempt)
            bound = bound.bind(attempt=guard.attempt)
        if guard.dead is not None:
            bound.error("delivery_limit_reached", reason=guard.dead.reason, error=guard.dead.error)
            return self._dead(delivery, task, guard.dead)
        if guard.suspect:
            bound.warning("suspect_isolated", worker=self.worker_id)
            with self.guard.alone(task):
                settlement = self._fetch_and_record(delivery, task, bound)
            bound.warning("suspect_survived", action=settlement.action.value, reason=settlement.reason)
            return settlement
        with self.guard.isolation.shared():
            return self._fetch_and_record(delivery, task, bound)

    def _fetch_and_record(self, delivery: Delivery, task: Task, bound: Any) -> Settlement:
        paused, unreachable = self._site_pause(task)
        if paused:
            if unreachable is not None and self.breaker.note(unreachable):
                return self._defer(delivery, Fault.NETWORK, f"{task.url}: site unreachable", task)
            return self._postpone(delivery, task, Reason.SITE_PAUSED, paused, bound)
        self.middleware.before_fetch(delivery, task)
        result = self.fetcher.fetch(task.url)
        self.metrics.on_fetch(result.elapsed_s, result.http_status)
        if self.partitioned and result.reason == FetchReason.POLITENESS:
            return self._postpone(delivery, task, Reason.SITE_BUSY,
                                  result.retry_after_s or self.cfg.fetch.per_host_delay_s, bound)
        if self.breaker.record(result):     # unreachable, like most sites lately: this host
            return self._defer(delivery, Fault.NETWORK, result.error, task)
        decision = classify(result, delivery.attempt, self.cfg.queue.max_deliver,
                            self.cfg.queue.retry_delays_s, self.cfg.fetch.retry_after_max_s)
        return self._record(delivery, task, result, decision, bound)

    def release(self, delivery: Delivery) -> Settlement:
        """A delivery a draining worker never started: give it back, no attempt used."""
        self.forgive([delivery])
        return Settlement(Action.RELEASE, reason=Reason.DRAINING)

    # -- the site asked us to wait ------------------------------------------------------
    def _site_pause(self, task: Task) -> tuple[float, Site | None]:
        """Seconds the task's site is paused for (a shard owner knows its sites' state), and
        the site when the pause is for being unreachable: the breaker counts that task as
        one more it could not fetch, as it would have without the pause."""
        if not self.partitioned:
            return 0.0, None
        try:
            host = parse_url(task.url).host
        except BadURL:
            return 0.0, None    # the fetch refuses it with its own reason
        limiter = self.fetcher.limiter
        paused = limiter.paused_for(host)
        return paused, site_of(task.url) if paused and limiter.unreachable(host) else None

    def _postpone(self, delivery: Delivery, task: Task, reason: str, delay_s: float,
                  bound: Any) -> Settlement:
        """Back to the broker after ``delay_s`` without using an attempt, instead of holding
        a thread or the delivery: the other sites of the shard keep flowing."""
        bound.info("task_postponed", reason=reason, delay_s=round(delay_s, 3))
        if self.counts_deliveries:       # JetStream: the nak is one more num_delivered
            self.forgive([delivery])
            self.guard.flush()
        return Settlement(Action.DEFER, delay_s=max(delay_s, 0.05), reason=reason, task=task)

    # -- not the task's fault ----------------------------------------------------------
    def forgive(self, deliveries: list[Delivery]) -> None:
        """Deliveries given back on purpose or by a lost connection: their redelivery must
        not count toward the crash guard (owed in memory; ``guard.flush`` writes it)."""
        ids = []
        for delivery in deliveries:
            try:
                ids.append(self.parse(delivery).task_id)
            except MalformedMessage:    # dead at once anyway, whatever its count
                pass
        self.guard.forgive(ids)

    def _defer(self, delivery: Delivery, fault: str, error: str, task: Task | None = None) -> Settlement:
        """Back to the broker without using an attempt; the first report pauses the worker."""
        if self.pause.trip(fault, error):
            log.warning("worker_fault", reason=fault, error=error[:300], worker=self.worker_id,
                        task_id=task.task_id if task else delivery.message_id,
                        url=task.url if task else "", attempt=delivery.attempt)
        if self.counts_deliveries:       # JetStream: the nak is one more num_delivered
            self.forgive([delivery])
            if fault != Fault.STORE:     # written before the nak, so no copy can miss it
                self.guard.flush()
        delays = self.cfg.queue.retry_delays_s
        return Settlement(Action.DEFER, delay_s=delays[0] if delays else 1.0, reason=fault,
                          error=error[:500], task=task)

    # -- store writes, each followed by the Settlement that may ack it ----------------
    def _record(self, delivery: Delivery, task: Task, result: FetchResult, decision: Decision,
                bound: Any) -> Settlement:
        if decision.verdict in (Verdict.RESULT, Verdict.SKIP):
            row = self._store_result(delivery, task, result, decision)
            if decision.verdict is Verdict.RESULT:
                failed = self._run_hooks(delivery, task, result, row, bound)
                if failed is not None:
                    return failed
            action = Action.ACK if decision.verdict is Verdict.RESULT else Action.SKIP
            return Settlement(action, reason=decision.status, task=task, event=self._event(task, row))
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
                      decision: Decision) -> ResultRow:
        body = self.sink.store(result)     # durable before the row that points at it
        self.middleware.before_store(delivery, task)
        row = ResultRow(
            task_id=task.task_id, url=task.url, final_url=result.final_url or task.url,
            status=decision.status, http_status=result.http_status,
            reason=decision.reason if decision.verdict is Verdict.SKIP else "",
            content_type=result.content_type, bytes=len(result.body), body_sha256=body.sha256,
            attempts=delivery.attempt, fetched_at=time.time(), worker=self.worker_id,
            round=task.round, source=task.source, redirects=result.redirects,
            enqueued_at=task.enqueued_at, stream_seq=delivery.stream_seq,
            warc_file=body.warc_file, warc_offset=body.warc_offset, warc_length=body.warc_length)
        self.store.put_result(row)
        self.middleware.after_store(delivery, task)
        return row

    # -- hooks: after the row, before the event and the ack ------------------------------
    def _run_hooks(self, delivery: Delivery, task: Task, result: FetchResult, row: ResultRow,
                   bound: Any) -> Settlement | None:
        """None when the hooks ran and their URLs are confirmed (or there are no hooks)."""
        if self.hooks is None or not self.hooks.enabled:
            return None
        outcome = self.hooks.run(self.hooks.page_from_fetch(task, result, row))
        return None if outcome.ok else self._hooks_failed(delivery, task, outcome, bound)

    def _pending_hooks(self, task: Task) -> Page | Refetch | None:
        """A stored page whose hooks did not complete (they raised, their URLs were not
        confirmed, the worker died before ``hooks_done``); None when there is none."""
        if self.hooks is None or not self.hooks.enabled:
            return None
        return self.hooks.pending_page(task)

    def _duplicate(self, delivery: Delivery, task: Task, pending: Page | None,
                   bound: Any) -> Settlement:
        """A stored task: run its unfinished hooks on the stored page, then ack (or
        re-announce) it without fetching again."""
        if pending is not None and self.hooks is not None:
            bound.info("hooks_rerun", redelivered=delivery.redelivered)
            outcome = self.hooks.run(pending)
            if not outcome.ok:
                return self._hooks_failed(delivery, task, outcome, bound)
        bound.info("duplicate_skipped", redelivered=delivery.redelivered)
        return Settlement(Action.ACK, reason=Reason.DUPLICATE, task=task,
                          event=self._event_of_stored(task))

    def _hooks_failed(self, delivery: Delivery, task: Task, outcome: HookOutcome,
                      bound: Any) -> Settlement:
        if outcome.unconfirmed:      # the broker's fault: give it back, it re-runs the hooks
            bound.warning("links_unconfirmed", error=outcome.unconfirmed)
            return Settlement(Action.RELEASE, reason=Reason.LINKS_UNCONFIRMED,
                              error=outcome.unconfirmed, task=task)
        last_line = outcome.error.strip().splitlines()[-1][:500]
        if delivery.attempt >= self.cfg.queue.max_deliver:
            bound.error("hook_dead", hook=outcome.hook, error=last_line)
            return self._dead(delivery, task, Decision(Verdict.DEAD, reason=Reason.HOOK_ERROR,
                                                       error=outcome.error))
        delay = retry_delay(delivery.attempt, self.cfg.queue.retry_delays_s)
        self.store.put_attempt(task.task_id, delivery.attempt, task.url, f"{Reason.HOOK_ERROR}: {last_line}",
                               None, delay, self.worker_id)
        bound.warning("hook_retry", hook=outcome.hook, error=last_line, delay_s=delay)
        return Settlement(Action.RETRY, delay_s=delay, reason=Reason.HOOK_ERROR, error=last_line,
                          task=task)

    # -- result events: after the row, confirmed before the ack ------------------------
    def _event(self, task: Task, row: Any) -> ResultEvent | None:
        """The event the transport must have confirmed before it acks (None: events off)."""
        if not self.announces:
            return None
        status = row["status"] if isinstance(row, dict) else row.status
        return ResultEvent(task.task_id, status, event_body(row))

    def _event_of_stored(self, task: Task) -> ResultEvent | None:
        """A stored task may have been given back because its event was not confirmed:
        announce it again (consumers deduplicate by task id)."""
        if not self.announces:
            return None
        row = self.store.get_result(task.task_id)
        return self._event(task, row) if row is not None else None

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
            task_id=task_id, url="", reason=malformed(exc.reason), error=exc.detail[:500],
            attempts=delivery.attempt, origin=delivery.origin, dead_at=time.time(),
            body=delivery.body[:4096].decode("utf-8", "replace")))
        return Settlement(Action.DEAD, reason=malformed(exc.reason), error=exc.detail)

    def _internal_error(self, delivery: Delivery, exc: Exception) -> Settlement:
        log.exception("internal_error", task_id=delivery.message_id, attempt=delivery.attempt,
                      error=repr(exc))
        try:
            task = self.parse(delivery)
            return self._dead(delivery, task, Decision(Verdict.DEAD, reason=Reason.INTERNAL_ERROR,
                                                       error=repr(exc)[:500]))
        except Exception as store_exc:
            # The store itself is failing: not the task's fault, no attempt used.
            log.error("store_unavailable", task_id=delivery.message_id, attempt=delivery.attempt,
                      error=repr(store_exc))
            return self._defer(delivery, local_fault(store_exc) or Fault.STORE, repr(store_exc))

    def parse(self, delivery: Delivery) -> Task:
        """The delivery's task, parsed once (raises MalformedMessage every time)."""
        task = delivery.task
        if task is None:
            task = delivery.task = parse_message(delivery.body, delivery.message_id,
                                                 self.cfg.queue.max_message_bytes)
        return task


class _Claims:
    """Task ids being handled in this process right now.

    A redelivered copy of a task this process is still fetching (e.g. after a
    reconnect) waits for the first copy instead of fetching the page twice; it then
    finds the stored result and is acked as a duplicate.
    """

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._lock = threading.Lock()
        # task id -> None while no second copy waits, else the Event that copy waits on
        # (made only then: an Event per task cost more than the rest of the claim).
        self._active: dict[str, threading.Event | None] = {}

    @contextmanager
    def hold(self, task_id: str) -> Iterator[None]:
        with self._lock:
            held = task_id in self._active
            if not held:
                self._active[task_id] = None
            else:
                running = self._active[task_id]
                if running is None:
                    running = self._active[task_id] = threading.Event()
        if held:
            running.wait(self.wait_s)
            yield
            return
        try:
            yield
        finally:
            with self._lock:
                waiting = self._active.pop(task_id)    # only the holder removes its claim
            if waiting is not None:
                waiting.set()
