"""A wall-clock deadline for a whole request, enforced by cutting its sockets.

Socket timeouts only bound each ``recv``, so a server dripping one byte per second (in
the headers or the body) would otherwise hold a thread for hours. A task sets a
:func:`deadline_scope`; connections used inside it register with one watchdog thread
that shuts their socket down when the deadline passes.
"""
from __future__ import annotations

import heapq
import itertools
import os
import socket
import threading
import time
from typing import Any


class DeadlineScope:
    """One request's wall-clock deadline and the connections it is using."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.fired = False
        self.done = False
        self._conns: set[Any] = set()
        self._lock = threading.Lock()

    def attach(self, conn: Any) -> None:
        with self._lock:
            conn._crawld_scope = self
            if self.fired:
                _shutdown(conn)
            else:
                self._conns.add(conn)

    def detach(self, conn: Any) -> None:
        # Runs before a connection goes back to the pool: if the watchdog already shut
        # it down, close it here so the next task does not inherit a dead socket.
        with self._lock:
            self._conns.discard(conn)
            conn._crawld_scope = None
            fired = self.fired
        if fired:
            conn.close()

    def fire(self) -> None:
        with self._lock:
            if self.done:
                return
            self.fired = True
            for conn in self._conns:
                _shutdown(conn)

    def close(self) -> None:
        with self._lock:
            self.done = True


def _shutdown(conn: Any) -> None:
    sock = getattr(conn, "sock", None)
    if isinstance(sock, socket.socket):
        try:
            # The plain-socket shutdown, also for an SSLSocket: wakes the reader blocked
            # in recv without touching TLS state that thread is using.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass


class _Watchdog:
    """One thread per process; a heap of deadlines; fires expired scopes."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, DeadlineScope]] = []
        self._seq = itertools.count()
        self._stale = 0
        self._thread: threading.Thread | None = None

    def add(self, scope: DeadlineScope) -> None:
        with self._cv:
            heapq.heappush(self._heap, (scope.deadline, next(self._seq), scope))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="crawld-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][2] is scope:
                self._cv.notify()

    def finished(self, scope: DeadlineScope) -> None:
        scope.close()
        with self._cv:
            self._stale += 1
            # Most scopes end long before their deadline: compact so the heap stays
            # proportional to the requests in flight, not to the request rate.
            if self._stale > 1024 and self._stale * 2 > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].done]
                heapq.heapify(self._heap)
                self._stale = 0

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, scope = heapq.heappop(self._heap)
                if scope.done:
                    self._stale = max(0, self._stale - 1)
            scope.fire()

    def reset_after_fork(self) -> None:
        self.__init__()  # type: ignore[misc]


_WATCHDOG = _Watchdog()
_current = threading.local()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG.reset_after_fork)


class deadline_scope:  # noqa: N801 -- used as a function: ``with deadline_scope(t) as scope``
    """Connections used by this thread inside the block are cut at ``deadline`` (monotonic).
    A class, not a @contextmanager: it is entered once per request, and a generator-based
    context manager costs several times more."""

    __slots__ = ("scope", "previous")

    def __init__(self, deadline: float) -> None:
        self.scope = DeadlineScope(deadline)

    def __enter__(self) -> DeadlineScope:
        _WATCHDOG.add(self.scope)
        self.previous = getattr(_current, "scope", None)
        _current.scope = self.scope
        return self.scope

    def __exit__(self, *exc: object) -> None:
        _current.scope = self.previous
        _WATCHDOG.finished(self.scope)


def attach_current(conn: Any) -> None:
    """Register ``conn`` with this thread's deadline scope, if one is active."""
    scope = getattr(_current, "scope", None)
    if scope is not None:
        scope.attach(conn)


def detach(conn: Any) -> None:
    """Unregister ``conn`` before it goes back to a pool."""
    scope = getattr(conn, "_crawld_scope", None)
    if scope is not None:
        scope.detach(conn)
