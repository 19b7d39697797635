"""Crawl tasks: stable ids, the message body, and strict parsing of what arrives.

The task id is content-derived (canonical URL + crawl round) so a re-publish, a
redelivery or a replay of the same URL in the same round is recognisably the same
task: dedup is by id, never by broker hints.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, fields
from typing import Any, Mapping

from w3lib.url import canonicalize_url

DEFAULT_ROUND = "0"
DEFAULT_SOURCE = "default"
MAX_URL_LENGTH = 8192
# A task id travels as the AMQP message_id of every copy and event: a short string.
MAX_TASK_ID_BYTES = 255
_SOURCE_BAD = re.compile(r"[^A-Za-z0-9_-]")      # one character in, one "_" out


class MalformedMessage(ValueError):
    """The message can never be processed; it goes to the dead letters at once."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Task:
    task_id: str
    url: str
    round: str = DEFAULT_ROUND
    source: str = DEFAULT_SOURCE
    enqueued_at: float = 0.0
    depth: int = 0           # links followed from a seed (seeds are 0)
    parent: str = ""         # task id of the page this URL was found on
    meta: str = ""           # JSON object from a hook (priority, user metadata), or ""
    scope: str = ""          # JSON object: per-crawl [scope] overrides from `crawld crawl`

    def to_body(self) -> bytes:
        # Every field is a str or a number: read them in declaration order rather than
        # through dataclasses.asdict, whose deep copy was a third of a batched publish.
        # Optional fields only when set: a seed's message stays what older crawlds sent.
        body = {name: getattr(self, name) for name in _FIELD_NAMES
                if name not in OPTIONAL_FIELDS or getattr(self, name)}
        for name in JSON_FIELDS:
            if name in body:
                body[name] = json.loads(body[name])
        return json.dumps(body, separators=(",", ":")).encode()

    def extra(self) -> str:
        """The JSON fields as one outbox column (``""`` when neither is set)."""
        extra = {name: json.loads(getattr(self, name)) for name in JSON_FIELDS if getattr(self, name)}
        return json.dumps(extra, separators=(",", ":"), sort_keys=True) if extra else ""


OPTIONAL_FIELDS = ("depth", "parent", "meta", "scope")
JSON_FIELDS = ("meta", "scope")
_FIELD_NAMES = tuple(f.name for f in fields(Task))


def from_extra(extra: str) -> dict[str, str]:
    """Task keyword arguments for the JSON fields kept in an outbox ``extra`` column."""
    if not extra:
        return {}
    obj = json.loads(extra)
    return {name: json.dumps(obj[name], separators=(",", ":"), sort_keys=True)
            for name in JSON_FIELDS if name in obj}


def canonical_url(url: str) -> str:
    return canonicalize_url(url.strip(), keep_fragments=False)


def task_id_for(url: str, round_: str = DEFAULT_ROUND) -> str:
    """sha256 of canonical URL and round, truncated to 32 hex chars (128 bits)."""
    return task_id_for_canonical(canonical_url(url), round_)


def task_id_for_canonical(canonical: str, round_: str = DEFAULT_ROUND) -> str:
    """``task_id_for`` of a URL already canonical (canonicalisation is idempotent)."""
    return hashlib.sha256(f"{round_}\n{canonical}".encode()).hexdigest()[:32]


def safe_source(source: str) -> str:
    """Sources become subject tokens / header values: keep them to a safe alphabet."""
    cleaned = _SOURCE_BAD.sub("_", source[:64])
    return cleaned or DEFAULT_SOURCE


def new_task(url: str, round_: str = DEFAULT_ROUND, source: str = DEFAULT_SOURCE,
             task_id: str | None = None) -> Task:
    url = url.strip()
    return Task(task_id=task_id or task_id_for(url, round_), url=url, round=round_,
                source=safe_source(source), enqueued_at=time.time())


