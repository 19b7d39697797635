"""Task ids and message parsing (pure logic)."""
from __future__ import annotations

import json

import pytest

from crawld.task import (MalformedMessage, canonical_url, parse_line, parse_message, task_id_for,
                         task_id_for_canonical)


def test_task_id_is_stable_and_canonical():
    a = task_id_for("http://Example.com/a?b=2&a=1#frag", "r1")
    assert a == task_id_for("http://example.com/a?a=1&b=2", "r1")
    assert a != task_id_for("http://example.com/a?a=1&b=2", "r2")
    assert len(a) == 32


# What task ids are made from, with the w3lib setup.cfg allows (2.5). If one of these changes
# (a w3lib upgrade), a fleet running two versions gives one URL two ids, and a crawl upgraded
# in place fetches those pages again: move setup.cfg's bound knowingly.
CANONICAL_FORMS = [
    ("http://Example.COM/a?b=2&a=1#frag", "http://example.com/a?a=1&b=2"),
    ("http://example.com", "http://example.com/"),
    ("http://example.com/a/./b/../c", "http://example.com/a/c"),
    ("http://example.com/%7euser/caf%c3%a9?q=a+b&q=a%20b", "http://example.com/~user/caf%C3%A9?q=a+b&q=a+b"),
    ("http://b\u00fccher.de/", "http://xn--bcher-kva.de/"),
    ("http://[0:0::1]:8080/", "http://[::1]:8080/"),
    # w3lib 2.6 changes these three (127.0.0.1/, /.;x and http://a.com/x)
    ("http://0x7f.1/", "http://0x7f.1/"),
    ("http://a.com/.;x", "http://a.com/;x"),
    ("http:/a.com/x", "http:///a.com/x"),
]


@pytest.mark.parametrize("url, canonical", CANONICAL_FORMS)
def test_canonical_forms_behind_stored_task_ids_do_not_move(url: str, canonical: str) -> None:
    assert canonical_url(url) == canonical
    assert task_id_for(url, "r1") == task_id_for_canonical(canonical, "r1")


def test_task_id_is_the_hash_every_stored_row_was_keyed_by() -> None:
    assert task_id_for("http://example.com/a?a=1&b=2", "r1") == "a75419374548162d0805398852c0cb3c"
    assert task_id_for("http://example.com/x", "0") == "b8893b666762f3755ff3916949abe80c"


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
    (b'{"url": "http://x", "task_id": "' + b"t" * 256 + b'"}', "oversized"),
    (('{"url": "http://x", "task_id": "' + "\u00e9" * 128 + '"}').encode(), "oversized"),
    (b'{"url": "http://x", "task_id": "a\\udc80"}', "bad_types"),
])
def test_malformed_messages_have_reasons(body, reason):
    with pytest.raises(MalformedMessage) as err:
        parse_message(body, None, max_bytes=65536)
    assert err.value.reason == reason


def test_a_task_id_of_255_bytes_is_the_longest_taken():
    """It is the AMQP message_id of every copy and event (a short string)."""
    assert parse_message(('{"url": "http://x", "task_id": "' + "t" * 255 + '"}').encode()).task_id == "t" * 255
    with pytest.raises(MalformedMessage):
        parse_line('{"url": "http://x", "task_id": "' + "t" * 256 + '"}', "0")


def test_publish_lines():
    assert parse_line("", "0") is None and parse_line("# comment", "0") is None
    task = parse_line('{"url": "http://a/b", "source": "news feed!", "task_id": "t1"}', "0")
    assert task.task_id == "t1" and task.source == "news_feed_"
    with pytest.raises(MalformedMessage):
        parse_line('{"url": 1}', "0")


def test_message_body_is_the_fields_in_order_without_unset_optionals():
    """to_body reads the fields itself (no dataclasses.asdict): the same bytes as the JSON of
    asdict with unset optional fields dropped and the JSON fields decoded."""
    from dataclasses import asdict

    from crawld.task import JSON_FIELDS, OPTIONAL_FIELDS, Task

    def reference(task: Task) -> bytes:
        body = {k: v for k, v in asdict(task).items() if k not in OPTIONAL_FIELDS or v}
        body.update({k: json.loads(body[k]) for k in JSON_FIELDS if k in body})
        return json.dumps(body, separators=(",", ":")).encode()

    seed = Task(task_id="a" * 32, url="http://example.com/é?q=1", enqueued_at=1.5)
    found = Task(task_id="b" * 32, url="http://example.com/x", round="r2", source="crawl",
                 enqueued_at=2.0, depth=3, parent="a" * 32, meta='{"priority":2}',
                 scope='{"max_depth":4}')
    for task in (seed, found):
        assert task.to_body() == reference(task)
    assert list(json.loads(seed.to_body())) == ["task_id", "url", "round", "source", "enqueued_at"]
    assert json.loads(found.to_body())["meta"] == {"priority": 2}
    assert parse_message(found.to_body(), None, 1 << 20) == found
