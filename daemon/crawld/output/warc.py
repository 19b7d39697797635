"""WARC/1.1 output: one append-only ``.warc.gz`` per worker process, one gzip member per record.

A fetch (its redirect hops included) becomes, per hop, a ``response`` (or ``revisit``)
record followed by its ``request`` record, appended in one write under the writer's
lock, so a fetch never straddles two files and offsets are exact. Compression and
hashing run outside the lock (zlib and hashlib release the GIL), so pool threads only
queue for the append itself. Fetch records are formatted here (see ``_serialise``); the
``warcinfo`` record and every reader are warcio's.

Stored bodies are the *decoded* payload (the fetcher undoes Content-Encoding and
chunking). To keep each record self-consistent for WARC readers, the response header
block is rewritten minimally: ``Transfer-Encoding`` always, ``Content-Encoding`` when the
payload was decoded, and ``Content-Length`` whenever it no longer matches are renamed in
place to ``X-Crawld-Original-<Name>``, and a correct ``Content-Length`` is appended.
Everything else is kept byte for byte as received.
"""
from __future__ import annotations

import collections
import fcntl
import hashlib
import io
import itertools
import os
import random
import socket
import struct
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple, Self
from urllib.parse import urlsplit

from warcio.timeutils import datetime_to_iso_date
from warcio.warcwriter import WARCWriter

from crawld import __version__
from crawld.output.digests import hashed
from crawld.output.warcfiles import (
    OPEN_SUFFIX,
    Recovered,
    closed_path,
    fsync_dir,
    read_record,
    recover,
    resolve,
    warc_name,
)

__all__ = [
    "Exchange",
    "Recovered",
    "WarcFileWriter",
    "WarcLocation",
    "WrittenFetch",
    "location_text",
    "parse_location",
    "payload_digest",
    "read_record",
    "recover",
    "resolve",
    "stored_response_headers",
]

WARC_VERSION = "WARC/1.1"
CONFORMS_TO = "http://iipc.github.io/warc-specifications/specifications/warc-format/warc-1.1/"
ORIGINAL_PREFIX = "X-Crawld-Original-"
REVISIT_PROFILE = "http://netpreserve.org/warc/1.1/revisit/identical-payload-digest"
HTTP_RESPONSE_TYPE = "application/http; msgtype=response"
HTTP_REQUEST_TYPE = "application/http; msgtype=request"
ORIGINAL_WAIT_S = 5.0        # longest a duplicate payload waits for its original's append
GZIP_LEVEL = 6               # zlib's default: level 9 costs twice the CPU for ~3% smaller files
# A request record whose body is at most this many bytes is stored, not deflated (_stored_member).
STORED_REQUEST_MAX = 2048
GZIP_STORED_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03"   # deflate, no name, mtime 0, Unix
STORED_BLOCK = 65535          # the largest stored deflate block
REFERS_TO_LOCATION = "X-Crawld-Refers-To-Location"   # "<file> <offset> <length>" of a revisit's original
# Process-wide, so two writers in one process (tests, a writer reopened after close)
# never produce the same name within a millisecond.
_SERIALS = itertools.count()
_BASE32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


_UUID4_BITS = (0x4 << 76) | (0x2 << 62)                                # version 4, RFC 4122 variant
_UUID4_MASK = ((1 << 128) - 1) ^ ((0xF << 76) | (0x3 << 62))


def _new_id() -> str:
    """``<urn:uuid:...>`` of a random (version 4) UUID, as warcio makes them, from the
    process's PRNG (seeded from the OS, reseeded in a forked child) rather than uuid4's
    getrandom call: two records per fetch, each a syscall the writer does not need."""
    h = f"{random.getrandbits(128) & _UUID4_MASK | _UUID4_BITS:032x}"
    return f"<urn:uuid:{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}>"


@dataclass(frozen=True)
class Exchange:
    """One HTTP request/response pair as it went over the wire (one redirect hop)."""
    url: str
    status: int
    reason: str = ""
    protocol: str = "HTTP/1.1"
    response_headers: Sequence[tuple[str, str]] = ()   # as received, in order
    payload: bytes = b""                               # body as stored
    payload_decoded: bool = True                       # Content-Encoding already undone
    truncated: bool = False                            # body cut at the size cap
    method: str = "GET"
    request_headers: Sequence[tuple[str, str]] = ()    # as sent
    request_body: bytes = b""
    ip_address: str | None = None                      # peer the connection went to
    fetched_at: float | datetime | None = None         # epoch seconds or datetime; None = now


