"""`crawld show TASK_ID`: one stored page, its row and its body, read back with one seek.

The row's ``warc_file``/``warc_offset``/``warc_length`` name the gzip member of the
page's final response record; a ``revisit`` record (a payload already archived) names
its original's location, one more seek. With ``store.bodies = "files"`` the body comes
from the content-addressed file instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from crawld.config import Config, warc_directory
from crawld.store import Store


@dataclass
class StoredPage:
    row: dict[str, Any]
    body: bytes | None = None                    # None: no body stored for this task
    status_line: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    warc_headers: dict[str, str] = field(default_factory=dict)
    source: str = ""                             # where the body was read from


def load_page(cfg: Config, store: Store, task_id: str) -> StoredPage | None:
    row = store.get_result(task_id)
    if row is None:
        return None
    page = StoredPage(row)
    if row.get("warc_file"):
        _read_warc(page, warc_directory(cfg.store))
    elif row.get("body_sha256"):
        path = store.body_path(row["body_sha256"])
        if path.exists():
            page.body, page.source = path.read_bytes(), str(path)
    return page


def _read_warc(page: StoredPage, directory: str) -> None:
    from crawld.output.warc import REFERS_TO_LOCATION, parse_location, read_record
    row = page.row
    record = read_record(row["warc_file"], row["warc_offset"], row["warc_length"], directory=directory)
    page.warc_headers = dict(record.rec_headers.headers)
    page.source = f"{row['warc_file']}@{row['warc_offset']}"
    if record.http_headers is not None:
        page.status_line = f"{record.http_headers.protocol} {record.http_headers.statusline}"
        page.headers = list(record.http_headers.headers)
    if record.rec_type == "revisit":
        where = record.rec_headers.get_header(REFERS_TO_LOCATION)
        if not where:
            return
        original = parse_location(where)
        record = read_record(original.file, original.offset, original.length, directory=directory)
        page.source += f" -> {original.file}@{original.offset}"
    page.body = record.content_stream().read()


def format_page(page: StoredPage, with_headers: bool) -> str:
    lines = [f"{key:13} {value}" for key, value in page.row.items() if value not in (None, "")]
    if page.source:
        lines.append(f"{'body from':13} {page.source}")
    if with_headers and page.status_line:
        lines += ["", page.status_line, *(f"{k}: {v}" for k, v in page.headers)]
    return "\n".join(lines)


def page_json(page: StoredPage, with_body: bool) -> str:
    data: dict[str, Any] = {"row": page.row, "status_line": page.status_line,
                            "headers": page.headers, "warc_headers": page.warc_headers,
                            "body_from": page.source}
    if with_body:
        data["body"] = None if page.body is None else page.body.decode("utf-8", "replace")
    return json.dumps(data, indent=2, default=str)
