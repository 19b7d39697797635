"""Where a fetched page's body goes (``store.bodies``): WARC files, body files, or nowhere.

The handler's store step calls ``BodySink.store(result)`` and writes the returned
``StoredBody`` into the results row. The WARC sink's records are durable before the row
that points at them is committed: with the store's group commit (every worker) the
commit thread fsyncs the WARC file right before each batch's transaction (one
fdatasync per batch, on the thread that waits for the disk anyway); without it,
``store`` fsyncs itself. The ack follows the row.

One sink per worker process, created in the worker (after fork): a WARC writer holds an
open file and a lock the process owns.
"""
from __future__ import annotations

import abc
import hashlib
import os
from dataclasses import dataclass
from typing import Any

from crawld.config import Config, warc_directory
from crawld.fetch import FetchResult
from crawld.fetch.responses import Hop
from crawld.logs import get_logger
from crawld.output.digests import hashed
from crawld.store import Store

log = get_logger("crawld.output")

WARC_PREFIX = "crawld"


@dataclass(frozen=True)
class StoredBody:
    sha256: str = ""
    warc_file: str = ""
    warc_offset: int | None = None
    warc_length: int | None = None


class BodySink(abc.ABC):
    """Thread-safe: pool threads call ``store`` concurrently."""

    name = "?"

    @abc.abstractmethod
    def store(self, result: FetchResult) -> StoredBody:
        """Persist what the result carries; durable when this returns."""

    def close(self) -> None:
        """Finish files (WARC: fsync and rename to the closed name)."""


def _sha256(body: bytes) -> str:
    return hashed(hashlib.sha256, body).hexdigest() if body else ""


class NoBodies(BodySink):
    """Keep the digest in the row, drop the body (link checkers, status crawls)."""

    name = "none"

    def store(self, result: FetchResult) -> StoredBody:
        return StoredBody(_sha256(result.body))


class BodyFiles(BodySink):
    """Content-addressed files under ``store.body_dir`` (the store's own layout)."""

    name = "files"

    def __init__(self, store: Store) -> None:
        self._store = store

    def store(self, result: FetchResult) -> StoredBody:
        return StoredBody(self._store.save_body(result.body) if result.body else "")


class WarcBodies(BodySink):
    """Every fetch with a response (its redirect hops included) appended to this
    worker's WARC file; the row points at the final response (or revisit) record."""

    name = "warc"

    def __init__(self, directory: str, max_bytes: int, prefix: str = WARC_PREFIX,
                 store: Store | None = None) -> None:
        from crawld.output.warc import WarcFileWriter   # warcio only where it is used
        self.directory = directory
        self.writer = WarcFileWriter(directory, prefix, max_bytes)
        self._sync_here = store is None or not store.add_commit_barrier(self.writer.sync)

    def store(self, result: FetchResult) -> StoredBody:
        if not result.hops:      # refused before any request (robots, SSRF guard): no record
            return StoredBody(_sha256(result.body))
        written = self.writer.write_fetch([_exchange(hop) for hop in result.hops])
        if self._sync_here:      # else the commit thread syncs before the row's batch
            self.writer.sync()   # one fdatasync covers every thread that wrote before it
        file, offset, length = written.location
        return StoredBody(_sha256(result.body), file, offset, length)

    def close(self) -> None:
        self.writer.close()


def _exchange(hop: Hop) -> Any:
    from crawld.output.warc import Exchange
    return Exchange(url=hop.url, status=hop.status, reason=hop.reason, protocol=hop.version,
                    response_headers=hop.response_headers, payload=hop.body,
                    payload_decoded=True, truncated=hop.truncated, method=hop.method,
                    request_headers=hop.request_headers, ip_address=hop.ip or None,
                    fetched_at=hop.at)


def recover_warc_files(directory: str, prefix: str = WARC_PREFIX) -> None:
    """Close the ``.open`` files dead writers of this host left (truncating a partial
    trailing record); the records they hold were fsynced before their rows existed."""
    from crawld.output.warc import recover
    for item in recover(directory, prefix):
        log.warning("warc_file_recovered", file=os.path.basename(item.path), records=item.records,
                    bytes_dropped=item.bytes_dropped, removed=item.removed)


def make_body_sink(cfg: Config, store: Store) -> BodySink:
    """The sink ``store.bodies`` names; a WARC sink recovers leftovers of dead workers first."""
    if cfg.store.bodies == "none":
        return NoBodies()
    if cfg.store.bodies == "files":
        return BodyFiles(store)
    directory = warc_directory(cfg.store)
    os.makedirs(directory, exist_ok=True)
    recover_warc_files(directory)
    return WarcBodies(directory, cfg.store.warc_max_bytes, store=store)
