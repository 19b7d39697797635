"""URL parsing for the fetch path: IRI -> URI, IDNA host, default ports, IP literals.

Strict on purpose: whatever this accepts is what the guard classifies and what goes on
the request line, so a host that could mean two things to two parsers is refused here.
"""
from __future__ import annotations

import functools
import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Union
from urllib.parse import urlsplit

from w3lib.url import safe_url_string

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_OK = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*\.?$")
_LEGACY_IPV4 = re.compile(r"(0x[0-9a-f]*|\d+)(\.(0x[0-9a-f]*|\d+)){0,3}", re.IGNORECASE)


class BadURL(ValueError):
    pass


@dataclass(frozen=True)
class URLParts:
    url: str
    scheme: str
    host: str
    port: int
    path: str
    username: str | None
    password: str | None


# A URL that safe_url_string would return unchanged: lower-case http(s) scheme and host
# name, no userinfo, only characters that need no quoting (tests/test_netguard.py checks the
# claim against w3lib on generated URLs). Most crawl URLs are this, and skip w3lib's cost.
_SAFE = r"-A-Za-z0-9._~!$&()*+,;=:@%/"     # and "'", in the path only (w3lib quotes it after "?")
_ALREADY_SAFE = re.compile(rf"(?P<scheme>https?)://(?P<host>[a-z0-9.-]+)(?::(?P<port>[0-9]{{1,5}}))?"
                           rf"(?P<path>/[{_SAFE}']*)?(?:\?(?P<query>[{_SAFE}?]*))?(?:#[{_SAFE}?]*)?")


@functools.lru_cache(maxsize=4096)
def parse_url(url: str) -> URLParts:
    """Split and normalise a URL (IRI -> URI, IDNA host); raises BadURL.
    Cached: the handler, the guard and robots each ask for the same URL of a task."""
    safe = _ALREADY_SAFE.fullmatch(url)
    if safe is not None:
        return _parse_safe(safe)
    try:
        quoted = safe_url_string(url.strip())
        parts = urlsplit(quoted)
        port = parts.port
    except (ValueError, UnicodeError) as exc:
        raise BadURL(str(exc)) from None
    scheme = parts.scheme.lower()
    if not scheme:
        raise BadURL("no scheme")
    if scheme not in DEFAULT_PORTS:     # kept as given: it will only be refused
        return URLParts(quoted, scheme, parts.hostname or "", port or 0, parts.path, None, None)
    return _normalised(scheme, parts.hostname or "", port, parts.path, parts.query,
                       parts.username, parts.password)


def _parse_safe(match: re.Match) -> URLParts:
    """What urlsplit would make of a URL the fast-path pattern matched, read off its groups
    (urlsplit and its properties cost more than the rest of the check)."""
    port = match["port"]
    if port is not None and int(port) > 65535:
        raise BadURL("Port out of range 0-65535")
    return _normalised(match["scheme"], match["host"], int(port) if port else None,
                       match["path"] or "", match["query"] or "", None, None)


def _normalised(scheme: str, host: str, port: int | None, path: str, query: str,
                username: str | None, password: str | None) -> URLParts:
    host = host.rstrip(".")
    _validate_host(host)
    port = port or DEFAULT_PORTS[scheme]
    path = (path or "/") + (f"?{query}" if query else "")
    clean = f"{scheme}://{netloc(scheme, host, port)}{path}"
    return URLParts(clean, scheme, host, port, path, username, password)


def netloc(scheme: str, host: str, port: int) -> str:
    """``host[:port]`` as it goes into a URL or a Host header: IPv6 bracketed, default port omitted."""
    bracketed = f"[{host}]" if ":" in host else host
    return bracketed if DEFAULT_PORTS.get(scheme) == port else f"{bracketed}:{port}"


def _validate_host(host: str) -> None:
    if not host:
        raise BadURL("no host")
    if literal_ip(host) is not None:
        return
    if len(host) > 253 or not _HOST_OK.match(host):
        raise BadURL(f"invalid host {host!r}")


@functools.lru_cache(maxsize=4096)
def literal_ip(host: str) -> IPAddress | None:
    """The address ``host`` spells without DNS (also legacy IPv4 forms), or None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    if _LEGACY_IPV4.fullmatch(host):
        # "2130706433", "0x7f.1", "0177.0.0.1": getaddrinfo (and browsers) read these as
        # IPv4 without DNS; classify them as the address they are.
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None
