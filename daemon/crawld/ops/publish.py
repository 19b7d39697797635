"""Publishing through the outbox.

A task is written to the outbox (state ``new``) before it is published and is
marked ``confirmed`` only when the broker confirms it (publisher confirm / PubAck).
Whatever stays ``new`` -- unroutable, nacked, confirm lost, connection dropped --
is published again on the next run: a possible duplicate, never a drop.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import IO, Callable, Iterable, Iterator

from crawld.config import Config
from crawld.logs import get_logger
from crawld.store import Store
from crawld.task import MalformedMessage, Task, parse_line
from crawld.transports import make_publisher
from crawld.transports.base import PublishReport

log = get_logger("crawld.publish")
BATCH = 5000


@dataclass
class PublishSummary:
    read: int = 0
    new: int = 0
    invalid: int = 0
    published: int = 0
    confirmed: int = 0
    failed: int = 0
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.failed == 0

    def record(self, report: PublishReport) -> "PublishSummary":
        """The outcome of the publish run that followed the outbox writes."""
        self.published = len(report.confirmed) + len(report.failed)
        self.confirmed = len(report.confirmed)
        self.failed = len(report.failed)
        self.failures = report.failed
        return self


def read_tasks(lines: Iterable[str], round_: str, chunk: int = BATCH) -> Iterator[tuple[list[Task], int]]:
    """Parse a publish file in chunks: (tasks, invalid lines) per chunk. Bad lines are
    logged and counted; the rest go ahead. Memory stays flat for any file size."""
    tasks: list[Task] = []
    invalid = 0
    for number, line in enumerate(lines, 1):
        try:
            task = parse_line(line, round_)
        except MalformedMessage as exc:
            invalid += 1
            log.warning("publish_line_invalid", line=number, reason=exc.reason, error=exc.detail)
            continue
        if task is not None:
            tasks.append(task)
        if len(tasks) >= chunk:
            yield tasks, invalid
            tasks, invalid = [], 0
    yield tasks, invalid


def publish_file(cfg: Config, store: Store, stream: IO[str], round_: str,
                 progress: Callable[[int, int], None] | None = None,
                 declare: bool = True) -> PublishSummary:
    summary = PublishSummary()
    for tasks, invalid in read_tasks(stream, round_):
        summary.read += len(tasks)
        summary.invalid += invalid
        summary.new += store.outbox_add(tasks)     # an id already in the outbox is not new
    return summary.record(publish_unconfirmed(cfg, store, progress, declare))


def publish_unconfirmed(cfg: Config, store: Store,
                        progress: Callable[[int, int], None] | None = None,
                        declare: bool = True) -> PublishReport:
    """Publish every outbox row still ``new`` (earlier runs' leftovers, then this run's),
    in the order they were added, a page at a time; a row that fails stays ``new`` for
    the next run."""
    total = store.outbox_count("new")
    report = PublishReport()
    if not total:
        return report
    with make_publisher(cfg, **({} if declare else {"declare": False})) as publisher:
        for page in store.outbox_unconfirmed_pages(BATCH):
            offset = len(report.confirmed) + len(report.failed)

            def _progress(done: int, _n: int, offset: int = offset) -> None:
                if progress:
                    progress(offset + done, total)

            part = publisher.publish(page, _progress)
            store.outbox_mark_confirmed(part.confirmed)
            store.outbox_mark_failed(part.failed)
            report.merge(part)
    for task_id, reason in list(report.failed.items())[:20]:
        log.error("publish_unconfirmed", task_id=task_id, reason=reason)
    return report


def terminal_progress(stream: IO[str] = sys.stderr) -> Callable[[int, int], None]:
    """A one-line progress counter on a TTY, sparse log lines otherwise."""
    state = {"last": -1}

    def show(done: int, total: int) -> None:
        pct = 100 * done // total if total else 100
        if stream.isatty():
            stream.write(f"\rpublished {done}/{total} ({pct}%)")
            if done >= total:
                stream.write("\n")
            stream.flush()
        elif pct // 10 != state["last"] // 10 or done >= total:
            log.info("publish_progress", done=done, total=total)
        state["last"] = pct
    return show
