"""Tables, indexes and migrations: the DDL both back ends share.

The statements are written for SQLite; PostgreSQL runs them too, with the 64-bit
columns widened (see ``postgres_schema``) and older INTEGER columns migrated.
"""
from __future__ import annotations

from typing import Any

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS outbox (
        task_id TEXT PRIMARY KEY, url TEXT NOT NULL, round TEXT NOT NULL, source TEXT NOT NULL,
        state TEXT NOT NULL DEFAULT 'new', tries INTEGER NOT NULL DEFAULT 0,
        created_at DOUBLE PRECISION NOT NULL, confirmed_at DOUBLE PRECISION,
        last_error TEXT NOT NULL DEFAULT '', depth INTEGER NOT NULL DEFAULT 0,
        parent TEXT NOT NULL DEFAULT '', extra TEXT NOT NULL DEFAULT '')""",
    """CREATE TABLE IF NOT EXISTS results (
        task_id TEXT PRIMARY KEY, url TEXT NOT NULL, final_url TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL, http_status INTEGER, reason TEXT NOT NULL DEFAULT '',
        content_type TEXT NOT NULL DEFAULT '', bytes INTEGER NOT NULL DEFAULT 0,
        body_sha256 TEXT NOT NULL DEFAULT '', attempts INTEGER NOT NULL DEFAULT 1,
        fetched_at DOUBLE PRECISION NOT NULL, worker TEXT NOT NULL DEFAULT '',
        round TEXT NOT NULL DEFAULT '', source TEXT NOT NULL DEFAULT '',
        redirects INTEGER NOT NULL DEFAULT 0, enqueued_at DOUBLE PRECISION NOT NULL DEFAULT 0,
        stream_seq INTEGER, writes INTEGER NOT NULL DEFAULT 1,
        warc_file TEXT NOT NULL DEFAULT '', warc_offset INTEGER, warc_length INTEGER)""",
    """CREATE TABLE IF NOT EXISTS attempts (
        task_id TEXT NOT NULL, attempt INTEGER NOT NULL, url TEXT NOT NULL,
        error TEXT NOT NULL, http_status INTEGER, delay_s DOUBLE PRECISION NOT NULL DEFAULT 0,
        worker TEXT NOT NULL DEFAULT '', at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (task_id, attempt))""",
    """CREATE TABLE IF NOT EXISTS dead (
        task_id TEXT PRIMARY KEY, url TEXT NOT NULL, reason TEXT NOT NULL, error TEXT NOT NULL,
        attempts INTEGER NOT NULL, origin TEXT NOT NULL, dead_at DOUBLE PRECISION NOT NULL,
        body TEXT NOT NULL DEFAULT '', round TEXT NOT NULL DEFAULT '',
        source TEXT NOT NULL DEFAULT '', replays INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS redeliveries (
        task_id TEXT PRIMARY KEY, count INTEGER NOT NULL, last_at DOUBLE PRECISION NOT NULL)""",
    # deliveries given back through no fault of the task (store/ledger.py)
    """CREATE TABLE IF NOT EXISTS forgiven (
        task_id TEXT PRIMARY KEY, count INTEGER NOT NULL, last_at DOUBLE PRECISION NOT NULL)""",
    # a suspect running alone; still here on its next delivery = it killed its worker.
    # deaths: lone runs that did so (counted once each: the count clears worker)
    """CREATE TABLE IF NOT EXISTS quarantine (
        task_id TEXT PRIMARY KEY, worker TEXT NOT NULL, started_at DOUBLE PRECISION NOT NULL,
        deaths INTEGER NOT NULL DEFAULT 0)""",
    # a stored page whose hooks ran and whose discovered URLs are confirmed (pipeline/hooks.py);
    # a stored page without a row here has its hooks run again on its next delivery
    """CREATE TABLE IF NOT EXISTS hooks_done (
        task_id TEXT PRIMARY KEY, links INTEGER NOT NULL DEFAULT 0,
        done_at DOUBLE PRECISION NOT NULL)""",
    # rows by state, in the order they were added: `crawld publish` pages through the new
    # ones in that order (and counts per state use the prefix)
    "CREATE INDEX IF NOT EXISTS outbox_state_order ON outbox (state, created_at, task_id)",
    "CREATE INDEX IF NOT EXISTS dead_at ON dead (dead_at)",
    "CREATE INDEX IF NOT EXISTS results_fetched ON results (fetched_at)",
]

# SQLite's INTEGER is 64-bit, PostgreSQL's is 32-bit: a JetStream stream sequence
# (uint64) above 2**31-1 would make every put_result fail with "integer out of range".
BIGINT_COLUMNS = {"results": ("stream_seq", "bytes", "warc_offset", "warc_length")}

# Columns added after a table's first release: (name, SQLite type and default). A database
# an older crawld created gains them on start (``migrate_added_columns``).
ADDED_COLUMNS = {"results": (("warc_file", "TEXT NOT NULL DEFAULT ''"),
                             ("warc_offset", "INTEGER"), ("warc_length", "INTEGER")),
                 "outbox": (("depth", "INTEGER NOT NULL DEFAULT 0"),
                            ("parent", "TEXT NOT NULL DEFAULT ''"),
                            ("extra", "TEXT NOT NULL DEFAULT ''")),
                 "quarantine": (("deaths", "INTEGER NOT NULL DEFAULT 0"),)}


# Indexes on added columns: created after the migration added them to an older table;
# and indexes a newer one replaces (outbox_state_order starts with state).
AFTER_MIGRATION = ["CREATE INDEX IF NOT EXISTS outbox_parent ON outbox (parent)",
                   "DROP INDEX IF EXISTS outbox_state"]


def migrate_added_columns(cur: Any, postgres: bool) -> None:
    """``ALTER TABLE ... ADD COLUMN`` for every ``ADDED_COLUMNS`` entry a table lacks,
    then the ``AFTER_MIGRATION`` statements."""
    _add_columns(cur, postgres)
    for stmt in AFTER_MIGRATION:
        cur.execute(stmt)


def _add_columns(cur: Any, postgres: bool) -> None:
    for table, columns in ADDED_COLUMNS.items():
        if postgres:
            for name, decl in columns:
                if name in BIGINT_COLUMNS.get(table, ()):
                    decl = decl.replace("INTEGER", "BIGINT")
                cur.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {decl}")
            continue
        cur.execute(f"PRAGMA table_info({table})")
        present = {row[1] for row in cur.fetchall()}
        for name, decl in columns:
            if name not in present:
                cur.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")


def postgres_schema() -> list[str]:
    """``SCHEMA`` with the ``BIGINT_COLUMNS`` widened, for a new PostgreSQL database."""
    statements = []
    for stmt in SCHEMA:
        for table, columns in BIGINT_COLUMNS.items():
            if f"TABLE IF NOT EXISTS {table} " in stmt:
                for col in columns:
                    stmt = stmt.replace(f"{col} INTEGER", f"{col} BIGINT")
        statements.append(stmt)
    return statements


def migrate_postgres_bigint(cur: Any) -> None:
    """Widen ``BIGINT_COLUMNS`` still INTEGER in a table an older crawld created."""
    for table, columns in BIGINT_COLUMNS.items():
        cur.execute("SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND table_name = %s "
                    "AND data_type = 'integer' AND column_name = ANY(%s)",
                    (table, list(columns)))
        for (col,) in cur.fetchall():
            cur.execute(f"ALTER TABLE {table} ALTER COLUMN {col} TYPE BIGINT")
