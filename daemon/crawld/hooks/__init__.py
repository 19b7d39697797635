"""What user code on every page sees: ``Page`` in, URLs (``str`` or ``Link``) out.

A hook is any callable ``hook(page: Page) -> Iterable[str | Link] | None`` named in
``[pipeline] hooks = ["module:callable", ...]``. Each is imported once per worker at boot
and called on a pool thread after the page is stored and before its delivery is acked,
for every stored response (``fetched``, ``redirected``, ``http_error``; never for
``skipped``). Hooks of one worker run concurrently on its ``workers.threads`` threads:
keep shared state thread-safe. Delivery is at least once, so a hook may see a page
twice (a crash before the ack, or its own earlier failure): make side effects idempotent,
keyed by ``page.task.task_id``. A hook that raises sends the task to the retry tiers
(reason ``hook_error``) and, when they are exhausted, to the dead letters with the traceback.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from crawld.task import Task


@dataclass(frozen=True)
class Link:
    """A URL to crawl, with what a hook wants to carry along.

    ``priority`` and ``meta`` travel in the new task's message (``meta`` object, with
    ``priority`` in it); the work queues stay FIFO, so downstream consumers, not the
    crawl order, use them."""
    url: str
    priority: int = 0
    meta: Mapping[str, Any] | None = None


@dataclass
class Page:
    """One stored page. ``body`` is the decoded payload (``b""`` with ``store.bodies = "none"``)."""
    task: Task
    final_url: str
    status: str                         # fetched | redirected | http_error
    http_status: int | None
    headers: list[tuple[str, str]]      # final response's headers as received, in order
    content_type: str
    body: bytes
    stored: dict[str, Any] = field(default_factory=dict)   # warc_file/offset/length, body_sha256
    max_links: int = 1000               # scope.max_links_per_page for this crawl

    @property
    def url(self) -> str:
        return self.task.url

    @property
    def depth(self) -> int:
        return self.task.depth

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads(self.task.meta) if self.task.meta else {}

    def header(self, name: str, default: str = "") -> str:
        """All values of a header (case-insensitive), comma-joined as RFC 9110 allows."""
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return ", ".join(values) if values else default
