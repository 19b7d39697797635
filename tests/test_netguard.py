"""SSRF guard: address classes, allow-list, resolve-once, refusals before any connect.

Names are resolved by a real DNS server (dnsmasq on 127.0.0.1, tests/dns_server.py) through
the production resolver (dnspython). A scripted in-process resolver appears only where the
test is about the guard's own handling of a resolver (its error mapping and its deadline).
"""
from __future__ import annotations

import ipaddress
import random
import re
import string
import threading
import time

import pytest
from urllib3.exceptions import NewConnectionError

from crawld.config import FetchConfig
from crawld.fetch import Fetcher
from crawld.fetch.netguard import NetGuard, Refusal, Target, address_problem
from crawld.fetch.pools import GuardedHTTPConnection
from crawld.fetch import urls as urls_module
from crawld.fetch.urls import _ALREADY_SAFE, BadURL, parse_url

from crawld.fetch.resolver import DnsResolver

try:
    from dns_server import RECORDS, LocalDNS, start_or_skip
    from fetch_servers import (LocalServer, forbid_external_network, make_cert, page, redirect)
except ImportError:  # tests/ imported as a package
    from tests.dns_server import RECORDS, LocalDNS, start_or_skip
    from tests.fetch_servers import (LocalServer, forbid_external_network, make_cert, page, redirect)

LOOPBACK = ("127.0.0.0/8",)


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory):
    server = start_or_skip(str(tmp_path_factory.mktemp("dns")), RECORDS, nxdomain=["nx.test"])
    yield server
    server.__exit__()


@pytest.fixture(autouse=True)
def net(monkeypatch):
    return forbid_external_network(monkeypatch)


def fetcher(tmp_path, allow=LOOPBACK, dns_servers=(), **kw) -> Fetcher:
    cfg = FetchConfig(allow_networks=allow, obey_robots=kw.pop("obey_robots", False), timeout_s=5,
                      dns_servers=tuple(dns_servers))
    return Fetcher(cfg, pool_size=4, run_dir=str(tmp_path), **kw)


def real_guard(server: LocalDNS, allow=(), **kw) -> NetGuard:
    """The production resolver, asking only ``server``."""
    return NetGuard(allow, resolver=DnsResolver([server.server], timeout_s=5), **kw)


@pytest.mark.parametrize("address, problem", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.0.0.1", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"),
    ("fc00::1", "private"), ("169.254.169.254", "link_local"), ("fe80::1", "link_local"),
    ("100.64.0.1", "cgnat"), ("100.127.255.254", "cgnat"), ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"), ("198.18.0.1", "private"),
    ("192.0.2.1", "private"), ("::ffff:10.0.0.1", "ipv4_mapped"), ("::ffff:8.8.8.8", "ipv4_mapped"),
    ("2002:a00:1::1", "embedded_ipv4"),          # 6to4 wrapping 10.0.0.1
    ("64:ff9b::a9fe:a9fe", "embedded_ipv4"),     # NAT64 wrapping 169.254.169.254
    ("8.8.8.8", None), ("93.184.216.34", None), ("2606:4700:4700::1111", None),
])
def test_address_classes(address: str, problem: str | None) -> None:
    assert address_problem(ipaddress.ip_address(address)) == problem


def test_allow_list_exempts_only_named_ranges() -> None:
    guard = NetGuard(["127.0.0.0/8", "10.1.0.0/16"])
    assert guard.problem(ipaddress.ip_address("127.0.0.1")) is None
    assert guard.problem(ipaddress.ip_address("10.1.2.3")) is None
    assert guard.problem(ipaddress.ip_address("::ffff:10.1.2.3")) is None     # same host
    assert guard.problem(ipaddress.ip_address("10.2.0.1")) == "private"
    assert guard.problem(ipaddress.ip_address("::1")) == "loopback"


