"""Result store: outbox, results, attempts and dead letters, keyed by task id.

Import from here (``from crawld.store import Store, open_store``); the submodules
split the store by concern:

* ``base``: row types and the ``Store`` base with the write/read API
* ``reports``: status / reconcile / latency queries (a ``Store`` mixin)
* ``schema``: DDL and the PostgreSQL BIGINT migration
* ``sqlite``, ``postgres``: the back ends
* ``group_commit``: many threads' writes in one transaction
* ``factory``: ``open_store``
"""
from crawld.store.base import (DEAD_COLUMNS, DEAD_UPSERT, RESULT_COLUMNS, RESULT_UPSERT,
                               DeadRow, ResultRow, Store)
from crawld.store.factory import open_store
from crawld.store.group_commit import GroupCommit
from crawld.store.postgres import PG_PERMANENT_ERRORS, PostgresStore
from crawld.store.reports import ReportQueries
from crawld.store.schema import SCHEMA
from crawld.store.sqlite import SQLiteStore

__all__ = [
    "DEAD_COLUMNS", "DEAD_UPSERT", "PG_PERMANENT_ERRORS", "RESULT_COLUMNS", "RESULT_UPSERT",
    "SCHEMA", "DeadRow", "GroupCommit", "PostgresStore", "ReportQueries", "ResultRow",
    "SQLiteStore", "Store", "open_store",
]
