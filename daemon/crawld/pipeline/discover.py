"""Discovered URLs become tasks: canonicalise, scope, dedupe, outbox, confirmed publish.

A page's new tasks are written to the outbox (one multi-row insert) and published with
broker confirms before the page's delivery is acked, so a crash at any point leaves
them in the outbox (``new``) and the page unacked: its redelivery runs its hooks again
and publishes what is still unconfirmed. Task ids are ``task_id_for(url, round)``, so a
URL found twice -- on two pages, on two hosts at once -- is one outbox row; the page
whose insert created the row (its ``parent``) publishes it, and the broker's message-id
dedup (JetStream) or the results upsert (AMQP) absorbs the rare double publish (one
page delivered twice at once).

Publishing goes through the transport's ``Publisher`` (``crawld.transports``), the same
path as ``crawld publish``. One ``LinkPublisher`` thread per worker batches the pages of
all pool threads into one publish with one round of confirms.
"""
from __future__ import annotations

import functools
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable
from urllib.parse import urljoin

from crawld.config import Config
from crawld.hooks import Link
from crawld.logs import get_logger
from crawld.pipeline.scope import scope_for, site_hosts
from crawld.store import Store
from crawld.task import Task, canonical_url, task_id_for_canonical
from crawld.transports.base import Publisher

log = get_logger("crawld.discover")

PUBLISH_TIMEOUT_S = 30.0     # a page waits this long for its links' confirms, then is given back
MAX_BATCH = 5000             # tasks per publish call
LANES = 4                    # publisher threads (and broker connections) per worker


@dataclass
class Found:
    """One page's discoveries after scope and dedup."""
    tasks: list[Task] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)


def discovered_tasks(parent: Task, raw: Iterable[str | Link], base: Config,
                     known: Callable[[str], bool] | None = None, final_url: str = "") -> Found:
    """Canonical, in-scope, de-duplicated child tasks of ``parent`` (at most
    ``max_links_per_page``). ``known(task_id)`` true: the id is in the outbox already,
    leave it out. ``final_url``: where the parent's fetch ended (see ``site_hosts``).
    A bad entry from a hook is skipped, never fatal."""
    scope = scope_for(base.scope, parent.scope)
    found = Found()
    depth = parent.depth + 1
    if scope.max_depth and depth > scope.max_depth:     # a leaf of this crawl: nothing to do
        return found
    seen = {parent.task_id}
    site_check = scope.site_checker(site_hosts(parent.url, final_url), depth)
    for item in raw:
        # Cheap checks on the URL as written first: most off-site links never need the
        # (slow) canonicalisation, and a site's menu links resolve from the cache.
        url = item if isinstance(item, str) else item.url if isinstance(item, Link) else str(item)
        if final_url and not url[:8].lower().startswith(("http://", "https://")):
            url = urljoin(final_url, url)        # a hook may return links relative to the page
        why = site_check(url)
        resolved = _resolve(url, parent.round) if why is None else None
        if resolved is not None:
            if resolved[1] in seen:
                continue
            why = scope.rejects_pattern(resolved[0]) if scope.has_patterns else None
        if why is not None or resolved is None:
            why = why or "invalid"
            found.rejected[why] = found.rejected.get(why, 0) + 1
            continue
        seen.add(resolved[1])
        if known is not None and known(resolved[1]):
            continue
        found.tasks.append(_task(parent, resolved, depth, item))
        if len(found.tasks) >= scope.max_links_per_page:
            break
    return found


def _task(parent: Task, resolved: tuple[str, str], depth: int, item: object) -> Task:
    return Task(task_id=resolved[1], url=resolved[0], round=parent.round, source=parent.source,
                enqueued_at=time.time(), depth=depth, parent=parent.task_id,
                meta=_meta(item) if isinstance(item, Link) else "", scope=parent.scope)


@functools.lru_cache(maxsize=65536)
def _resolve(url: str, round_: str) -> tuple[str, str] | None:
    """(canonical URL, task id), or None if w3lib cannot parse it. Cached: a site's menu
    links are the same on every page (lru_cache is thread-safe)."""
    try:
        canonical = canonical_url(url)     # w3lib: fragment dropped, query sorted, case fixed
    except (ValueError, TypeError):
        return None
    return canonical, task_id_for_canonical(canonical, round_)


def _meta(link: Link) -> str:
    if not link.meta and not link.priority:
        return ""
    meta = dict(link.meta or {})
    if link.priority:
        meta["priority"] = link.priority
    return json.dumps(meta, separators=(",", ":"), sort_keys=True, default=str)


def to_publish(store: Store, parent: Task, tasks: list[Task], known: "KnownIds | None" = None) -> list[Task]:
    """Outbox first (durable); then what this page must publish: the rows still ``new``
    whose ``parent`` is this page. The first insert of a task id wins, so of two pages
    (or hosts) finding one URL at once only one publishes it; on a redelivery the same
    query finds what an earlier attempt inserted but never got confirmed.

    ``known`` skips ids this worker already saw in the outbox (a site's menu links are on
    every page): their rows exist, so inserting them again would change nothing. It never
    holds this page's own unconfirmed rows (they are added once confirmed)."""
    fresh = [t for t in tasks if known is None or not known.has(t.task_id)]
    if fresh:
        store.outbox_insert(fresh)
    pending = store.outbox_unconfirmed_children(parent.task_id)    # indexed: outbox_parent
    if known is not None:
        mine = {t.task_id for t in pending}
        known.add(t.task_id for t in fresh if t.task_id not in mine)
    return pending