@pytest.mark.parametrize("url, kind, reason", [
    ("ftp://example.com/x", "skipped", "scheme"),
    ("file:///etc/passwd", "skipped", "scheme"),
    ("javascript:alert(1)", "skipped", "scheme"),
    ("gopher://127.0.0.1:6379/_INFO", "skipped", "scheme"),
    ("http://", "failed", "bad_url"),
    ("http://exa mple.com/", "failed", "bad_url"),
    ("http://example.com:99999/", "failed", "bad_url"),
    ("example.com/no-scheme", "failed", "bad_url"),
    ("http://127.0.0.1/", "skipped", "private_address"),
    ("http://2130706433/", "skipped", "private_address"),           # 127.0.0.1 as an integer
    ("http://0x7f.1/", "skipped", "private_address"),               # 127.0.0.1, hex form
    ("http://[::ffff:127.0.0.1]/", "skipped", "private_address"),
    ("http://169.254.169.254/latest/meta-data/", "skipped", "private_address"),
    ("http://localhost/", "skipped", "private_address"),
])
def test_check_refuses(url: str, kind: str, reason: str, net) -> None:
    decision = NetGuard().check(url)
    assert isinstance(decision, Refusal), decision
    assert (decision.kind, decision.reason) == (kind, reason), decision
    assert net.blocked == [] and net.connects == []


def scripted_resolver(table: dict[str, list[str]], calls: list[str] | None = None):
    """In-process stand-in for a resolver; only for the guard's handling of resolver results."""
    def resolve(host: str) -> list[str]:
        if calls is not None:
            calls.append(host)
        if host not in table:
            raise OSError(f"no such host {host}")
        return table[host]
    return resolve


def test_names_resolving_to_private_addresses_are_refused_real_dns(dns_server, net) -> None:
    """Real dnsmasq answers, real dnspython lookups; the guard only classifies, never connects."""
    guard = real_guard(dns_server)
    for host, address_class in (("evil.test", "private"), ("rfc1918b.test", "private"),
                                ("home.test", "private"), ("meta.test", "link_local"),
                                ("v6.test", "loopback"), ("mapped.test", "ipv4_mapped")):
        decision = guard.check(f"http://{host}/")
        assert isinstance(decision, Refusal), host
        assert (decision.kind, decision.reason, decision.address_class) == (
            "skipped", "private_address", address_class), host
        assert str(ipaddress.ip_address(RECORDS[host][0])) in decision.detail
        assert dns_server.queries(host, "A") + dns_server.queries(host, "AAAA") >= 1, host
    target = guard.check("http://public.test/a?b=1")       # decision only: never fetched
    assert isinstance(target, Target) and target.ip == "93.184.216.34"
    assert (target.host_header, target.path) == ("public.test", "/a?b=1")
    guard.close()
    assert net.connects == [] and net.blocked == [] and net.lookups == []
    assert net.datagrams and all(d == ("127.0.0.1", dns_server.port) for d in net.datagrams)


def test_mixed_answer_pins_to_the_acceptable_address_real_dns(dns_server) -> None:
    guard = real_guard(dns_server)
    target = guard.check("https://mixed.test:8443/")
    guard.close()
    assert isinstance(target, Target)
    assert target.ip == "93.184.216.34" and target.origin == "https://mixed.test:8443"


def test_guard_maps_resolver_failure_and_hang_to_transient_dns_errors() -> None:
    """Scripted resolver: the guard's mapping of an OSError, and its own deadline on a hang."""
    def hangs(host: str) -> list[str]:
        time.sleep(2)
        return ["93.184.216.34"]
    guard = NetGuard(resolver=scripted_resolver({}))
    assert guard.check("http://nx.test/") == Refusal("error", "dns", "resolving nx.test: no such host nx.test")
    started = time.monotonic()
    decision = NetGuard(resolver=hangs, dns_timeout_s=0.2).check("http://slow.test/")
    assert isinstance(decision, Refusal) and decision.reason == "dns"
    assert time.monotonic() - started < 1.0


