"""Classify a fetch outcome before answering the broker (SPEC.md outcome table).

Pure logic, no I/O. Anything not recognised is dead, never retried: a retry loop on
a bug hammers a site and hides the bug.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from crawld.fetch import FetchResult
from crawld.fetch.reasons import PERMANENT_FAILURES, RETRYABLE_ERRORS, SKIP_REASONS, Kind

RETRY_HTTP = frozenset({408, 429})
RETRY_AFTER_HTTP = frozenset({429, 503})


class Verdict(enum.Enum):
    RESULT = "result"   # store a result row, ack
    SKIP = "skip"       # store a skipped result, ack (AMQP) / term (JetStream)
    RETRY = "retry"     # store an attempt row, delayed redelivery outside the main path
    DEAD = "dead"       # store a dead row, dead-letter


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    status: str = ""          # result status: fetched | redirected | http_error | skipped
    reason: str = ""
    error: str = ""
    delay_s: float = 0.0


def classify(result: FetchResult, attempt: int, max_deliver: int,
             delays: tuple[float, ...], retry_after_max_s: float = 3600.0) -> Decision:
    """Map one fetch outcome of attempt ``attempt`` (1-based) to what happens next."""
    if result.kind == Kind.RESPONSE:
        return _classify_response(result, attempt, max_deliver, delays, retry_after_max_s)
    if result.kind == Kind.SKIPPED and result.reason in SKIP_REASONS:
        return Decision(Verdict.SKIP, status="skipped", reason=result.reason, error=result.error)
    if result.kind == Kind.FAILED and result.reason in PERMANENT_FAILURES:
        return Decision(Verdict.SKIP, status="skipped", reason=result.reason, error=result.error)
    if result.kind == Kind.ERROR and result.reason in RETRYABLE_ERRORS:
        return _retry_or_dead(result.reason, result.error or result.reason, attempt, max_deliver,
                              delays, min_delay=result.retry_after_s or 0.0)
    return Decision(Verdict.DEAD, reason="unclassified",
                    error=f"{result.kind}/{result.reason}: {result.error}")


def _classify_response(result: FetchResult, attempt: int, max_deliver: int,
                       delays: tuple[float, ...], retry_after_max_s: float) -> Decision:
    code = result.http_status or 0
    if 200 <= code < 400:
        status = "redirected" if result.redirects else "fetched"
        return Decision(Verdict.RESULT, status=status, reason=str(code))
    if code in RETRY_HTTP or code >= 500:
        min_delay = 0.0
        if code in RETRY_AFTER_HTTP and result.retry_after_s is not None:
            min_delay = min(result.retry_after_s, retry_after_max_s)
        return _retry_or_dead(f"http_{code}", f"HTTP {code}", attempt, max_deliver, delays,
                              min_delay=min_delay)
    if 400 <= code < 500:
        return Decision(Verdict.RESULT, status="http_error", reason=str(code))
    return Decision(Verdict.DEAD, reason="unclassified", error=f"unexpected HTTP status {code}")


def _retry_or_dead(reason: str, error: str, attempt: int, max_deliver: int,
                   delays: tuple[float, ...], min_delay: float = 0.0) -> Decision:
    if attempt >= max_deliver:
        return Decision(Verdict.DEAD, reason="retries_exhausted", error=f"{reason}: {error}")
    return Decision(Verdict.RETRY, reason=reason, error=error,
                    delay_s=max(retry_delay(attempt, delays), min_delay))


def retry_delay(attempt: int, delays: tuple[float, ...]) -> float:
    """Attempt 1 failed -> first tier, 2 -> second, ...; later attempts stay on the last tier."""
    if not delays:
        return 0.0
    return delays[min(attempt, len(delays)) - 1]
