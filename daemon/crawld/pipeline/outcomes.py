"""The settlement and dead-row reasons the delivery pipeline itself produces.

One owner for these words: logs, dead rows, broker headers, metrics labels and
`crawld status` all carry them, and outside dashboards match on them. StrEnum
members are plain strings on the wire and compare equal to them.
"""
from __future__ import annotations

import enum

from crawld.transports.base import EVENT_UNCONFIRMED


class Reason(enum.StrEnum):
    DUPLICATE = "duplicate"                   # the task id already has a result: ack, no fetch
    RETRIES_EXHAUSTED = "retries_exhausted"   # attempt > queue.max_deliver
    REDELIVERY_LIMIT = "redelivery_limit"     # redelivered unsettled too often (crash loop)
    INTERNAL_ERROR = "internal_error"         # a bug in our code: dead, never retried
    STORE_UNAVAILABLE = "store_unavailable"   # cannot even write the dead row: retry later
    DRAINING = "draining"                     # given back unstarted during a graceful stop
    EVENT_UNCONFIRMED = EVENT_UNCONFIRMED     # stored, but the result event was not confirmed
    POISON = "poison"                         # killed its worker in two runs alone
    SITE_PAUSED = "site_paused"               # its site asked us to wait: back later, no attempt
    SITE_BUSY = "site_busy"                   # its site's turn is too far away: back later, no attempt
    HOOK_ERROR = "hook_error"                 # a [pipeline] hooks callable raised on the page
    LINKS_UNCONFIRMED = "links_unconfirmed"   # stored, but its discovered URLs were not confirmed


MALFORMED_PREFIX = "malformed:"


def malformed(detail_reason: str) -> str:
    """Reason of a dead row for a message that can never be parsed (``malformed:not_json``)."""
    return MALFORMED_PREFIX + detail_reason