class WarcLocation(NamedTuple):
    file: str     # closed file name inside the writer's directory
    offset: int   # start of the record's gzip member
    length: int   # size of that gzip member


def location_text(location: WarcLocation) -> str:
    return f"{location.file} {location.offset} {location.length}"


def parse_location(text: str) -> WarcLocation:
    file, offset, length = text.rsplit(" ", 2)
    return WarcLocation(file, int(offset), int(length))


@dataclass(frozen=True)
class WrittenFetch:
    location: WarcLocation            # the final hop's response (or revisit) record
    record_id: str
    record_type: str                  # "response" | "revisit"
    payload_digest: str
    refers_to: WarcLocation | None    # for a revisit: the record holding the payload
    hops: tuple[WarcLocation, ...]    # every hop's response/revisit record, in order


@dataclass
class _Seen:
    uri: str
    date: str
    record_id: str
    location: WarcLocation | None = None   # None until the original is appended


@dataclass
class _Planned:
    hop: Exchange
    date: str
    digest: str
    response_id: str = field(default_factory=_new_id)
    revisit_of: _Seen | None = None
    registered: _Seen | None = None


def payload_digest(payload: bytes) -> str:
    """``sha1:<base32>``, the form warcio and Heritrix write."""
    return "sha1:" + sha1_base32(hashed(hashlib.sha1, payload).digest())


_BASE32_PAIRS = [a + b for a in _BASE32 for b in _BASE32]    # 10 bits -> two characters
_PAIR_SHIFTS = range(150, -1, -10)


def sha1_base32(digest: bytes) -> str:
    """RFC 4648 base32 of a 20-byte digest (160 bits: no padding), what base64.b32encode
    gives, at a third of its cost: three per fetch in the store step."""
    bits = int.from_bytes(digest, "big")
    return "".join([_BASE32_PAIRS[(bits >> shift) & 1023] for shift in _PAIR_SHIFTS])


EMPTY_DIGEST = payload_digest(b"")


def stored_response_headers(headers: Sequence[tuple[str, str]], payload_length: int,
                            decoded: bool = True) -> list[tuple[str, str]]:
    """Response headers made consistent with the stored payload (see module docstring)."""
    length = str(payload_length)
    for name, value in headers:     # the usual case: nothing to change, one cheap pass
        low = name.lower()
        if low in ("transfer-encoding", "content-encoding") or (low == "content-length"
                                                               and value.strip() != length):
            break
    else:
        return list(headers)
    lowered = [(name.lower(), value.strip().lower()) for name, value in headers]
    encoded = decoded and any(n == "content-encoding" and v not in ("", "identity") for n, v in lowered)
    chunked = any(n == "transfer-encoding" for n, _ in lowered)
    wrong_length = any(n == "content-length" and v != str(payload_length) for n, v in lowered)
    fix_length = chunked or encoded or wrong_length
    out = []
    for (name, value), (low, lvalue) in zip(headers, lowered):
        stale = (low == "transfer-encoding" or (low == "content-length" and fix_length)
                 or (low == "content-encoding" and encoded and lvalue not in ("", "identity")))
        out.append((ORIGINAL_PREFIX + name if stale else name, value))
    if fix_length:
        out.append(("Content-Length", str(payload_length)))
    return out


