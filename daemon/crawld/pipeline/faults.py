"""Whose fault is it: the task's, or this worker's own?

A task's fault (the site answers 500, robots forbids, the URL is bad, one site is down)
goes through the retry tiers to the dead letters. A worker fault (the local disk, the
store, the host's network or DNS resolver) says nothing about the task: the delivery goes
back without using an attempt and the worker pauses until the fault clears
(process/pause.py). This module only names the fault; it decides nothing.
"""
from __future__ import annotations

import enum
import errno
import sqlite3

# The local disk is full, over quota, read-only or failing: no task can be stored here.
LOCAL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})

# SQLite reports its own disk trouble as text, not errno.
_SQLITE_DISK = ("database or disk is full", "disk i/o error", "readonly database")
# Another process holds the write lock past our busy timeout, or the file is unreachable.
_SQLITE_STORE = ("database is locked", "database table is locked", "unable to open database")


class Fault(enum.StrEnum):
    """Why a worker is paused: its label in `crawld status` and ``crawld_paused{reason}``."""

    DISK = "disk"          # ENOSPC / EDQUOT / EROFS / EIO on bodies or the SQLite file
    STORE = "store"        # the store is unreachable, locked past the bound or refusing writes
    NETWORK = "network"    # the host's own network or DNS resolver (fetch/breaker: many sites)


def local_fault(exc: BaseException) -> Fault | None:
    """The worker fault behind ``exc`` (or its causes), None when it is not one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        fault = _fault_of(current)
        if fault is not None:
            return fault
        current = current.__cause__ or current.__context__
    return None


def _fault_of(exc: BaseException) -> Fault | None:
    if isinstance(exc, OSError) and exc.errno in LOCAL_DISK_ERRNOS:
        return Fault.DISK
    if isinstance(exc, sqlite3.OperationalError):
        message = str(exc).lower()
        if any(text in message for text in _SQLITE_DISK):
            return Fault.DISK
        if any(text in message for text in _SQLITE_STORE):
            return Fault.STORE
        return None
    if _is_postgres_outage(exc):
        return Fault.STORE
    return None


def _is_postgres_outage(exc: BaseException) -> bool:
    """psycopg's OperationalError covers a refused / dropped / timed-out connection, the
    pool's PoolTimeout, an admin shutdown and "disk full" on the server; a read-only
    transaction (a standby after failover) refuses writes. A bad statement is not one:
    those are ProgrammingError / IntegrityError, bugs of ours."""
    try:
        import psycopg
    except ImportError:    # SQLite-only installation
        return False
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return True
    return isinstance(exc, psycopg.errors.ReadOnlySqlTransaction)
