"""Reconciliation: every task confirmed in the outbox must end in results or dead.

A confirmed task in neither, older than the grace period, is **lost** -- the
command names each id so it can be investigated and re-published.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from crawld.store import Store


@dataclass
class Reconciliation:
    confirmed: int
    unconfirmed: int
    done: int
    dead: int
    pending: int
    grace_s: float
    lost: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.lost

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lost_count": len(self.lost), "ok": self.ok}


def reconcile(store: Store, grace_s: float = 0.0) -> Reconciliation:
    counts = store.counts()
    lost = store.lost(grace_s)
    return Reconciliation(confirmed=counts["confirmed"], unconfirmed=counts["unconfirmed"],
                          done=counts["done"], dead=counts["dead"],
                          pending=store.pending_confirmed() - len(lost),
                          grace_s=grace_s, lost=lost)


def format_reconciliation(rec: Reconciliation, max_ids: int = 50) -> str:
    lines = [
        "reconciliation (outbox vs results vs dead)",
        f"  confirmed in outbox   {rec.confirmed}",
        f"  unconfirmed (new)     {rec.unconfirmed}",
        f"  done (results)        {rec.done}",
        f"  dead                  {rec.dead}",
        f"  pending (< grace)     {rec.pending}",
        f"  LOST                  {len(rec.lost)}",
    ]
    for task_id in rec.lost[:max_ids]:
        lines.append(f"    lost {task_id}")
    if len(rec.lost) > max_ids:
        lines.append(f"    ... and {len(rec.lost) - max_ids} more (use --json for all)")
    return "\n".join(lines)
