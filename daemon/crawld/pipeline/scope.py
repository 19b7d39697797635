"""``[scope]``: which discovered URLs become tasks.

A crawl's scope is the worker's ``[scope]`` section with the seed's overrides on top
(``crawld crawl --max-depth 2 ...`` puts them in the seed message as ``scope``; every
task discovered from it inherits them), so one fleet can run crawls with different
scopes at once.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Collection
from urllib.parse import urlsplit

from crawld.config import ConfigError, ScopeConfig

# scheme://host[:port] followed by the path, no userinfo, no IPv6 literal
_SIMPLE_ORIGIN = re.compile(r"(?i)(https?)://([a-z0-9.-]+)(?::\d*)?(?:[/?#]|$)")
SCOPE_KEYS = tuple(f.name for f in fields(ScopeConfig))


class Rejected:
    """Why a URL is out of scope (counted per page, logged at debug)."""
    SCHEME = "scheme"
    OFF_SITE = "off_site"
    DOMAIN = "domain"
    DEPTH = "depth"
    ALLOW = "allow"
    DENY = "deny"


@dataclass(frozen=True)
class Scope:
    same_site: bool
    allowed_domains: tuple[str, ...]
    max_depth: int
    allow: tuple[re.Pattern[str], ...]
    deny: tuple[re.Pattern[str], ...]
    max_links_per_page: int

    def rejects(self, url: str, site: Collection[str], depth: int) -> str | None:
        """None if ``url`` (canonical, absolute) at ``depth`` is to be crawled, else why not.
        ``site``: the host names that count as the page's own site."""
        return self.rejects_site(url, site, depth) or self.rejects_pattern(url)

    def rejects_pattern(self, url: str) -> str | None:
        """allow / deny, on the canonical URL."""
        if self.allow and not any(p.search(url) for p in self.allow):
            return Rejected.ALLOW
        if any(p.search(url) for p in self.deny):
            return Rejected.DENY
        return None


    @property
    def has_patterns(self) -> bool:
        return bool(self.allow or self.deny)

    def site_checker(self, site: Collection[str], depth: int) -> Callable[[str], str | None]:
        """``rejects_site`` for one page's links, with a fast path for the most common
        link of all: one to the page's own site, written in lower case."""
        if self.max_depth and depth > self.max_depth:
            return lambda url: Rejected.DEPTH
        same = tuple(f"{scheme}://{host}{end}" for host in site if host
                     for scheme in ("http", "https") for end in ("/", ":")) \
            if not self.allowed_domains else ()

        def check(url: str) -> str | None:
            if url.startswith(same) and "@" not in url:     # no userinfo to hide a host behind
                return None
            return self.rejects_site(url, site, depth)
        return check

    def rejects_site(self, url: str, site: Collection[str], depth: int) -> str | None:
        """Scheme, depth and host only: valid on a URL as written (the host compares
        case-insensitively either way), so most rejects skip canonicalisation."""
        simple = _SIMPLE_ORIGIN.match(url)
        if simple is not None:          # the common case, without urlsplit's cost
            host = simple.group(2).lower()
        else:
            try:
                parts = urlsplit(url)
                host = parts.hostname or ""
            except ValueError:
                return "invalid"
            if parts.scheme.lower() not in ("http", "https") or not host:
                return Rejected.SCHEME
        if self.max_depth and depth > self.max_depth:
            return Rejected.DEPTH
        if self.allowed_domains:
            if not any(host == d or host.endswith("." + d) for d in self.allowed_domains):
                return Rejected.DOMAIN
        elif self.same_site and host not in site:
            return Rejected.OFF_SITE
        return None


def host_of(url: str) -> str:
    """The site key: host name, lower-case, port ignored (as politeness and sharding use)."""
    return (urlsplit(url).hostname or "").lower()


def site_hosts(task_url: str, final_url: str = "") -> tuple[str, ...]:
    """The hosts that are the page's own site: its URL's host, and the host it redirected to
    when that is the same registrable domain (``example.org`` -> ``www.example.org``), so a
    seed that redirects to ``www.`` is still crawled. A redirect to another domain does not
    widen the crawl."""
    host, final = host_of(task_url), host_of(final_url) if final_url else ""
    if not final or final == host:
        return (host,)
    from crawld.fleet.partition import registrable_domain
    return (host, final) if registrable_domain(final) == registrable_domain(host) else (host,)


@functools.lru_cache(maxsize=64)
def scope_for(base: ScopeConfig, overrides: str = "") -> Scope:
    """The effective scope of a task (cached: a crawl's tasks share one overrides string)."""
    cfg = base
    if overrides:
        cfg = replace(base, **_checked(json.loads(overrides)))
    return Scope(same_site=cfg.same_site,
                 allowed_domains=tuple(d.lower().lstrip(".") for d in cfg.allowed_domains),
                 max_depth=cfg.max_depth,
                 allow=tuple(re.compile(p) for p in cfg.allow),
                 deny=tuple(re.compile(p) for p in cfg.deny),
                 max_links_per_page=cfg.max_links_per_page)


def _checked(values: dict[str, Any]) -> dict[str, Any]:
    """Overrides from a message: known keys only, lists as tuples (a bad one is ignored
    key by key rather than failing the page: the seed was checked when published)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in SCOPE_KEYS:
            continue
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def overrides_json(values: dict[str, Any]) -> str:
    """Validate ``crawld crawl`` scope flags (ConfigError naming the flag) and encode them."""
    given = {k: v for k, v in values.items() if v is not None}
    for key in ("allow", "deny"):
        for pattern in given.get(key, ()):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"--{key}: {pattern!r} is not a valid regex ({exc})") from None
    if given.get("max_depth", 0) < 0:
        raise ConfigError("--max-depth: must be >= 0 (0 = no limit)")
    if given.get("max_links_per_page", 1) < 1:
        raise ConfigError("--max-links-per-page: must be >= 1")
    given = {k: list(v) if isinstance(v, tuple) else v for k, v in given.items()}
    return json.dumps(given, separators=(",", ":"), sort_keys=True) if given else ""
