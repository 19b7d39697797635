"""WARC files at rest: names, crash recovery and random access to one record.

Kept apart from the live writer in ``warc.py``: everything here works on files a writer
has finished with (or died holding), and must not depend on a writer object.
"""
from __future__ import annotations

import fcntl
import io
import os
import re
import socket
import zlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from warcio.archiveiterator import ArchiveIterator

from crawld.process.files import pid_running

OPEN_SUFFIX = ".open"
_CHUNK = 1 << 20
_HEAD_KEEP = 64 * 1024          # a record's WARC header block is far smaller than this
_UNSAFE_HOST = re.compile(r"[^A-Za-z0-9._-]")
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)[ \t]*\r\n", re.IGNORECASE)


def safe_host(hostname: str) -> str:
    """Host name as it appears in file names (no path separators or spaces)."""
    return _UNSAFE_HOST.sub("_", hostname) or "localhost"


def warc_name(prefix: str, when: datetime, serial: int, host: str, pid: int) -> str:
    """Heritrix-style closed name: ``<prefix>-<YYYYMMDDHHMMSSmmm>-<serial>-<host>-<pid>.warc.gz``."""
    stamp = when.strftime("%Y%m%d%H%M%S") + f"{when.microsecond // 1000:03d}"
    return f"{prefix}-{stamp}-{serial:05d}-{safe_host(host)}-{pid}.warc.gz"


def closed_path(path: str) -> str:
    return path.removesuffix(OPEN_SUFFIX)


def resolve(path: str, directory: str | None = None) -> str:
    """Where a stored ``warc_file`` lives now: the closed name, or still ``.open``.

    ``os.path.join`` keeps an absolute ``path`` as is, which is the contract for
    ``results.warc_file`` (a name inside ``warc_dir`` or an absolute path).
    """
    full = os.path.join(directory, path) if directory else path
    if not os.path.exists(full) and os.path.exists(full + OPEN_SUFFIX):
        return full + OPEN_SUFFIX
    return full


def fsync_dir(directory: str) -> None:
    # A new or renamed file is only durable once its directory entry is.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(path: str, offset: int, length: int, *, directory: str | None = None) -> Any:
    """Parse the one record stored in the gzip member at ``offset``/``length``.

    Returns a warcio ``ArcWarcRecord`` whose streams read from memory, so it stays
    usable after this function returns. Falls back to the ``.open`` name while the
    file is still being written.
    """
    with open(resolve(path, directory), "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise ValueError(f"{path}: only {len(data)} of {length} bytes at offset {offset}")
    records = ArchiveIterator(io.BytesIO(data))
    try:
        return next(iter(records))
    except StopIteration:
        raise ValueError(f"{path}: no WARC record at offset {offset}") from None


@dataclass(frozen=True)
class Recovered:
    path: str                 # closed name after recovery (or the removed .open file)
    records: int              # complete records kept
    bytes_dropped: int        # partial tail cut off
    removed: bool = False     # nothing complete was left, so the file was deleted


def recover(directory: str, prefix: str = "crawld", *, hostname: str | None = None) -> list[Recovered]:
    """Close ``.open`` WARC files of this host that no living writer holds.

    A file counts as held while its writer's ``flock`` is on it (dropped by the kernel
    when the process dies, even by SIGKILL) or while the pid in its name is alive and not
    ours (covers the instant between a writer creating its file and locking it). A
    recycled pid only delays recovery until that process exits; the worker that got the
    pid recovers the file itself, as its own pid counts as dead here.
    """
    host = safe_host(hostname or socket.gethostname())
    pattern = re.compile(rf"^{re.escape(prefix)}-\d{{17}}-\d{{5,}}-{re.escape(host)}-(\d+)\.warc\.gz"
                         + re.escape(OPEN_SUFFIX) + "$")
    done = []
    for name in sorted(os.listdir(directory)):
        match = pattern.match(name)
        if not match or _pid_alive(int(match.group(1))):
            continue
        result = _recover_one(os.path.join(directory, name))
        if result is not None:
            done.append(result)
    if done:
        fsync_dir(directory)
    return done


def _pid_alive(pid: int) -> bool:
    return pid != os.getpid() and pid_running(pid)


def _recover_one(path: str) -> Recovered | None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:        # another worker recovered it first
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:      # a live writer (or another recoverer) holds it
            return None
        if not _same_file(fd, path):  # recovered and renamed while we waited
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            good_end, records = scan_members(f)
        size = os.fstat(fd).st_size
        if good_end < size:
            os.ftruncate(fd, good_end)
            os.fsync(fd)
        if records == 0:
            os.unlink(path)
            return Recovered(path, 0, size - good_end, removed=True)
        target = closed_path(path)
        if os.path.exists(target):   # never clobber a closed file; leave it for a human
            return None
        os.rename(path, target)      # the lock moves with the inode
        return Recovered(target, records, size - good_end)
    finally:
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def scan_members(f: Any) -> tuple[int, int]:
    """(end offset of the last good gzip member, number of good members) from the start.

    A member is good when it decompresses completely (gzip's CRC32 and length check
    pass) and holds exactly one whole WARC record. The scan stops at the first member
    that is not, since a crashed writer can only leave damage at the tail.
    """
    good_end = records = 0
    start = fed = 0
    member = _Member()
    pending = b""
    while True:
        chunk = pending or f.read(_CHUNK)
        pending = b""
        if not chunk:
            return good_end, records
        try:
            member.feed(chunk)
        except zlib.error:
            return good_end, records
        if not member.inflater.eof:
            fed += len(chunk)
            continue
        pending = member.inflater.unused_data
        end = start + fed + len(chunk) - len(pending)
        if not member.is_record():
            return good_end, records
        good_end, records = end, records + 1
        start, fed, member = end, 0, _Member()


class _Member:
    """Inflates one gzip member, keeping only what the record check needs."""

    def __init__(self) -> None:
        self.inflater = zlib.decompressobj(zlib.MAX_WBITS | 16)
        self.head = b""
        self.size = 0
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        data = self.inflater.decompress(chunk)
        if len(self.head) < _HEAD_KEEP:
            self.head += data[: _HEAD_KEEP - len(self.head)]
        self.size += len(data)
        self.tail = (self.tail + data[-4:])[-4:]

    def is_record(self) -> bool:
        if not self.head.startswith(b"WARC/1."):
            return False
        header_end = self.head.find(b"\r\n\r\n")
        match = _CONTENT_LENGTH.search(self.head, 0, header_end + 2)
        if header_end < 0 or not match:
            return False
        expected = header_end + 4 + int(match.group(1)) + 4
        return self.size == expected and self.tail == b"\r\n\r\n"
