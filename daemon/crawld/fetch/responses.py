"""urllib3 responses and exceptions, read for the fetcher: errors, Retry-After, connection reuse."""
from __future__ import annotations

import email.parser
import email.utils
import http.client
import re
import ssl
import time
import types
from dataclasses import dataclass
from typing import Any, BinaryIO

from urllib3.exceptions import (DecodeError, LocationValueError, NameResolutionError,
                                NewConnectionError, ProxyError, SSLError)
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from crawld.fetch.reasons import Kind, Reason

DRAIN_LIMIT = 64 * 1024             # redirect bodies up to this are read to keep the connection

# A head whose every line is ``token: value`` (no folding, no obs-text line breaks) parses
# to the same HTTPMessage as the email parser gives (tests/test_fetch.py checks that on
# generated heads); anything else goes to the email parser. The value excludes what
# str.splitlines() breaks on, since the email parser splits lines with it.
_VALUE = r"[^\r\n\x0b\x0c\x1c-\x1e\x85]*"
_PLAIN_HEAD = re.compile(r"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:" + _VALUE + r"\r\n)*\r\n")
_HEADER_LINE = re.compile(r"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*(" + _VALUE + r")\r\n")


def classify_exception(exc: BaseException) -> tuple[Kind, Reason]:
    """(kind, reason) for an exception raised by urllib3 / the socket layer."""
    if isinstance(exc, DecodeError):
        return Kind.FAILED, Reason.BAD_ENCODING
    if isinstance(exc, LocationValueError):
        return Kind.FAILED, Reason.BAD_URL
    if isinstance(exc, (SSLError, ssl.SSLError)):
        return Kind.ERROR, Reason.TLS
    if isinstance(exc, ProxyError):
        return Kind.ERROR, Reason.PROXY
    if isinstance(exc, NameResolutionError):
        return Kind.ERROR, Reason.DNS
    if isinstance(exc, NewConnectionError):     # subclasses ConnectTimeoutError: test it first
        return Kind.ERROR, Reason.CONNECTION
    if isinstance(exc, (Urllib3Timeout, TimeoutError)):
        return Kind.ERROR, Reason.TIMEOUT
    return Kind.ERROR, Reason.CONNECTION


def parse_retry_after(value: str | None, cap_s: float, now: float | None = None) -> float | None:
    """Retry-After as seconds from now: delay-seconds or an HTTP-date; clamped to [0, cap_s]."""
    if not value or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:          # NaN
        return None
    return min(max(0.0, seconds), cap_s)


def content_length(resp: Any) -> int | None:
    try:
        value = int(resp.headers.get("Content-Length", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def discard(resp: Any) -> None:
    """Skip a redirect's body: read a small one (keeps the connection), else drop it."""
    length = content_length(resp)
    if length is not None and length <= DRAIN_LIMIT:
        resp.drain_conn()


def finish(resp: Any) -> None:
    # A body we stopped reading (cap, truncation, error) leaves bytes on the wire: close
    # the connection instead of handing a desynchronised one back to the pool.
    if not resp.isclosed():
        resp.close()
    resp.release_conn()


@dataclass(slots=True)
class Hop:
    """One request/response exchange as it went over the wire: what a WARC
    ``request`` + ``response`` record pair needs. Built from data urllib3 already
    holds (no extra syscalls); only the final hop keeps a body."""
    url: str
    request_headers: list[tuple[str, str]]    # as sent, in order
    status: int
    reason: str
    version: str                              # status-line protocol, e.g. "HTTP/1.1"
    response_headers: list[tuple[str, str]]   # as received, in order, repeats kept
    ip: str                                   # the address the guard pinned the connection to
    at: float                                 # epoch seconds, response head received
    method: str = "GET"
    body: bytes = b""                         # decoded payload (final hop only)
    truncated: bool = False                   # body cut at max_body_bytes


def capture_hop(resp: Any, url: str, ip: str, request_headers: dict[str, str]) -> Hop:
    """The exchange of ``resp``; headers in wire order from http.client when available."""
    raw = getattr(resp, "_original_response", None)
    # http.client decodes header bytes as latin-1, so Message.items() would only copy
    # _headers through its policy's per-header surrogate check: read the list itself.
    wire = getattr(raw.msg, "_headers", None) if raw is not None else None
    headers = list(wire) if isinstance(wire, list) else list(resp.headers.items())
    version = resp.version or 11
    return Hop(url, list(request_headers.items()), resp.status, resp.reason or "",
               f"HTTP/{version // 10}.{version % 10}", headers, ip, time.time())


def parse_headers(fp: BinaryIO, _class: type = http.client.HTTPMessage) -> http.client.HTTPMessage:
    """http.client.parse_headers, without the email parser for the plain heads servers send.

    The email parser costs ~40 µs a response, a tenth of a small page's whole fetch; the
    same limits apply (http.client reads the lines: line length, header count).
    """
    head = b"".join(http.client._read_headers(fp)).decode("iso-8859-1")  # type: ignore[attr-defined]
    if not _PLAIN_HEAD.fullmatch(head):
        return email.parser.Parser(_class=_class).parsestr(head)
    msg = _class()
    msg._headers = _HEADER_LINE.findall(head)       # what compat32's header_source_parse keeps
    msg._payload = ""
    return msg


class FastHeadersResponse(http.client.HTTPResponse):
    """An HTTPResponse whose head goes through our parse_headers: the stdlib's own begin()
    (status line, 1xx, framing checks unchanged), run with that one global swapped."""

    begin = types.FunctionType(http.client.HTTPResponse.begin.__code__,
                               {**vars(http.client), "parse_headers": parse_headers},
                               "begin", http.client.HTTPResponse.begin.__defaults__,
                               http.client.HTTPResponse.begin.__closure__)
