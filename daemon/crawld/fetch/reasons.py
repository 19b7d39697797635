"""The words a fetch outcome is described with: ``FetchResult.kind`` and ``.reason``.

This module is their only owner. The values are stored in the database (``results.reason``,
``dead.reason``), appear in stat names (``fetch/reason_count/<reason>``) and are compared by
tests and outside tools, so a value never changes; StrEnum members are plain strings on the
wire (JSON, SQL parameters) and compare and hash equal to them.

=========  ==========================================================================
kind       reasons
=========  ==========================================================================
response   "" -- an HTTP response was received (any status), redirects followed
skipped    policy refused it: robots, scheme, private_address, out_of_scope
error      transient: timeout, connection, dns, tls, proxy, robots_unavailable,
           politeness
failed     permanent, not HTTP: too_large, redirect_loop, too_many_redirects, bad_url,
           bad_encoding
=========  ==========================================================================
"""
from __future__ import annotations

import enum


class Kind(enum.StrEnum):
    """What kind of outcome a fetch had; decides how the worker answers the broker."""

    RESPONSE = "response"
    SKIPPED = "skipped"
    ERROR = "error"
    FAILED = "failed"


class Reason(enum.StrEnum):
    """Why a fetch did not end in a response (empty for a response)."""

    NONE = ""
    # skipped: a policy said no
    ROBOTS = "robots"
    SCHEME = "scheme"
    PRIVATE_ADDRESS = "private_address"
    OUT_OF_SCOPE = "out_of_scope"
    # error: may work later
    TIMEOUT = "timeout"
    CONNECTION = "connection"
    DNS = "dns"
    TLS = "tls"
    PROXY = "proxy"
    ROBOTS_UNAVAILABLE = "robots_unavailable"
    POLITENESS = "politeness"
    # failed: retrying cannot help
    TOO_LARGE = "too_large"
    REDIRECT_LOOP = "redirect_loop"
    TOO_MANY_REDIRECTS = "too_many_redirects"
    BAD_URL = "bad_url"
    BAD_ENCODING = "bad_encoding"


SKIP_REASONS = frozenset({Reason.ROBOTS, Reason.SCHEME, Reason.PRIVATE_ADDRESS,
                          Reason.OUT_OF_SCOPE})
RETRYABLE_ERRORS = frozenset({Reason.TIMEOUT, Reason.CONNECTION, Reason.DNS, Reason.TLS,
                              Reason.PROXY, Reason.ROBOTS_UNAVAILABLE, Reason.POLITENESS})
PERMANENT_FAILURES = frozenset({Reason.TOO_LARGE, Reason.REDIRECT_LOOP,
                                Reason.TOO_MANY_REDIRECTS, Reason.BAD_URL, Reason.BAD_ENCODING})
REASONS_BY_KIND: dict[Kind, frozenset[Reason]] = {
    Kind.RESPONSE: frozenset({Reason.NONE}), Kind.SKIPPED: SKIP_REASONS,
    Kind.ERROR: RETRYABLE_ERRORS, Kind.FAILED: PERMANENT_FAILURES,
}
