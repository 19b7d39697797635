"""Per-host politeness, **host-wide**: shared by every crawld worker that uses the same run_dir.

Scrapy's per-domain limits live inside one process, so N processes hit a site N times
as hard as configured. Here the limits are enforced with ``fcntl.flock`` on small files
in ``<run_dir>/hosts/``, which every worker process of one machine (the supervisor hands
them all the same ``run_dir``) and every thread of each worker share:

* concurrency -- ``per_host_concurrency`` slot files per host; a request holds an
  exclusive flock on one of them. The threads of one process claim a slot in memory
  before its flock (a set of the slots they hold), the processes exclude each other by
  the flock; a crashed process releases its slots with its file descriptors (nothing to
  clean up).
* spacing -- a small state file per host records when the last request started, a
  ``not_before`` time (from Retry-After) and a back-off delay. Each request reserves its
  start time under an flock, then sleeps outside the lock. The gap to the previous start
  is ``max(per_host_delay_s * uniform(0.5, 1.5), crawl_delay, backoff)``: the random
  factor is Scrapy's RANDOMIZE_DOWNLOAD_DELAY; robots.txt Crawl-delay is a floor the site
  asked for, so it is not randomised below. With no gap to keep (``per_host_delay_s`` 0
  and no Crawl-delay) a request reads the record through a shared read-only mapping,
  without its lock, and starts at once if no start, ``not_before`` or back-off lies ahead:
  no syscall. It records nothing then: starts with no gap between them have nothing to
  space, and a process configured with a gap still spaces its own from the record.
* back-off -- a 429/503 pushes ``not_before`` out by Retry-After (if any) and sets a
  back-off gap (1 s, doubling per repeat, at most 60 s) that lasts 60 s after the last
  such answer.

The limit is per machine: several machines crawling one site each apply it (the total
is machines x per_host_concurrency).

A process keeps its slot files open (a bounded number of them, least recently used closed
first) and takes and drops a slot with one ``flock`` each, and it looks for a free slot from
an index of its own (drawn once per process), so that the processes sharing a host do not
each try the slots the others hold first: with two processes of 16 threads on one host,
starting every scan at slot 0 cost six failed open+flock+close probes per request.

Hosts are mapped to files by a hash into a fixed number of buckets, so the directory
stays bounded over a crawl of millions of hosts without deleting lock files (deleting
a lock file another process has open would split one lock into two). Two hosts that
share a bucket share a limit: that can only make us slower, never less polite.

A thread that cannot get a slot (or whose reserved start would be too far away) within
``wait_s`` gets :class:`PolitenessTimeout` -- the worker retries the task later instead
of parking a thread.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import random
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_BACKOFF_S = 60.0
MAX_IDLE_SLOT_FDS = 256     # slot files kept open while no request holds them
MAX_STATE_MAPS = 256        # hosts' state records kept mapped for the lock-free read
BACKOFF_WINDOW_S = 60.0
_STATE = struct.Struct("<dddd")     # last_start, not_before, backoff_s, backoff_until


class PolitenessTimeout(Exception):
    """No slot / start time within the allowed wait; ``retry_in_s`` is a hint when known."""

    def __init__(self, host: str, waited_s: float, retry_in_s: float | None = None) -> None:
        if retry_in_s is None:
            message = f"no free politeness slot for {host} within {waited_s:.1f}s"
        else:
            message = f"next polite start for {host} is {retry_in_s:.1f}s away, beyond the allowed wait"
        super().__init__(message)
        self.host = host
        self.waited_s = waited_s
        self.retry_in_s = retry_in_s


def default_run_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"crawld-{os.getuid()}")


@dataclass
class _State:
    last_start: float = 0.0
    not_before: float = 0.0
    backoff_s: float = 0.0
    backoff_until: float = 0.0


class Slot:
    """A held concurrency slot; release it (or use ``with``) when the request is done."""

    def __init__(self, limiter: "HostLimiter", key: tuple[str, int], fd: int, waited_s: float) -> None:
        self._limiter = limiter
        self._key = key
        self._fd: int | None = fd
        self.waited_s = waited_s

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            self._limiter._release(self._key, fd)

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HostLimiter:
    """Host-wide concurrency + spacing + back-off, shared through ``<run_dir>/hosts``."""

    def __init__(self, run_dir: str, concurrency: int, delay_s: float = 0.0, *,
                 buckets: int = 65536, poll_s: float = 0.02,
                 max_not_before_s: float = 3600.0) -> None:
        self.dir = os.path.join(run_dir or default_run_dir(), "hosts")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.concurrency = max(1, concurrency)
        self.delay_s = delay_s
        self.buckets = buckets
        self.poll_s = poll_s
        self.max_not_before_s = max_not_before_s
        self._held: set[tuple[str, int]] = set()   # slots this process holds: skip the syscalls
        self._cv = threading.Condition()
        # Open slot files no request of this process holds (under _cv), and the process
        # they and _first_slot belong to: a forked child shares its parent's open file
        # descriptions, hence its flocks, so it must open its own.
        self._idle_fds: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._pid = 0
        self._first_slot = 0
        self._closed = False
        # Read-only shared mappings of state records (under _cv), least recently used first.
        # A mapping survives a fork intact; one dropped here is unmapped once no thread reads it.
        self._state_maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    # -- public ------------------------------------------------------------------------
    def acquire(self, host: str, *, wait_s: float, min_delay_s: float = 0.0) -> Slot:
        """Take a slot for ``host`` and wait for its start time; raise PolitenessTimeout."""
        started = time.monotonic()
        bucket = self.bucket(host)
        key, fd = self._take_slot(host, bucket, started + wait_s)
        try:
            pause = self._reserve_start(bucket, host, min_delay_s, wait_s - (time.monotonic() - started))
        except BaseException:
            self._release(key, fd)
            raise
        if pause > 0:
            time.sleep(pause)
        return Slot(self, key, fd, time.monotonic() - started)

    def backoff(self, host: str, retry_after_s: float | None = None) -> float:
        """Record a 429/503 from ``host``; returns the gap now enforced between requests."""
        path = self._state_path(self.bucket(host))
        with _locked(path) as fd:
            state, now = _read_state(fd), time.time()
            active = state.backoff_until > now
            state.backoff_s = min(MAX_BACKOFF_S, max(1.0, state.backoff_s * 2 if active else 1.0))
            state.backoff_until = now + BACKOFF_WINDOW_S
            pause = retry_after_s if retry_after_s is not None else state.backoff_s
            state.not_before = max(state.not_before, now + min(pause, self.max_not_before_s))
            _write_state(fd, state)
        return state.backoff_s

    def record(self, host: str, unreachable: bool) -> float:
        """Without a single owner per site a run of failures cannot be counted for the whole
        site (each worker sees a part of it): unreachable sites walk the retry tiers."""
        return 0.0

    def paused_for(self, host: str) -> float:
        return 0.0

    def unreachable(self, host: str) -> bool:
        return False

    def paused_sites(self) -> dict[str, float]:
        return {}

    def shard_acquired(self, shard: int) -> None:
        """Unpartitioned: no shards."""

    def bucket(self, host: str) -> str:
        digest = hashlib.blake2b(host.lower().encode(), digest_size=8).digest()
        return f"{int.from_bytes(digest, 'big') % self.buckets:05d}"

    # -- slots -------------------------------------------------------------------------
    def _take_slot(self, host: str, bucket: str, give_up_at: float) -> tuple[tuple[str, int], int]:
        started = time.monotonic()
        while True:
            got = self._try_slots(bucket)
            if got is not None:
                return got
            left = give_up_at - time.monotonic()
            if left <= 0:
                raise PolitenessTimeout(host, time.monotonic() - started)
            with self._cv:
                # Woken at once by a release in this process; the poll catches releases
                # by other processes (flock has no cross-process notification).
                self._cv.wait(min(left, self.poll_s * random.uniform(0.5, 1.5)))

    def _try_slots(self, bucket: str) -> tuple[tuple[str, int], int] | None:
        first = self._this_process()
        for step in range(self.concurrency):
            index = (first + step) % self.concurrency
            key = (bucket, index)
            with self._cv:
                if key in self._held:
                    continue
                self._held.add(key)         # claim before the syscall: no in-process race
                fd = self._idle_fds.pop(key, None)
            try:
                if fd is None:
                    fd = os.open(os.path.join(self.dir, f"{bucket}.slot{index}"),
                                 os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                if _try_flock(fd):
                    return key, fd
            except BaseException:
                with self._cv:
                    self._held.discard(key)
                if fd is not None:
                    os.close(fd)
                raise
            self._idle(key, fd)             # another process holds it
        return None

    def _this_process(self) -> int:
        """Where this process starts looking for a free slot; after a fork, the child
        forgets the parent's open slot files (closing its copies leaves the parent's
        flocks alone) and draws a start of its own."""
        pid = os.getpid()
        if pid != self._pid:
            with self._cv:
                if pid != self._pid:
                    self._close_idle()
                    self._held.clear()      # the parent's requests: not running here
                    self._first_slot = random.randrange(self.concurrency)
                    self._pid = pid
        return self._first_slot

    def close(self) -> None:
        """Close the slot files; one still held closes when it is released."""
        with self._cv:
            self._closed = True
            self._close_idle()
            self._state_maps.clear()

    def _close_idle(self) -> None:
        """Under _cv."""
        for fd in self._idle_fds.values():
            os.close(fd)
        self._idle_fds.clear()

    def _release(self, key: tuple[str, int], fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        self._idle(key, fd, notify=True)

    def _idle(self, key: tuple[str, int], fd: int, notify: bool = False) -> None:
        """Keep the slot file open for the next request; close the least recently used
        one past MAX_IDLE_SLOT_FDS."""
        evicted = None
        with self._cv:
            self._held.discard(key)
            if self._closed:
                evicted = fd
            else:
                self._idle_fds[key] = fd
                if len(self._idle_fds) > MAX_IDLE_SLOT_FDS:
                    evicted = self._idle_fds.popitem(last=False)[1]
            if notify:
                self._cv.notify_all()   # waiters may want other hosts; they re-check cheaply
        if evicted is not None:
            os.close(evicted)

    # -- spacing -----------------------------------------------------------------------
    def _reserve_start(self, bucket: str, host: str, min_delay_s: float, wait_left: float) -> float:
        gap = max(self.delay_s * random.uniform(0.5, 1.5), min_delay_s)
        if gap <= 0 and self._nothing_ahead(bucket):
            return 0.0
        with _locked(self._state_path(bucket)) as fd:
            state, now = _read_state(fd), time.time()
            _sanitise(state, now, self.max_not_before_s)
            if state.backoff_until > now:
                gap = max(gap, state.backoff_s)
            start = max(now, state.last_start + gap, state.not_before)
            if start - now > max(0.0, wait_left):
                raise PolitenessTimeout(host, 0.0, retry_in_s=start - now)
            state.last_start = start
            _write_state(fd, state)
        return start - now

    def _nothing_ahead(self, bucket: str) -> bool:
        """The host's record, read without its lock, has no start, not_before or back-off
        ahead of now. A read racing a write can only see what a request a moment earlier
        would have seen; anything ahead takes the locked path, which sanitises it."""
        view = self._state_map(bucket)
        if view is None:
            return False
        last_start, not_before, _, backoff_until = _STATE.unpack_from(view)
        now = time.time()
        return last_start <= now and not_before <= now and backoff_until <= now

    def _state_map(self, bucket: str) -> mmap.mmap | None:
        """The bucket's record mapped read-only; None before its first reservation wrote it."""
        with self._cv:
            view = self._state_maps.get(bucket)
            if view is not None:
                self._state_maps.move_to_end(bucket)
                return view
        try:
            fd = os.open(self._state_path(bucket), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size < _STATE.size:
                return None
            view = mmap.mmap(fd, _STATE.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with self._cv:
            if not self._closed:
                self._state_maps[bucket] = view
                if len(self._state_maps) > MAX_STATE_MAPS:
                    self._state_maps.popitem(last=False)
        return view

    def _state_path(self, bucket: str) -> str:
        return os.path.join(self.dir, f"{bucket}.state")


def _sanitise(state: _State, now: float, max_ahead: float) -> None:
    # Wall-clock time is shared by all processes (monotonic clocks restart at boot and
    # run_dir may survive a reboot); a clock stepped backwards must not stall a host.
    limit = now + max_ahead + MAX_BACKOFF_S
    if state.last_start > limit:
        state.last_start = 0.0
    if state.not_before > limit:
        state.not_before = 0.0


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


class _locked:
    """Exclusive flock on a small state file for a read-modify-write."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> int:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _read_state(fd: int) -> _State:
    raw = os.pread(fd, _STATE.size, 0)
    if len(raw) != _STATE.size:
        return _State()
    return _State(*_STATE.unpack(raw))


def _write_state(fd: int, state: _State) -> None:
    # Fixed size, written in place: a reader under the same flock never sees a torn record.
    os.pwrite(fd, _STATE.pack(state.last_start, state.not_before, state.backoff_s,
                              state.backoff_until), 0)
