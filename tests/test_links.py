"""The link extractor, scope and the message's crawl fields: pure logic, no I/O."""
from __future__ import annotations

import dataclasses
import json

import pytest

from crawld.config import Config
from crawld.hooks import Link, Page
from crawld.hooks.links import extract
from crawld.pipeline.discover import discovered_tasks
from crawld.task import new_task, parse_message, task_id_for

BASE = "http://site.test/dir/page"


def _page(body: str, content_type: str = "text/html; charset=utf-8", status: int = 200,
          headers: list[tuple[str, str]] | None = None, max_links: int = 1000) -> Page:
    return Page(new_task(BASE), BASE, "fetched", status, headers or [], content_type,
                body.encode(), max_links=max_links)


def test_extracts_a_area_canonical_with_base():
    body = ('<html><head><base href="/b/"><link rel="canonical" href="/canon">'
            '<link rel="stylesheet" href="x.css"></head><body><a href="one">1</a>'
            '<map><area href="two"></map><a href="three" rel="nofollow">3</a>'
            '<a href="javascript:void(0)">j</a><a href="mailto:a@b">m</a><a href="#top">t</a>'
            '<a href="http://other.test/x#f">o</a></body></html>')
    assert extract(_page(body)) == ["http://site.test/canon", "http://site.test/b/one",
                                    "http://site.test/b/two", "http://other.test/x#f"]


@pytest.mark.parametrize("meta, header", [
    ('<meta name="robots" content="noindex, nofollow">', None),
    ('<meta name="ROBOTS" content="none">', None),
    ("", ("X-Robots-Tag", "nofollow")),
    ("", ("x-robots-tag", "crawld: noarchive, nofollow")),
])
def test_nofollow_pages_give_no_links(meta, header):
    body = f"<html><head>{meta}</head><body><a href='/a'>a</a></body></html>"
    assert extract(_page(body, headers=[header] if header else [])) == []


def test_header_for_another_agent_does_not_apply():
    body = "<a href='/a'>a</a>"
    assert extract(_page(body, headers=[("X-Robots-Tag", "otherbot: nofollow")])) == ["http://site.test/a"]


@pytest.mark.parametrize("content_type, status", [("application/pdf", 200), ("text/plain", 200),
                                                  ("text/html", 404), ("text/html", 301)])
def test_only_2xx_html_is_parsed(content_type, status):
    assert extract(_page("<a href='/a'>a</a>", content_type, status)) == []


def test_xhtml_and_undeclared_charset_and_bounds():
    assert extract(_page("<a href='/é'>a</a>", "application/xhtml+xml")) == ["http://site.test/é"]
    many = "".join(f"<a href='/p{i}'>x</a>" for i in range(50))
    assert len(extract(_page(many, max_links=7))) == 7
    assert extract(_page("")) == [] and extract(_page("\x00\x01", "text/html")) == []
    assert extract(_page("<a href=/a>a</a>", "text/html; charset=x-no-such")) == ["http://site.test/a"]


def test_discovery_canonicalises_scopes_and_dedupes():
    cfg = Config().replace("scope", max_depth=2, deny=(r"/private/",))
    parent = dataclasses.replace(new_task(BASE), depth=1)
    raw = ["http://SITE.test/a?b=2&a=1#x", "http://site.test/a?a=1&b=2", "http://site.test/./a?a=1&b=2",
           "http://other.test/", "ftp://site.test/f", "http://site.test:1@evil.test/", "http://site.test/private/x", BASE,
           Link("http://site.test/meta", priority=3, meta={"k": "v"})]
    found = discovered_tasks(parent, raw, cfg)
    assert [t.url for t in found.tasks] == ["http://site.test/a?a=1&b=2", "http://site.test/meta"]
    first = found.tasks[0]
    assert first.task_id == task_id_for("http://site.test/a?a=1&b=2", parent.round)
    assert (first.depth, first.parent) == (2, parent.task_id)
    assert json.loads(found.tasks[1].meta) == {"k": "v", "priority": 3}
    assert found.rejected == {"off_site": 2, "scheme": 1, "deny": 1}
    deeper = dataclasses.replace(parent, depth=2)
    assert discovered_tasks(deeper, raw, cfg).tasks == [], "depth 3 > max_depth 2"


def test_allowed_domains_replace_same_site_and_seed_scope_overrides():
    cfg = Config().replace("scope", allowed_domains=("example.org",))
    parent = new_task("http://www.example.org/")
    urls = ["http://example.org/a", "http://deep.www.example.org/b", "http://notexample.org/c",
            "http://www.example.org.evil.test/d"]
    assert [t.url for t in discovered_tasks(parent, urls, cfg).tasks] == urls[:2]
    seeded = dataclasses.replace(parent, scope=json.dumps({"allowed_domains": [], "same_site": False}))
    assert len(discovered_tasks(seeded, urls, cfg).tasks) == 4
    child = discovered_tasks(seeded, urls, cfg).tasks[0]
    assert child.scope == seeded.scope, "children inherit the crawl's scope"


def test_message_crawl_fields_round_trip_and_old_messages():
    task = dataclasses.replace(new_task("http://a.test/"), depth=3, parent="p" * 32,
                               meta='{"priority":1}', scope='{"max_depth":4}')
    body = json.loads(task.to_body())
    assert body["depth"] == 3 and body["parent"] == "p" * 32
    assert body["meta"] == {"priority": 1} and body["scope"] == {"max_depth": 4}
    back = parse_message(task.to_body())
    assert (back.depth, back.parent, back.meta, back.scope) == (3, "p" * 32, task.meta, task.scope)
    seed = new_task("http://a.test/")
    assert set(json.loads(seed.to_body())) == {"task_id", "url", "round", "source", "enqueued_at"}
    old = parse_message(b'{"url": "http://a.test/x"}')
    assert (old.depth, old.parent, old.meta, old.scope) == (0, "", "", "")
    for bad in (b'{"url": "http://a/", "depth": -1}', b'{"url": "http://a/", "depth": "2"}',
                b'{"url": "http://a/", "parent": 5}', b'{"url": "http://a/", "meta": [1]}'):
        with pytest.raises(ValueError):
            parse_message(bad)


def test_a_seed_redirecting_to_www_is_still_crawled():
    cfg = Config()
    seed = new_task("http://example.org/")
    links = ["https://www.example.org/a", "http://example.org/b", "https://shop.example.org/c",
             "http://other.test/d"]
    found = discovered_tasks(seed, links, cfg, final_url="https://www.example.org/")
    assert [t.url for t in found.tasks] == links[:2]
    moved_away = discovered_tasks(seed, links, cfg, final_url="http://other.test/")
    assert [t.url for t in moved_away.tasks] == ["http://example.org/b"], "no wandering off by redirect"


def test_relative_urls_from_a_hook_resolve_against_the_final_url():
    seed = new_task("http://site.test/a/b")
    found = discovered_tasks(seed, ["c", "../d", "/e", Link("f?x=1#y")], Config(),
                             final_url="http://site.test/a/b/")
    assert [t.url for t in found.tasks] == ["http://site.test/a/b/c", "http://site.test/a/d",
                                            "http://site.test/e", "http://site.test/a/b/f?x=1"]
