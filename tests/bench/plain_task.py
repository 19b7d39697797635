"""The task a plain Celery user writes (bench_frameworks.py's celery-prefork+requests).

Nothing from crawld: ``requests.get`` with a timeout, then one INSERT ... ON CONFLICT and
one commit per task into SQLite, on a connection each prefork child opens for itself on
its first task (a connection opened before the fork would be shared by every child).
The ``results`` table has the two columns the benchmark counts: ``task_id`` (rows
stored) and ``writes`` (> 1: the task ran again for the same id).

Environment: BENCH_DB (the SQLite file).
"""
from __future__ import annotations

import os
import sqlite3

import requests

SCHEMA = ("CREATE TABLE IF NOT EXISTS results (task_id TEXT PRIMARY KEY, url TEXT NOT NULL, "
          "status INTEGER, body BLOB, writes INTEGER NOT NULL DEFAULT 1)")
UPSERT = ("INSERT INTO results (task_id, url, status, body) VALUES (?, ?, ?, ?) "
          "ON CONFLICT (task_id) DO UPDATE SET status = excluded.status, body = excluded.body, "
          "writes = results.writes + 1")

_conn: sqlite3.Connection | None = None


def create_table(path: str) -> None:
    """Run once before the workers start, as a migration would: two fresh children
    switching a new file to WAL at the same moment fail with "database is locked"
    about one time in ten (the journal-mode change does not wait on the busy timeout)."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode=WAL")   # readers (the bench's row counter) do not block the writers
        conn.execute(SCHEMA)
        conn.commit()
    finally:
        conn.close()


def _db() -> sqlite3.Connection:
    global _conn
    if _conn is None:
        _conn = sqlite3.connect(os.environ["BENCH_DB"])
    return _conn


def fetch_and_store(task_id: str, url: str) -> None:
    response = requests.get(url, timeout=10)
    conn = _db()
    with conn:                                    # commits (or rolls back) this one row
        conn.execute(UPSERT, (task_id, url, response.status_code, response.content))
