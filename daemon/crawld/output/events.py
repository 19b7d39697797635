"""The result event body: what downstream stages (parsers, indexers, link extractors)
learn about a stored task. Built from the results row, so the first emission and the
one a redelivered duplicate makes carry the same data."""
from __future__ import annotations

import json
import operator
from typing import Any, Mapping

EVENT_FIELDS = ("task_id", "url", "final_url", "status", "http_status", "content_type", "bytes",
                "body_sha256", "warc_file", "warc_offset", "warc_length", "fetched_at", "round",
                "source", "reason", "redirects", "worker")
_EVENT_VALUES = operator.attrgetter(*EVENT_FIELDS)     # one C call for the 17 attributes


def event_body(row: Any) -> bytes:
    """JSON of the ``EVENT_FIELDS`` of a ``ResultRow`` (or a row dict from the store)."""
    if isinstance(row, Mapping):
        fields = {name: row.get(name) for name in EVENT_FIELDS}
    else:       # its fields are scalars: no deep copy (dataclasses.asdict) needed
        fields = dict(zip(EVENT_FIELDS, _EVENT_VALUES(row)))
    return json.dumps(fields, separators=(",", ":")).encode()
