"""Open the store a config names: SQLite for ``sqlite:`` URLs, PostgreSQL otherwise."""
from __future__ import annotations

from crawld.config import StoreConfig, sqlite_path
from crawld.store.base import Store
from crawld.store.postgres import PostgresStore
from crawld.store.sqlite import SQLiteStore


def open_store(cfg: StoreConfig, pool_size: int = 8, connect_wait_s: float = 30.0) -> Store:
    """A store with its schema created (or migrated), ready for writes. ``connect_wait_s``:
    how long a PostgreSQL server that refuses connections is retried before giving up."""
    if cfg.url.startswith("sqlite:"):
        store: Store = SQLiteStore(sqlite_path(cfg.url), cfg.body_dir, cfg.lock_wait_s)
    else:
        store = PostgresStore(cfg.url, cfg.body_dir, pool_size=pool_size, connect_wait_s=connect_wait_s)
    store.init_schema()
    return store
