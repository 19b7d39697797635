"""Read-only queries behind ``crawld status`` and ``crawld reconcile``.

A mixin of ``Store``: every method is one or two SELECTs through ``_read``, so on
SQLite none of them takes the write lock.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

# Confirmed in the outbox, yet neither stored nor dead: in the broker, in flight or lost.
_UNFINISHED = ("FROM outbox o WHERE o.state = 'confirmed' "
               "AND NOT EXISTS (SELECT 1 FROM results r WHERE r.task_id = o.task_id) "
               "AND NOT EXISTS (SELECT 1 FROM dead d WHERE d.task_id = o.task_id)")

_COUNT_KEYS = ["outbox", "confirmed", "unconfirmed", "done", "dead", "retried_attempts",
               "duplicate_writes"]
_ATTEMPT_KEYS = ["attempt", "error", "http_status", "delay_s", "worker", "at"]


class ReportQueries:
    """Status, reconciliation and latency figures over the store's tables."""

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        raise NotImplementedError

    def counts(self) -> dict[str, int]:
        row = self._read(
            "SELECT (SELECT COUNT(*) FROM outbox), "
            "(SELECT COUNT(*) FROM outbox WHERE state = 'confirmed'), "
            "(SELECT COUNT(*) FROM outbox WHERE state = 'new'), "
            "(SELECT COUNT(*) FROM results), (SELECT COUNT(*) FROM dead), "
            "(SELECT COUNT(*) FROM attempts), "
            "(SELECT COALESCE(SUM(writes - 1), 0) FROM results)")[0]
        return {k: int(v) for k, v in zip(_COUNT_KEYS, row)}

    def result_status_counts(self) -> dict[str, int]:
        return {r[0]: int(r[1]) for r in self._read("SELECT status, COUNT(*) FROM results GROUP BY status")}

    def lost(self, grace_s: float) -> list[str]:
        """Confirmed in the outbox longer than ``grace_s`` ago, yet neither stored nor dead."""
        cutoff = time.time() - grace_s
        rows = self._read(f"SELECT o.task_id {_UNFINISHED} AND o.confirmed_at <= ? "
                          "ORDER BY o.task_id", (cutoff,))
        return [r[0] for r in rows]

    def pending_confirmed(self) -> int:
        """Confirmed tasks not yet in results or dead (in the broker or in flight)."""
        return self._read(f"SELECT COUNT(*) {_UNFINISHED}")[0][0]

    def oldest_unfinished_age(self) -> float | None:
        rows = self._read(f"SELECT MIN(o.confirmed_at) {_UNFINISHED}")
        return None if not rows or rows[0][0] is None else time.time() - float(rows[0][0])

    def latency_percentiles(self, limit: int = 10000) -> dict[str, float | None]:
        """End-to-end seconds from enqueued_at to stored, over the latest results."""
        rows = self._read("SELECT fetched_at - enqueued_at FROM results WHERE enqueued_at > 0 "
                          "ORDER BY fetched_at DESC LIMIT ?", (limit,))
        values = sorted(float(r[0]) for r in rows)
        if not values:
            return {"p50": None, "p95": None}
        return {"p50": values[int(0.50 * (len(values) - 1))], "p95": values[int(0.95 * (len(values) - 1))]}

    def attempts_for(self, task_id: str) -> list[dict[str, Any]]:
        rows = self._read("SELECT attempt, error, http_status, delay_s, worker, at FROM attempts "
                          "WHERE task_id = ? ORDER BY attempt", (task_id,))
        return [dict(zip(_ATTEMPT_KEYS, r)) for r in rows]

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Read-only helper for reports and tests."""
        return self._read(sql, params)