def test_nxdomain_from_real_dns_is_a_transient_dns_error(dns_server) -> None:
    guard = real_guard(dns_server)
    decision = guard.check("http://nx.test/")
    guard.close()
    assert isinstance(decision, Refusal)
    assert (decision.kind, decision.reason) == ("error", "dns")
    assert decision.detail.startswith("resolving nx.test: ") and "NXDOMAIN" in decision.detail
    assert dns_server.queries("nx.test") == 1


def test_parse_url_normalises_iri_and_idna() -> None:
    parts = parse_url("HTTP://Bücher.Example:80/ä?q=ü#frag")
    assert parts.url == "http://xn--bcher-kva.example/%C3%A4?q=%C3%BC"
    assert parts.host == "xn--bcher-kva.example" and parts.port == 80


def _parsed(url: str) -> object:
    try:
        return parse_url.__wrapped__(url)       # uncached: the path taken is the one under test
    except BadURL:
        return BadURL


def test_the_fast_path_parses_every_url_as_w3lib_would(monkeypatch) -> None:
    """URLs that skip safe_url_string must come out as they would through it: 20,000
    generated from the characters around the fast path's edges, parsed both ways."""
    rng = random.Random(17)
    alphabet = string.ascii_letters + string.digits + "._~!$&'()*+,;=:@%/-?#[]{}|^`<> \\\"\u00e9"
    hosts = ["a.com", "A.com", "xn--bcher-kva.example", "127.0.0.1", "[::1]", "b\u00fccher.de", "a_b.test"]
    urls = []
    for _ in range(20_000):
        tail = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        port = rng.choice(["", ":8080", ":99999", ":"])
        urls.append(f"{rng.choice(['http', 'https', 'HTTP', 'ftp'])}://{rng.choice(hosts)}{port}/{tail}")
    fast = [url for url in urls if _ALREADY_SAFE.fullmatch(url)]
    assert len(fast) > 1000, "the generator must exercise the fast path"
    got = [_parsed(url) for url in fast]
    monkeypatch.setattr(urls_module, "_ALREADY_SAFE", re.compile(r"(?!)"))   # w3lib for all
    assert [_parsed(url) for url in fast] == got
    assert parse_url("http://a.com/x y").url == "http://a.com/x%20y"      # the slow path still quotes
    assert parse_url("http://a.com/p/1") is parse_url("http://a.com/p/1")   # cached


def test_connection_refuses_hostnames_so_no_second_lookup_can_happen(net) -> None:
    conn = GuardedHTTPConnection("localhost", 80)
    with pytest.raises(NewConnectionError, match="refusing to resolve"):
        conn.connect()
    assert net.lookups == [] and net.connects == []


def test_loopback_refused_without_allow_list(tmp_path, net) -> None:
    with LocalServer({"/": page(b"secret")}) as srv:
        f = fetcher(tmp_path, allow=())
        result = f.fetch(srv.url("/"))
        f.close()
        assert (result.kind, result.reason) == ("skipped", "private_address")
        assert srv.seen == [] and net.connects == []
        assert f.stats.get("netguard/refused/private_address") == 1
        assert f.stats.get("netguard/address_class_count/loopback") == 1


@pytest.mark.parametrize("location", [
    "http://10.0.0.1/", "http://169.254.169.254/latest/meta-data/", "http://[::ffff:10.0.0.1]/",
    "http://100.64.1.1/", "http://0.0.0.0/", "http://[fd00::1]/", "http://224.0.0.1/",
])
def test_redirect_to_private_address_refused_before_connecting(tmp_path, net, location: str) -> None:
    with LocalServer({"/go": redirect(location)}) as srv:
        f = fetcher(tmp_path)
        result = f.fetch(srv.url("/go"))
        f.close()
    assert (result.kind, result.reason, result.redirects) == ("skipped", "private_address", 1)
    assert result.final_url == location
    assert net.blocked == []                        # the fence never even saw an attempt
    assert all(ipaddress.ip_address(a[0]).is_loopback for a in net.connects)


