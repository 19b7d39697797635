"""``crawld.hooks.links:extract``: the built-in link extractor (lxml).

Follows ``<a href>``, ``<area href>`` and ``<link rel=canonical>``, resolved against
``<base href>`` (else the page's final URL). Skips ``rel=nofollow`` links, and every link
of a page that says ``<meta name=robots content=nofollow>`` (or ``none``) or whose
response carries ``X-Robots-Tag: nofollow``. Only 2xx HTML (``text/html``,
``application/xhtml+xml``) is parsed; at most ``scope.max_links_per_page`` links come
back per page. Scope, canonicalisation and dedup happen after the hook, for every hook
alike (``crawld.pipeline.discover``).
"""
from __future__ import annotations

import re
from typing import Iterator
from urllib.parse import urljoin

from lxml import etree
from w3lib.encoding import html_body_declared_encoding

from crawld.hooks import Page

_ORIGIN = re.compile(r"(?i)https?://[^/?#]+")
HTML_TYPES = ("text/html", "application/xhtml+xml")
NOFOLLOW = frozenset({"nofollow", "none"})
SKIP_SCHEMES = ("javascript:", "mailto:", "tel:", "data:", "about:", "#")
VALUED = frozenset({"unavailable_after", "max-snippet", "max-image-preview", "max-video-preview"})
AGENT = "crawld"           # X-Robots-Tag: "crawld: nofollow" addresses us; other agents do not


def extract(page: Page) -> list[str]:
    """The followable links of one page, absolute, in document order (duplicates kept:
    discovery deduplicates after canonicalising)."""
    if not _parseable(page) or _header_nofollow(page.header("X-Robots-Tag")):
        return []
    root = _parse(page)
    if root is None:
        return []
    base = page.final_url or page.url
    hrefs: list[str] = []
    for kind, value in _candidates(root):
        if kind == "nofollow":
            return []
        if kind == "base":
            base = urljoin(base, value)
            continue
        hrefs.append(value)
        if len(hrefs) >= page.max_links:
            break
    join = _Joiner(base)
    return [join(href) for href in hrefs]


class _Joiner:
    """``urljoin(base, href)``, skipping urllib's parse for the two common shapes of link:
    an absolute http(s) URL and a root-relative path, when neither has dot segments."""

    def __init__(self, base: str) -> None:
        self.base = base
        match = _ORIGIN.match(base)
        self.origin = match.group(0) if match else ""

    def __call__(self, href: str) -> str:
        if "/." not in href and "\\" not in href:
            if href[:7].lower() == "http://" or href[:8].lower() == "https://":
                return href
            if self.origin and href[:1] == "/" and href[1:2] != "/":
                return self.origin + href
        return urljoin(self.base, href)


def _parseable(page: Page) -> bool:
    media = page.content_type.split(";", 1)[0].strip().lower()
    return media in HTML_TYPES and 200 <= (page.http_status or 0) < 300 and bool(page.body)


def _parse(page: Page) -> etree._Element | None:
    encoding = _charset(page.content_type) or html_body_declared_encoding(page.body) or "utf-8"
    for attempt in (encoding, None):      # None: libxml2 guesses, if it did not know that name
        try:
            parser = etree.HTMLParser(encoding=attempt, no_network=True, remove_comments=True,
                                      remove_pis=True)
            return etree.fromstring(page.body, parser)
        except LookupError:
            continue
        except (etree.ParserError, ValueError):      # empty or undecodable: no links
            return None
    return None


def _charset(content_type: str) -> str | None:
    """The Content-Type charset. Undeclared anywhere means UTF-8 here, not HTML4's Latin-1."""
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip():
            return value.strip().strip('"') or None
    return None


def _candidates(root: etree._Element) -> Iterator[tuple[str, str]]:
    """("href" | "base" | "nofollow", value) in document order; <base> counts only before
    the links it applies to, as browsers do for the first one."""
    seen_base = False
    for el in root.iter("a", "area", "link", "base", "meta"):
        tag = el.tag
        if tag == "meta":
            if (el.get("name") or "").strip().lower() in ("robots", AGENT) and \
                    NOFOLLOW & _tokens(el.get("content")):
                yield "nofollow", ""
            continue
        href = (el.get("href") or "").strip()
        if not href or href.lower().startswith(SKIP_SCHEMES):
            continue
        rel = el.get("rel")
        if tag == "base":
            if not seen_base:
                seen_base = True
                yield "base", href
        elif tag == "link":
            if rel and "canonical" in _tokens(rel):
                yield "href", href
        elif not rel or "nofollow" not in rel.lower() or "nofollow" not in _tokens(rel):
            yield "href", href


def _tokens(value: str | None) -> set[str]:
    return {t.strip().lower() for t in (value or "").replace(",", " ").split() if t.strip()}


def _header_nofollow(value: str) -> bool:
    """``X-Robots-Tag: nofollow`` / ``noindex, nofollow`` / ``crawld: nofollow`` (a
    directive for another named agent does not apply to us)."""
    agent = ""
    for part in value.split(","):
        part = part.strip().lower()
        head, sep, rest = part.partition(":")
        if sep and head.strip() not in VALUED and " " not in head.strip():
            agent, part = head.strip(), rest.strip()
        if part in NOFOLLOW and agent in ("", AGENT):
            return True
    return False
