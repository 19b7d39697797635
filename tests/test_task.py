"""Task ids and message parsing (pure logic)."""
from __future__ import annotations

import json

import pytest

from crawld.task import MalformedMessage, parse_line, parse_message, task_id_for


def test_task_id_is_stable_and_canonical():
    a = task_id_for("http://Example.com/a?b=2&a=1#frag", "r1")
    assert a == task_id_for("http://example.com/a?a=1&b=2", "r1")
    assert a != task_id_for("http://example.com/a?a=1&b=2", "r2")
    assert len(a) == 32


def test_plain_client_message_accepted():
    task = parse_message(json.dumps({"url": "http://example.com/x"}).encode(), message_id=None)
    assert task.task_id == task_id_for("http://example.com/x", "0")
    task = parse_message(b'{"url": "http://example.com/x"}', message_id="given-id")
    assert task.task_id == "given-id"


@pytest.mark.parametrize("body, reason", [
    (b"not json", "not_json"),
    (b"\xff\xfe{", "invalid_utf8"),
    (b'{"nourl": 1}', "no_url"),
    (b'{"url": "  "}', "no_url"),
    (b'{"url": 42}', "bad_types"),
    (b'["http://x"]', "bad_types"),
    (b'{"url": "http://x", "enqueued_at": "yesterday"}', "bad_types"),
    (b'{"url": "http://x", "pad": "' + b"a" * 70000 + b'"}', "oversized"),
])
def test_malformed_messages_have_reasons(body, reason):
    with pytest.raises(MalformedMessage) as err:
        parse_message(body, None, max_bytes=65536)
    assert err.value.reason == reason


def test_publish_lines():
    assert parse_line("", "0") is None and parse_line("# comment", "0") is None
    task = parse_line('{"url": "http://a/b", "source": "news feed!", "task_id": "t1"}', "0")
    assert task.task_id == "t1" and task.source == "news_feed_"
    with pytest.raises(MalformedMessage):
        parse_line('{"url": 1}', "0")