class KnownIds:
    """Task ids with an outbox row, remembered by one worker (bounded, thread-safe)."""

    def __init__(self, limit: int = 200_000) -> None:
        self.limit = limit
        self._ids: dict[str, None] = {}
        self._lock = threading.Lock()

    def has(self, task_id: str) -> bool:
        return task_id in self._ids          # a dict read is atomic under the GIL

    def add(self, task_ids: Iterable[str]) -> None:
        with self._lock:
            for task_id in task_ids:
                self._ids[task_id] = None
            while len(self._ids) > self.limit:          # drop the oldest
                del self._ids[next(iter(self._ids))]


class LinkPublisher:
    """Confirmed publishing of discovered tasks for one worker process.

    ``publish`` is thread-safe and blocks the calling pool thread until its tasks are
    confirmed (or failed). Each of ``lanes`` publisher threads takes everything queued by
    the pool threads and publishes it as one batch with its own ``Publisher``: a page
    waits for about one batch's round of confirms, not for a connection and a round trip
    per URL, and not behind a batch already in flight."""

    def __init__(self, cfg: Config, store: Store, factory: Callable[[], Publisher] | None = None,
                 timeout_s: float = PUBLISH_TIMEOUT_S, lanes: int = LANES) -> None:
        self.cfg = cfg
        self.store = store
        self.timeout_s = timeout_s
        self.lanes = max(1, lanes)
        self._factory = factory or self._default_factory
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.batches = 0
        self.published = 0
        self.publish_s = 0.0         # wall time in Publisher.publish (the confirm round trips)

    def _default_factory(self) -> Publisher:
        from crawld.transports import make_publisher
        # The worker's transport declared the queues/streams before consuming.
        return make_publisher(self.cfg, declare=False)

    def publish(self, tasks: list[Task]) -> dict[str, str]:
        """{task_id: reason} of the tasks not confirmed ({} = all confirmed)."""
        if not tasks:
            return {}
        request = _Request(tasks)
        self._ensure_threads()
        self._queue.put(request)
        if not request.done.wait(self.timeout_s + 5):
            return {t.task_id: "publisher timed out" for t in tasks}
        return request.failed

    def close(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join(self.timeout_s + 5)
        if self.batches:
            log.info("links_publisher_closed", batches=self.batches, published=self.published,
                     publish_s=round(self.publish_s, 3),
                     tasks_per_batch=round(self.published / self.batches, 1))

    def _ensure_threads(self) -> None:
        with self._lock:
            while len(self._threads) < self.lanes:
                thread = threading.Thread(target=self._run, name=f"links-publisher-{len(self._threads)}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)

    def _run(self) -> None:
        lane = _Lane(self._factory)
        while True:
            first = self._queue.get()
            if first is None:
                break
            batch, stop = self._gather(first)
            self._publish_batch(lane, batch)
            if stop:
                break
        lane.close()

    def _gather(self, first: "_Request") -> tuple[list["_Request"], bool]:
        batch, size = [first], len(first.tasks)
        while size < MAX_BATCH:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                return batch, True
            batch.append(more)
            size += len(more.tasks)
        return batch, False

    def _publish_batch(self, lane: "_Lane", batch: list["_Request"]) -> None:
        tasks = [t for r in batch for t in r.tasks]
        started = time.perf_counter()
        try:
            report = lane.publisher().publish(tasks)
            failed = dict(report.failed)
            self.store.outbox_mark_confirmed(report.confirmed)
            if failed:
                self.store.outbox_mark_failed(failed)
        except Exception as exc:      # broker or store trouble: every page of the batch is given back
            log.warning("links_publish_failed", tasks=len(tasks), error=repr(exc))
            failed = {t.task_id: repr(exc) for t in tasks}
            lane.close()
        with self._lock:
            self.batches += 1
            self.published += len(tasks) - len(failed)
            self.publish_s += time.perf_counter() - started
        for request in batch:
            request.failed = {t.task_id: failed[t.task_id] for t in request.tasks if t.task_id in failed}
            request.done.set()


class _Lane:
    """One publisher thread's own ``Publisher`` (never shared: a JetStream publisher owns
    an event loop), made on first use and again after a failure."""

    def __init__(self, factory: Callable[[], Publisher]) -> None:
        self._factory = factory
        self._publisher: Publisher | None = None

    def publisher(self) -> Publisher:
        if self._publisher is None:
            self._publisher = self._factory()
        return self._publisher

    def close(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            try:
                publisher.close()
            except Exception as exc:
                log.warning("links_publisher_close_failed", error=repr(exc))


@dataclass
class _Request:
    tasks: list[Task]
    done: threading.Event = field(default_factory=threading.Event)
    failed: dict[str, str] = field(default_factory=dict)