def parse_line(line: str, round_: str) -> Task | None:
    """One line of a publish file: a bare URL or a JSON object with ``url``.

    Returns None for blank lines and comments; raises MalformedMessage otherwise.
    """
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MalformedMessage("not_json", str(exc)) from None
        url = _require_url(obj)
        task_id = obj.get("task_id")
        source = obj.get("source", DEFAULT_SOURCE)
        if task_id is not None and (not isinstance(task_id, str) or not task_id):
            raise MalformedMessage("bad_types", "task_id must be a non-empty string")
        _check_task_id(task_id)
        if not isinstance(source, str):
            raise MalformedMessage("bad_types", "source must be a string")
        return new_task(url, str(obj.get("round", round_)), source, task_id)
    return new_task(_require_url({"url": text}), round_)


def parse_message(body: bytes, message_id: str | None = None,
                  max_bytes: int = 65536) -> Task:
    """Decode a delivery body. A plain client may send just ``{"url": ...}``.

    The task id comes from the body, else the broker message id, else the URL.
    """
    if len(body) > max_bytes:
        raise MalformedMessage("oversized", f"{len(body)} bytes > {max_bytes}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedMessage("invalid_utf8", str(exc)) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedMessage("not_json", str(exc)) from None
    if not isinstance(obj, dict):
        raise MalformedMessage("bad_types", "body must be a JSON object")
    url = _require_url(obj)
    round_ = obj.get("round", DEFAULT_ROUND)
    source = obj.get("source", DEFAULT_SOURCE)
    task_id = obj.get("task_id") or message_id
    enqueued_at = obj.get("enqueued_at", 0.0)
    if not isinstance(round_, (str, int)) or isinstance(round_, bool):
        raise MalformedMessage("bad_types", "round must be a string")
    if not isinstance(source, str):
        raise MalformedMessage("bad_types", "source must be a string")
    if task_id is not None and not isinstance(task_id, str):
        raise MalformedMessage("bad_types", "task_id must be a string")
    _check_task_id(task_id)
    if not isinstance(enqueued_at, (int, float)) or isinstance(enqueued_at, bool):
        raise MalformedMessage("bad_types", "enqueued_at must be a number")
    round_ = str(round_)
    return Task(task_id=task_id or task_id_for(url, round_), url=url.strip(), round=round_,
                source=safe_source(source), enqueued_at=float(enqueued_at), **_crawl_fields(obj))


def _crawl_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``depth``, ``parent``, ``meta``, ``scope``: optional; messages without them are seeds."""
    out: dict[str, Any] = {}
    depth = obj.get("depth", 0)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise MalformedMessage("bad_types", "depth must be a non-negative integer")
    parent = obj.get("parent", "")
    if not isinstance(parent, str):
        raise MalformedMessage("bad_types", "parent must be a string")
    out["depth"], out["parent"] = depth, parent
    for name in JSON_FIELDS:
        value = obj.get(name)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise MalformedMessage("bad_types", f"{name} must be a JSON object")
        out[name] = json.dumps(value, separators=(",", ":"), sort_keys=True) if value else ""
    return out


def _check_task_id(task_id: str | None) -> None:
    if not task_id:
        return
    try:
        size = len(task_id.encode("utf-8"))
    except UnicodeEncodeError:       # a lone surrogate (an escaped one in the JSON)
        raise MalformedMessage("bad_types", "task_id must be valid UTF-8 text") from None
    if size > MAX_TASK_ID_BYTES:
        raise MalformedMessage("oversized", f"task_id longer than {MAX_TASK_ID_BYTES} bytes")


def _require_url(obj: Mapping[str, Any]) -> str:
    url = obj.get("url")
    if url is None:
        raise MalformedMessage("no_url", "message has no url")
    if not isinstance(url, str):
        raise MalformedMessage("bad_types", "url must be a string")
    if not url.strip():
        raise MalformedMessage("no_url", "url is empty")
    if len(url) > MAX_URL_LENGTH:
        raise MalformedMessage("oversized", f"url longer than {MAX_URL_LENGTH}")
    return url
