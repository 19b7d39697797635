"""`crawld crawl URL...`: publish seeds (depth 0) through the outbox, with a scope.

The scope flags are checked here and travel in each seed's message (``scope``); every
task discovered from a seed inherits them, so the workers apply this crawl's scope
whatever their own ``[scope]`` section says for the keys given.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence
from urllib.parse import urlsplit

from crawld.config import Config
from crawld.logs import get_logger
from crawld.ops.publish import PublishSummary, publish_unconfirmed
from crawld.store import Store
from crawld.task import Task, new_task

log = get_logger("crawld.crawl")


def seed_tasks(urls: Sequence[str], round_: str, scope_json: str, source: str) -> tuple[list[Task], list[str]]:
    """(seeds, invalid URLs): a seed must be an absolute http(s) URL."""
    seeds, invalid = [], []
    for url in urls:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            invalid.append(url)
            continue
        seeds.append(dataclasses.replace(new_task(url, round_, source), depth=0, scope=scope_json))
    return seeds, invalid


def publish_seeds(cfg: Config, store: Store, urls: Sequence[str], round_: str, scope_json: str,
                  source: str = "crawl", progress: Callable[[int, int], None] | None = None,
                  declare: bool = True) -> PublishSummary:
    seeds, invalid = seed_tasks(urls, round_, scope_json, source)
    for url in invalid:
        log.warning("seed_invalid", url=url, reason="not an absolute http(s) URL")
    summary = PublishSummary(read=len(seeds), invalid=len(invalid))
    summary.new = store.outbox_add(seeds)
    return summary.record(publish_unconfirmed(cfg, store, progress, declare))
