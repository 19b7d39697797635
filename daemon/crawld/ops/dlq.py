"""Dead letters: list them, and replay them into the work queue after a fix.

The store's ``dead`` table is the list of record (reconcile counts it); the broker's
dead queue / stream keeps a copy for tools outside crawld. A replay republishes the
task with its attempt counter reset, confirmed, and only then removes the dead row,
so replaying the same id twice publishes it once.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Sequence

from crawld.config import Config
from crawld.logs import get_logger
from crawld.store import DeadRow, Store
from crawld.task import MalformedMessage, Task, parse_message, safe_source
from crawld.transports import make_publisher

log = get_logger("crawld.dlq")


@dataclass
class ReplayReport:
    replayed: list[str] = field(default_factory=list)
    not_dead: list[str] = field(default_factory=list)
    unreplayable: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def replay(cfg: Config, store: Store, task_ids: Sequence[str] | None) -> ReplayReport:
    """Replay the named dead tasks, or all of them when ``task_ids`` is None."""
    rows = store.list_dead(limit=10_000_000, task_ids=task_ids)
    report = ReplayReport()
    if task_ids is not None:
        found = {r.task_id for r in rows}
        report.not_dead = [t for t in task_ids if t not in found]
    tasks = []
    for row in rows:
        if not row.url:
            report.unreplayable[row.task_id] = f"{row.reason}: no url (malformed message)"
            continue
        tasks.append(_task_from_dead(row))
    if tasks:
        with make_publisher(cfg) as publisher:
            result = publisher.publish(tasks, attempt_reset=True)
        store.remove_dead(result.confirmed)
        report.replayed = result.confirmed
        report.failed = result.failed
    log.info("dlq_replayed", replayed=len(report.replayed), failed=len(report.failed),
             not_dead=len(report.not_dead), unreplayable=len(report.unreplayable))
    return report


def _task_from_dead(row: DeadRow) -> Task:
    with suppress(MalformedMessage):     # keep a discovered task's depth, parent and scope
        kept = parse_message(row.body.encode(), row.task_id, 1 << 30)
        if kept.url == row.url:
            return dataclasses.replace(kept, source=safe_source(kept.source), enqueued_at=time.time())
    return Task(task_id=row.task_id, url=row.url, round=row.round or "0",
                source=safe_source(row.source or "replay"), enqueued_at=time.time())


def format_dead(rows: Sequence[DeadRow]) -> str:
    now = time.time()
    header = f"{'task_id':<34} {'reason':<20} {'att':>3} {'age':>8}  url / error"
    lines = [header]
    for r in rows:
        lines.append(f"{r.task_id:<34} {r.reason[:20]:<20} {r.attempts:>3} {_age(now - r.dead_at):>8}  "
                     f"{r.url or '-'}")
        if r.error:
            lines.append(f"{'':<34} {'':<20} {'':>3} {'':>8}    {r.error[:120]}")
    return "\n".join(lines)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"
