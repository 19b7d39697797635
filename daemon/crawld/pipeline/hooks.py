"""``[pipeline] hooks``: user code on every stored page, and what it found.

The handler calls ``PageHooks.run`` after a page's result row is stored and before its
delivery is acked. Every hook gets the same ``crawld.hooks.Page``; the URLs they return
go through ``discover`` (canonical, in scope, outbox, confirmed). Only then is a
``hooks_done`` row written: a stored page without one -- a hook raised, the links were
not confirmed, the worker died -- has its hooks run again on its next delivery, which
the handler's duplicate path would otherwise ack without a second look.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from crawld.config import Config, ConfigError
from crawld.fetch import FetchResult
from crawld.hooks import Link, Page
from crawld.logs import get_logger
from crawld.pipeline.discover import KnownIds, LinkPublisher, discovered_tasks, to_publish
from crawld.pipeline.middleware import import_factory
from crawld.pipeline.scope import scope_for
from crawld.store import ResultRow, Store
from crawld.task import Task

log = get_logger("crawld.hooks")

CONFIG_KEY = "pipeline.hooks"
HOOK_STATUSES = frozenset({"fetched", "redirected", "http_error"})   # a response was stored
MAX_TRACEBACK_CHARS = 8000

Hook = Callable[[Page], "Iterable[str | Link] | None"]


def load_hooks(specs: Sequence[str]) -> tuple[Hook, ...]:
    """Import every ``"module:callable"`` (once per worker; a bad one: ConfigError naming
    ``pipeline.hooks``, which is exit 2 from ``check-config`` and ``run``)."""
    hooks = []
    for spec in specs:
        target = import_factory(spec, CONFIG_KEY)
        if isinstance(target, type):
            raise ConfigError(f"{CONFIG_KEY}: {spec!r} is a class; name a function or an instance")
        hooks.append(target)
    return tuple(hooks)


class Refetch:
    """A stored page whose hooks must run again, but whose body is not readable here."""


REFETCH = Refetch()


@dataclass
class HookOutcome:
    """``ok``; else ``error`` (a hook raised: its traceback) or ``unconfirmed`` (links)."""
    links: int = 0
    error: str = ""
    hook: str = ""
    unconfirmed: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and not self.unconfirmed


class PageHooks:
    """The configured hooks of one worker; thread-safe (pool threads call ``run``)."""

    def __init__(self, cfg: Config, store: Store, specs: Sequence[str] | None = None,
                 publisher: LinkPublisher | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.specs = tuple(cfg.pipeline.hooks if specs is None else specs)
        self.hooks = load_hooks(self.specs)
        self.publisher = publisher or (LinkPublisher(cfg, store) if self.hooks else None)
        self.known = KnownIds()

    @property
    def enabled(self) -> bool:
        return bool(self.hooks)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    # -- pages ----------------------------------------------------------------------
    def page_from_fetch(self, task: Task, result: FetchResult, row: ResultRow) -> Page:
        headers = result.hops[-1].response_headers if result.hops else list(result.headers.items())
        return Page(task=task, final_url=row.final_url, status=row.status,
                    http_status=row.http_status, headers=headers, content_type=row.content_type,
                    body=result.body, stored=_stored(row.__dict__), max_links=self._max_links(task))

    def pending_page(self, task: Task) -> Page | None | Refetch:
        """The stored page if its hooks have yet to complete, else None; ``REFETCH`` when
        they have not but its body cannot be read here (another host's WARC file,
        ``store.bodies = "none"``): the page is fetched again and stored over its row."""
        if self.store.hooks_done(task.task_id):
            return None
        from crawld.ops.show import load_page
        try:
            stored = load_page(self.cfg, self.store, task.task_id)
        except (OSError, ValueError) as exc:
            log.info("hooks_body_unreadable", task_id=task.task_id, url=task.url, error=repr(exc))
            return REFETCH
        if stored is None or stored.row["status"] not in HOOK_STATUSES:
            return None
        if stored.body is None:
            return REFETCH
        row = stored.row
        return Page(task=task, final_url=row["final_url"], status=row["status"],
                    http_status=row["http_status"], headers=stored.headers,
                    content_type=row["content_type"], body=stored.body or b"",
                    stored=_stored(row), max_links=self._max_links(task))

    def _max_links(self, task: Task) -> int:
        return scope_for(self.cfg.scope, task.scope).max_links_per_page

    # -- running --------------------------------------------------------------------
    def run(self, page: Page) -> HookOutcome:
        """Every hook, then the URLs they returned, then the ``hooks_done`` row."""
        found: list[Any] = []
        for spec, hook in zip(self.specs, self.hooks):
            try:
                out = hook(page)
                if isinstance(out, (str, Link)):    # one URL, not an iterable of characters
                    out = [out]
                found.extend(out if out is not None else ())
            except Exception:     # the task's fault, not the worker's: retry tiers, then dead
                return HookOutcome(error=traceback.format_exc()[-MAX_TRACEBACK_CHARS:], hook=spec)
        tasks = discovered_tasks(page.task, found, self.cfg, self.known.has, page.final_url).tasks
        new = to_publish(self.store, page.task, tasks, self.known)
        unconfirmed = self._publish(new)
        if unconfirmed:
            return HookOutcome(links=len(new), unconfirmed=unconfirmed)
        self.known.add(t.task_id for t in new)
        self.store.put_hooks_done(page.task.task_id, len(new))
        return HookOutcome(links=len(new))

    def _publish(self, tasks: list[Task]) -> str:
        if not tasks or self.publisher is None:
            return ""
        failed = self.publisher.publish(tasks)
        if not failed:
            return ""
        return f"{len(failed)} of {len(tasks)} links unconfirmed: {next(iter(failed.values()))}"


def _stored(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in ("warc_file", "warc_offset", "warc_length", "body_sha256", "bytes")}