def test_resolves_once_and_connects_to_the_checked_address(tmp_path, net, dns_server) -> None:
    """DNS rebinding, real DNS: one lookup per name, the connection goes to the checked IP;
    once the name points at a private address, a fresh fetcher refuses it without connecting."""
    with LocalServer({"/": page(b"hello")}) as srv:
        f = fetcher(tmp_path, dns_servers=[dns_server.server])
        result = f.fetch(f"http://rebind.test:{srv.port}/")
        again = f.fetch(f"http://rebind.test:{srv.port}/again")     # within the TTL: cached
        f.close()
        assert (result.kind, result.http_status, result.body) == ("response", 200, b"hello")
        assert again.kind == "response" and result.peer_ip == "127.0.0.1"
        assert dns_server.wait_queries("rebind.test", 1) == 1
        assert srv.seen[0].headers["Host"] == f"rebind.test:{srv.port}"
        dns_server.set("rebind.test", ["10.0.0.1"])
        fresh = fetcher(tmp_path, dns_servers=[dns_server.server])
        rebound = fresh.fetch(f"http://rebind.test:{srv.port}/")
        fresh.close()
        assert (rebound.kind, rebound.reason) == ("skipped", "private_address")
        assert "10.0.0.1" in rebound.error and len(srv.seen) == 2
    assert net.blocked == [] and net.lookups == []       # no system DNS, no stray connect
    assert all(ipaddress.ip_address(a[0]).is_loopback for a in net.connects)


def test_ipv6_literal_with_allow_list(tmp_path, net) -> None:
    with LocalServer({"/": page(b"six")}, bind="::1") as srv:
        refused = fetcher(tmp_path).fetch(srv.url("/"))          # ::1 is not in 127.0.0.0/8
        f = fetcher(tmp_path, allow=("::1/128",))
        ok = f.fetch(srv.url("/"))
        f.close()
        assert len(srv.seen) == 1 and srv.seen[0].headers["Host"] == f"[::1]:{srv.port}"
    assert (refused.kind, refused.reason) == ("skipped", "private_address")
    assert (ok.kind, ok.body, ok.peer_ip) == ("response", b"six", "::1")


def test_https_uses_hostname_for_sni_and_certificate(tmp_path, dns_server) -> None:
    pair = make_cert(str(tmp_path), "crawl.test")
    if pair is None:
        pytest.skip("openssl CLI not available")
    with LocalServer({"/": page(b"tls ok")}, tls=pair) as srv:
        f = fetcher(tmp_path, dns_servers=[dns_server.server], ca_certs=pair[0])
        ok = f.fetch(f"https://crawl.test:{srv.port}/")
        by_ip = f.fetch(f"https://127.0.0.1:{srv.port}/")     # cert names crawl.test, not the IP
        f.close()
    assert (ok.kind, ok.http_status, ok.body, ok.peer_ip) == ("response", 200, b"tls ok", "127.0.0.1")
    assert "crawl.test" in srv.sni
    assert (by_ip.kind, by_ip.reason) == ("error", "tls")


def test_guard_is_thread_safe_and_caches_dns(dns_server) -> None:
    """8 threads, then 2 more checks: real queries counted at the server."""
    guard = real_guard(dns_server)
    decisions: list = []
    threads = [threading.Thread(target=lambda: decisions.append(guard.check("http://a.test/")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    guard.check("http://a.test/x")
    calls = dns_server.wait_queries("a.test", 1)
    assert 1 <= calls <= 8 and guard.check("http://a.test/") and dns_server.queries("a.test") <= 8
    assert len(decisions) == 8 and all(isinstance(d, Target) and d.ip == "93.184.216.34" for d in decisions)
    guard.close()