class WarcFileWriter:
    """Appends fetches to rolling WARC files; owned by one worker process, shared by its threads."""

    def __init__(self, directory: str, prefix: str = "crawld", max_bytes: int = 1 << 30, *,
                 software: str | None = None, hostname: str | None = None, pid: int | None = None,
                 ip: str | None = None, revisits: bool = True, dedup_max_entries: int = 100_000,
                 info: Mapping[str, str] | None = None) -> None:
        self.directory = directory
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.software = software or f"crawld/{__version__}"
        self.hostname = hostname or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self.ip = ip
        self.revisits = revisits
        self.dedup_max_entries = dedup_max_entries
        self.extra_info = dict(info or {})
        self.closed_files: list[str] = []
        self._lock = threading.Lock()          # file, offsets, dedup map
        self._appended = threading.Condition(self._lock)   # an original reached the file
        self._waiting = 0       # fetches waiting on _appended (a duplicate payload's)
        self._sync_lock = threading.Lock()     # one fsync at a time; latecomers piggyback
        self._seen: collections.OrderedDict[str, _Seen] = collections.OrderedDict()
        self._fd: int | None = None
        self._name = ""
        self._size = 0
        self._info_end = 0
        self._written = 0                      # bytes appended over all files, monotonic
        self._durable = 0                      # prefix of _written known to be on disk
        self._dir_dirty = False
        self._closed = False
        os.makedirs(directory, exist_ok=True)

    # -- public API ---------------------------------------------------------------------

    @property
    def current_file(self) -> str | None:
        """Closed name of the file being written, if one is open."""
        return self._name or None

    @property
    def needs_sync(self) -> bool:
        return self._written != self._durable or self._dir_dirty

    def write_fetch(self, hops: Sequence[Exchange]) -> WrittenFetch:
        """Append one fetch (all its hops); data is in the OS after this, durable after sync()."""
        if not hops:
            raise ValueError("a fetch has at least one hop")
        plans = [_Planned(h, _warc_date(h.fetched_at), payload_digest(h.payload)) for h in hops]
        with self._lock:
            self._check_open()
            self._wait_for_originals(plans)
            self._plan_dedup(plans)
        try:
            data, spans = self._serialise(plans)
            with self._lock:
                self._check_open()
                self._ensure_room(len(data))
                base = self._size
                self._append(data)
                locations = [WarcLocation(self._name, base + off, n) for off, n in spans]
                for plan, loc in zip(plans, locations):
                    if plan.registered is not None:
                        plan.registered.location = loc
                if self._waiting:
                    self._appended.notify_all()
        except BaseException:
            self._forget(plans)
            raise
        final = plans[-1]
        return WrittenFetch(locations[-1], final.response_id,
                            "revisit" if final.revisit_of else "response", final.digest,
                            final.revisit_of.location if final.revisit_of else None,
                            tuple(locations))

    def sync(self) -> None:
        """Make everything written so far durable (fdatasync, plus the directory when a
        file was created or renamed). Returns at once when there is nothing new, and one
        fsync covers every write that finished before it started (group commit)."""
        with self._lock:
            target = self._written
            if target == self._durable and not self._dir_dirty:
                return
        with self._sync_lock:
            with self._lock:
                if self._durable >= target and not self._dir_dirty:
                    return
                upto, dir_dirty = self._written, self._dir_dirty
                # dup: a concurrent roll may close the writer's own descriptor meanwhile
                fd = os.dup(self._fd) if self._fd is not None else None
                self._dir_dirty = False
            try:
                if fd is not None:
                    os.fdatasync(fd)
                if dir_dirty:
                    fsync_dir(self.directory)
            except BaseException:
                self._dir_dirty = self._dir_dirty or dir_dirty
                raise
            finally:
                if fd is not None:
                    os.close(fd)
            self._durable = max(self._durable, upto)

    def flush(self, fsync: bool = True) -> None:
        """Records go straight to the OS (no user-space buffer); ``fsync`` makes them durable."""
        if fsync:
            self.sync()

    def close(self) -> None:
        """fsync, rename the current file to its closed name; idempotent."""
        with self._lock:
            if self._fd is not None:
                self._finish_file()
            self._closed = True
            self._durable = self._written

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- records --------------------------------------------------------------------------

    def _wait_for_originals(self, plans: list[_Planned]) -> None:
        """Wait (bounded) while another thread is appending a payload this fetch carries,
        so N concurrent fetches of one payload give one response and N-1 revisits, not a
        response each. Nothing is registered while waiting, and a fetch that registered
        an original never waits, so waits cannot form a cycle."""
        if not self.revisits:
            return
        deadline = time.monotonic() + ORIGINAL_WAIT_S
        while any(self._in_flight(plan.digest) for plan in plans if plan.hop.payload
                  and not plan.hop.truncated):
            left = deadline - time.monotonic()
            if left <= 0:
                return        # a slow original: write a full response rather than stall
            self._waiting += 1
            try:
                self._appended.wait(left)
            finally:
                self._waiting -= 1

    def _in_flight(self, digest: str) -> bool:
        seen = self._seen.get(digest)
        return seen is not None and seen.location is None

    def _plan_dedup(self, plans: list[_Planned]) -> None:
        """Decide revisits under the lock. Only payloads already *appended* are referred
        to, so a revisit never points at a record whose write later failed."""
        if not self.revisits:
            return
        for plan in plans:
            if not plan.hop.payload or plan.hop.truncated:
                continue
            seen = self._seen.get(plan.digest)
            if seen is not None and seen.location is not None:
                plan.revisit_of = seen
                self._seen.move_to_end(plan.digest)
            elif seen is None:
                plan.registered = self._seen[plan.digest] = _Seen(plan.hop.url, plan.date, plan.response_id)
                while len(self._seen) > self.dedup_max_entries:
                    self._seen.popitem(last=False)

    def _forget(self, plans: list[_Planned]) -> None:
        with self._lock:
            for plan in plans:
                if plan.registered is not None and self._seen.get(plan.digest) is plan.registered:
                    del self._seen[plan.digest]
            self._appended.notify_all()

    def _serialise(self, plans: list[_Planned]) -> tuple[bytes, list[tuple[int, int]]]:
        """gzip every record of the fetch into one buffer; spans of the response records.

        Records are formatted here rather than through warcio's record builder: the
        builder re-parses headers and recomputes digests per record, which cost three
        times the rest of a small page's store step. The bytes are the same WARC/1.1
        (warcio, fastwarc and ``warcio check`` read them back in the tests)."""
        parts: list[bytes] = []
        spans = []
        offset = 0
        for plan in plans:
            response, request = self._response(plan), self._request(plan)
            parts += (response, request)
            spans.append((offset, len(response)))
            offset += len(response) + len(request)
        return b"".join(parts), spans

    def _warc_headers(self, plan: _Planned, record_type: str, record_id: str) -> list[tuple[str, str]]:
        headers = [("WARC-Type", record_type), ("WARC-Record-ID", record_id),
                   ("WARC-Date", plan.date)]
        if plan.hop.ip_address:
            headers.append(("WARC-IP-Address", plan.hop.ip_address))
        headers.append(("WARC-Target-URI", plan.hop.url))
        return headers

    def _response(self, plan: _Planned) -> bytes:
        hop = plan.hop
        http = _http_block(f"{hop.protocol} {hop.status} {hop.reason}".rstrip(),
                           stored_response_headers(hop.response_headers, len(hop.payload),
                                                   hop.payload_decoded))
        if plan.revisit_of is not None:
            ref = plan.revisit_of
            headers = self._warc_headers(plan, "revisit", plan.response_id)
            headers += [("WARC-Profile", REVISIT_PROFILE), ("WARC-Refers-To-Target-URI", ref.uri),
                        ("WARC-Refers-To-Date", ref.date), ("WARC-Payload-Digest", plan.digest),
                        ("WARC-Refers-To", ref.record_id)]
            if ref.location is not None:
                # where the payload is, so a reader needs one more seek, not a scan
                headers.append((REFERS_TO_LOCATION, location_text(ref.location)))
            return _member(headers, HTTP_RESPONSE_TYPE, http, b"")
        headers = self._warc_headers(plan, "response", plan.response_id)
        headers.append(("WARC-Payload-Digest", plan.digest))
        if hop.truncated:
            headers.append(("WARC-Truncated", "length"))
        return _member(headers, HTTP_RESPONSE_TYPE, http, hop.payload)

    def _request(self, plan: _Planned) -> bytes:
        hop = plan.hop
        parts = urlsplit(hop.url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = list(hop.request_headers)
        if "host" not in [name.lower() for name, _ in headers]:
            # HTTP/1.1 clients always send Host; urllib3 adds it itself when not given
            headers.insert(0, ("Host", parts.netloc.rpartition("@")[2]))
        http = _http_block(f"{hop.method} {target} {hop.protocol}", headers)
        warc_headers = self._warc_headers(plan, "request", _new_id())
        warc_headers += [("WARC-Concurrent-To", plan.response_id),
                         ("WARC-Payload-Digest", payload_digest(hop.request_body)
                          if hop.request_body else EMPTY_DIGEST)]
        return _member(warc_headers, HTTP_REQUEST_TYPE, http, hop.request_body,
                       deflate=len(hop.request_body) > STORED_REQUEST_MAX)

    # -- files (all called with self._lock held) ------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("WarcFileWriter is closed")

    def _ensure_room(self, size: int) -> None:
        # Roll before, not after, a write: no empty file is left behind at close, and a
        # fetch larger than max_bytes still goes whole into a file of its own.
        if self._fd is not None and self._size > self._info_end and self._size + size > self.max_bytes:
            self._finish_file()
        if self._fd is None:
            self._open_file()

    def _open_file(self) -> None:
        while True:
            name = warc_name(self.prefix, datetime.now(UTC), next(_SERIALS),
                             self.hostname, self.pid)
            path = os.path.join(self.directory, name + OPEN_SUFFIX)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                break
            except FileExistsError:
                continue
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # tells recover() we are alive
        self._fd, self._name, self._size = fd, name, 0
        self._dir_dirty = True
        try:
            self._append(self._warcinfo(name))
        except BaseException:
            # every file must open with warcinfo: drop this one, the next write retries
            self._fd, self._name = None, ""
            os.close(fd)
            os.unlink(path)
            raise
        self._info_end = self._size

    def _warcinfo(self, name: str) -> bytes:
        buf = io.BytesIO()
        writer = WARCWriter(buf, gzip=True, warc_version=WARC_VERSION)
        info = {"software": self.software, "format": "WARC File Format 1.1",
                "conformsTo": CONFORMS_TO, "hostname": self.hostname, "ip": self.ip,
                **self.extra_info}
        writer.write_record(writer.create_warcinfo_record(name, info))
        return buf.getvalue()

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        view, offset = memoryview(data), self._size
        try:
            while view:
                n = os.pwrite(self._fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError:
            # ENOSPC & co: cut the partial member so the file stays a valid WARC
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
            raise
        self._size = offset
        self._written += len(data)

    def _finish_file(self) -> None:
        assert self._fd is not None
        open_path = os.path.join(self.directory, self._name + OPEN_SUFFIX)
        os.fdatasync(self._fd)
        os.rename(open_path, closed_path(open_path))   # still locked: the lock follows the inode
        os.close(self._fd)
        fsync_dir(self.directory)
        self.closed_files.append(self._name)
        self._fd, self._name, self._size, self._info_end = None, "", 0, 0


def _http_block(first_line: str, headers: Sequence[tuple[str, str]]) -> bytes:
    """The HTTP header block as it went over the wire: latin-1, which is how http.client
    decoded it, so the bytes are the received ones (non-latin-1 text: UTF-8)."""
    text = first_line + "\r\n" + "".join([f"{name}: {value}\r\n" for name, value in headers]) + "\r\n"
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


def _member(headers: list[tuple[str, str]], content_type: str, http: bytes, payload: bytes,
            deflate: bool = True) -> bytes:
    """One record as one gzip member: WARC headers (UTF-8), the block, CRLF CRLF."""
    block_digest = "sha1:" + sha1_base32(hashed(hashlib.sha1, http, payload).digest())
    head = (WARC_VERSION + "\r\n" + "".join([f"{n}: {v}\r\n" for n, v in headers])
            + f"WARC-Block-Digest: {block_digest}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(http) + len(payload)}\r\n\r\n")
    record = b"".join((head.encode("utf-8"), http, payload, b"\r\n\r\n"))
    if not deflate:
        return _stored_member(record)
    # one-shot: a compressobj costs ~25 us just to set up, more than a small page's deflate
    return zlib.compress(record, GZIP_LEVEL, wbits=zlib.MAX_WBITS + 16)


def _stored_member(data: bytes) -> bytes:
    """``data`` as a gzip member of stored (uncompressed) deflate blocks. For a request
    record (~600 bytes): zlib.compress gives up the GIL, so with the pool's threads waiting
    for it each call cost ~30 us of CPU for ~250 bytes saved; this costs ~2 us (crc32 keeps
    the GIL below 5 KB). Any gzip reader reads it (RFC 1951 block type 00)."""
    parts = [GZIP_STORED_HEADER]
    for start in range(0, max(len(data), 1), STORED_BLOCK):
        block = data[start:start + STORED_BLOCK]
        final = start + STORED_BLOCK >= len(data)
        parts += (struct.pack("<BHH", final, len(block), len(block) ^ 0xFFFF), block)
    parts.append(struct.pack("<II", zlib.crc32(data), len(data) & 0xFFFFFFFF))
    return b"".join(parts)


def _warc_date(value: float | datetime | None) -> str:
    if value is None:
        when = datetime.now(UTC)
    elif isinstance(value, datetime):
        when = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    else:
        when = datetime.fromtimestamp(value, UTC)
    # WARC/1.1 allows fractional seconds; redirect hops a few ms apart stay ordered
    return datetime_to_iso_date(when.replace(tzinfo=None), use_micros=True)
