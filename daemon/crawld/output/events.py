"""The result event body: what downstream stages (parsers, indexers, link extractors)
learn about a stored task. Built from the results row, so the first emission and the
one a redelivered duplicate makes carry the same data."""
from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from typing import Any, Mapping

EVENT_FIELDS = ("task_id", "url", "final_url", "status", "http_status", "content_type", "bytes",
                "body_sha256", "warc_file", "warc_offset", "warc_length", "fetched_at", "round",
                "source", "reason", "redirects", "worker")


def event_body(row: Any) -> bytes:
    """JSON of the ``EVENT_FIELDS`` of a ``ResultRow`` (or a row dict from the store)."""
    data: Mapping[str, Any] = asdict(row) if is_dataclass(row) else row
    return json.dumps({name: data.get(name) for name in EVENT_FIELDS},
                      separators=(",", ":")).encode()
