"""`crawld status`: workers, broker side and store side in one report."""
from __future__ import annotations

import json
import time
from typing import Any

from crawld.config import Config, redact_url
from crawld.store import Store
from crawld.process.files import state_file
from crawld.transports import broker_stats


def collect(cfg: Config, store: Store) -> dict[str, Any]:
    counts = store.counts()
    return {
        "broker": {"url": redact_url(cfg.broker.url), **broker_stats(cfg)},
        "store": {
            "confirmed": counts["confirmed"], "unconfirmed": counts["unconfirmed"],
            "done": counts["done"], "dead": counts["dead"],
            "dead_last_minute": store.dead_since(time.time() - 60),
            "retried_attempts": counts["retried_attempts"],
            "duplicate_writes": counts["duplicate_writes"],
            "pending": store.pending_confirmed(),
            "by_status": store.result_status_counts(),
            "e2e_latency_s": store.latency_percentiles(),
            "oldest_waiting_s": store.oldest_unfinished_age(),
        },
        "supervisor": _supervisor_state(cfg),
    }


def _supervisor_state(cfg: Config) -> dict[str, Any] | None:
    try:
        state = json.loads(state_file(cfg).read_text())
    except (OSError, ValueError):
        return None
    state["stale"] = time.time() - state.get("updated_at", 0) > 10
    return state


def format_status(report: dict[str, Any]) -> str:
    lines: list[str] = []
    sup = report["supervisor"]
    if sup:
        stale = " (STALE: supervisor not updating)" if sup.get("stale") else ""
        lines.append(f"supervisor pid {sup['pid']}  workers {len(sup['workers'])}/{sup['desired']}  "
                     f"generation {sup['generation']}{stale}")
        lines.append(f"  {'pid':>7} {'slot':>4} {'state':<10} {'inflight':>8} {'done':>8} "
                     f"{'retried':>7} {'dead':>5} {'shards':>6} {'age':>8}")
        for w in sup["workers"]:
            lines.append(f"  {w['pid']:>7} {w['slot']:>4} {w['state']:<10} {w['inflight']:>8} "
                         f"{w['done']:>8} {w['retried']:>7} {w['dead']:>5} {len(w.get('shards') or []):>6} "
                         f"{w['age_s']:>7.0f}s{_paused_note(w)}")
            lines += _paused_sites(w)
    else:
        lines.append("supervisor: not running on this host (no state file)")
    b = report["broker"]
    lines.append(f"broker {b.get('transport', '?')} {b['url']}")
    if "error" in b:
        lines.append(f"  unreachable: {b['error']}")
    else:
        for key in ("depth", "num_pending", "num_ack_pending", "num_redelivered", "consumers",
                    "intake_depth", "shards", "shard_depth_total", "shard_depth_max",
                    "dead_depth", "dead_messages", "oldest_waiting_s"):
            if key in b and b[key] is not None:
                lines.append(f"  {key:<20} {b[key]}")
        for queue, depth in (b.get("retry_tiers") or {}).items():
            lines.append(f"  retry tier {queue:<20} {depth}")
    s = report["store"]
    lat = s["e2e_latency_s"]
    lines += [
        "store",
        f"  confirmed            {s['confirmed']}",
        f"  done                 {s['done']}  {s['by_status']}",
        f"  dead                 {s['dead']}  (last minute: {s['dead_last_minute']})",
        f"  pending              {s['pending']}",
        f"  unconfirmed (outbox) {s['unconfirmed']}",
        f"  retried attempts     {s['retried_attempts']}",
        f"  duplicate writes     {s['duplicate_writes']}",
        f"  e2e latency p50/p95  {_fmt(lat['p50'])} / {_fmt(lat['p95'])}",
        f"  oldest waiting       {_fmt(s['oldest_waiting_s'])}",
    ]
    return "\n".join(lines)


def _paused_note(worker: dict[str, Any]) -> str:
    """Why a paused worker is not consuming: the fault it is probing, and since when."""
    if not worker.get("paused_reason"):
        return ""
    return f"  paused: {worker['paused_reason']} for {worker.get('paused_s', 0):.0f}s"


def _paused_sites(worker: dict[str, Any]) -> list[str]:
    """Sites this worker (their shard's owner) holds back after a 429/503 or failures."""
    return [f"      site paused: {site} for {left:.1f}s more"
            for site, left in (worker.get("paused_sites") or {}).items()]


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}s"
