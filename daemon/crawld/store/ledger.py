"""Delivery ledger: deliveries forgiven, suspects run alone, and the write probe.

A ``Store`` mixin. ``forgiven`` counts deliveries of a task the broker handed out again
through no fault of the task (a connection loss, a broker restart, a drain, a pause):
the crash-loop guard subtracts them from the broker's or our own redelivery count.
``quarantine`` holds a suspect's id while it runs alone in its worker: finding the row
on a later delivery means that run killed its worker. Its ``deaths`` counts such runs
(``quarantine_death``): the crash guard calls the task poison only after
``LONE_DEATHS`` of them (pipeline/crashguard.py).
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

PROBE_KEY = "\x00probe"      # never a task id: task ids are printable


class LedgerQueries:
    def _exec(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        raise NotImplementedError

    def _exec_many(self, sql: str, rows: Any) -> int:
        raise NotImplementedError

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        raise NotImplementedError

    def forgive(self, counts: Mapping[str, int]) -> None:
        """Add ``counts[task_id]`` deliveries that must not count against the task."""
        now = time.time()
        self._exec_many(
            "INSERT INTO forgiven (task_id, count, last_at) VALUES (?, ?, ?) "
            "ON CONFLICT (task_id) DO UPDATE SET count = forgiven.count + excluded.count, "
            "last_at = excluded.last_at", [(tid, n, now) for tid, n in counts.items()])

    def forgiven(self, task_id: str) -> int:
        rows = self._read("SELECT count FROM forgiven WHERE task_id = ?", (task_id,))
        return int(rows[0][0]) if rows else 0

    def quarantine_begin(self, task_id: str, worker: str) -> None:
        """Durable before the suspect runs: if the run kills the worker, the row stays.
        A row left by earlier lone runs keeps its ``deaths``."""
        self._exec("INSERT INTO quarantine (task_id, worker, started_at) VALUES (?, ?, ?) "
                   "ON CONFLICT (task_id) DO UPDATE SET worker = excluded.worker, "
                   "started_at = excluded.started_at", (task_id, worker, time.time()))

    def quarantine_end(self, task_id: str) -> None:
        """The lone run survived: the row goes, and with it the deaths of earlier runs."""
        self._exec("DELETE FROM quarantine WHERE task_id = ?", (task_id,))

    def quarantine_death(self, task_id: str, worker: str) -> int:
        """Count the death of ``worker`` in the lone run of ``task_id``; returns the deaths
        so far. Counted only while the row still names ``worker`` (the count clears it), so
        two copies of the task finding the row, or one check run twice, count it once."""
        rows = self._exec("UPDATE quarantine SET deaths = deaths + 1, worker = '' "
                          "WHERE task_id = ? AND worker = ? RETURNING deaths", (task_id, worker))
        if not rows:     # counted already (or the row is gone)
            rows = self._read("SELECT deaths FROM quarantine WHERE task_id = ?", (task_id,))
        return int(rows[0][0]) if rows else 0

    def quarantined(self, task_id: str) -> dict[str, Any] | None:
        """The task's quarantine row: ``worker`` ('' once its death is counted),
        ``started_at`` and ``deaths``."""
        rows = self._read("SELECT worker, started_at, deaths FROM quarantine WHERE task_id = ?",
                          (task_id,))
        return {"worker": rows[0][0], "started_at": rows[0][1], "deaths": rows[0][2]} if rows else None

    def reset_delivery_counts(self, task_ids: Sequence[str]) -> None:
        """A replayed task starts over: no crash count, nothing forgiven, no suspicion."""
        for table in ("redeliveries", "forgiven", "quarantine"):
            self._exec_many(f"DELETE FROM {table} WHERE task_id = ?", [(t,) for t in task_ids])

    def probe_write(self) -> None:
        """One real write transaction (SQLite: takes the write lock): raises while the
        store is unreachable, locked past its bound or refusing writes."""
        self._exec("DELETE FROM quarantine WHERE task_id = ?", (PROBE_KEY,))
