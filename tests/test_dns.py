"""The guard's resolver against a real DNS server (dnsmasq on 127.0.0.1): TTLs, /etc/hosts,
unreachable servers, ``fetch.dns_servers``. Addresses in answers are only classified here,
never connected to."""
from __future__ import annotations

import socket
import time

import pytest

from crawld.config import ConfigError, FetchConfig, load_config
from crawld.fetch import Fetcher
from crawld.fetch.netguard import NetGuard, Refusal, Target
from crawld.fetch.resolver import DnsResolver, HostsFile, ResolveError, parse_nameserver
from crawld.pipeline.classify import Verdict, classify

try:
    from dns_server import RECORDS, start_or_skip
    from fetch_servers import closed_port, forbid_external_network
except ImportError:  # tests/ imported as a package
    from tests.dns_server import RECORDS, start_or_skip
    from tests.fetch_servers import closed_port, forbid_external_network


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory):
    server = start_or_skip(str(tmp_path_factory.mktemp("dns")), RECORDS)      # TTL 3600 s
    yield server
    server.__exit__()


@pytest.fixture(autouse=True)
def net(monkeypatch):
    return forbid_external_network(monkeypatch)


@pytest.fixture
def silent_server():
    """A UDP port on 127.0.0.1 that receives queries and never answers: a dead DNS server."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


# ----------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("entry, expected", [
    ("127.0.0.1", ("127.0.0.1", 53)), ("127.0.0.1:5353", ("127.0.0.1", 5353)),
    ("::1", ("::1", 53)), ("[::1]:5353", ("::1", 5353)), ("[fd00::53]", ("fd00::53", 53)),
    (" 9.9.9.9 ", ("9.9.9.9", 53)),
])
def test_parse_nameserver(entry: str, expected: tuple[str, int]) -> None:
    assert parse_nameserver(entry) == expected


@pytest.mark.parametrize("entry", ["dns.example", "127.0.0.1:0", "127.0.0.1:99999", "1.2.3.4:x", "", "[::1]:"])
def test_parse_nameserver_rejects(entry: str) -> None:
    with pytest.raises(ValueError):
        parse_nameserver(entry)


def test_config_key_and_its_validation(tmp_path) -> None:
    assert FetchConfig().dns_servers == ()
    cfg = load_config(None, env={"CRAWLD_FETCH_DNS_SERVERS": "127.0.0.1:5353,::1"})
    assert cfg.fetch.dns_servers == ("127.0.0.1:5353", "::1")
    path = tmp_path / "c.toml"
    path.write_text('[fetch]\ndns_servers = ["resolver.example"]\n')
    with pytest.raises(ConfigError, match="fetch.dns_servers"):
        load_config(str(path), env={})


def test_hosts_file_names_and_reload(tmp_path) -> None:
    path = tmp_path / "hosts"
    path.write_text("127.0.0.1 localhost Box.LAN.  # the box\n# 10.0.0.1 commented.test\n::1 ip6-localhost\n")
    hosts = HostsFile(str(path))
    assert "localhost" in hosts and "box.lan" in hosts and "ip6-localhost" in hosts
    assert "commented.test" not in hosts and "the" not in hosts
    path.write_text("127.0.0.1 other\n")
    assert "other" in hosts and "localhost" not in hosts      # re-read when the file changes
    assert "x" not in HostsFile(str(tmp_path / "missing"))


# ----------------------------------------------------------------------------- /etc/hosts
def test_hosts_file_names_use_the_system_resolver_not_dns(dns_server, net) -> None:
    """``localhost`` is answered by getaddrinfo (/etc/hosts) exactly as before, never asked of DNS."""
    resolver = DnsResolver([dns_server.server])
    assert "localhost" in resolver.hosts
    answer = resolver("localhost")
    assert answer and all(a in ("127.0.0.1", "::1") for a in answer)
    assert net.lookups == ["localhost"] and net.datagrams == []
    assert dns_server.queries("localhost") == 0
    decision = NetGuard(resolver=resolver).check("http://localhost/")
    assert isinstance(decision, Refusal) and decision.reason == "private_address"


# ----------------------------------------------------------------------------- TTL
def test_answer_is_cached_within_its_ttl(dns_server) -> None:
    guard = NetGuard(resolver=DnsResolver([dns_server.server]))
    first = guard.check("http://long.test/")
    dns_server.set("long.test", ["93.184.216.35"])       # TTL 3600 s: the old answer stands
    second = guard.check("http://long.test/")
    guard.close()
    assert isinstance(first, Target) and isinstance(second, Target)
    assert first.ip == second.ip == "93.184.216.34"
    assert dns_server.wait_queries("long.test", 1) == 1


def test_short_ttl_is_re_resolved_after_it_expires(tmp_path) -> None:
    server = start_or_skip(str(tmp_path / "dns"), {"short.test": ["93.184.216.34"]}, ttl_s=1)
    try:
        guard = NetGuard(resolver=DnsResolver([server.server]))
        first = guard.check("http://short.test/")
        server.set("short.test", ["93.184.216.35"])
        time.sleep(1.3)                                   # past the 1 s TTL
        second = guard.check("http://short.test/")
        guard.close()
        assert isinstance(first, Target) and isinstance(second, Target)
        assert (first.ip, second.ip) == ("93.184.216.34", "93.184.216.35")
        assert server.wait_queries("short.test", 2) == 2
    finally:
        server.__exit__()


def test_long_ttl_is_capped_by_max_ttl(dns_server) -> None:
    resolver = DnsResolver([dns_server.server], max_ttl_s=0.3)
    before = dns_server.queries("a.test")
    resolver("a.test")
    resolver("a.test")                                     # cached
    time.sleep(0.5)
    resolver("a.test")                                     # the cap expired, TTL 3600 did not
    assert dns_server.wait_queries("a.test", before + 2) == before + 2



def test_guard_answers_a_fresh_name_from_the_cache_without_a_lookup(dns_server) -> None:
    """Every fetch of a known site would otherwise hand its lookup to a DNS thread."""
    calls = []

    class Counting(DnsResolver):
        def __call__(self, host: str) -> list[str]:
            calls.append(host)
            return super().__call__(host)
    resolver = Counting([dns_server.server], max_ttl_s=0.3)
    guard = NetGuard(resolver=resolver)
    targets = [guard.check(f"http://a.test/p/{i}") for i in range(3)]
    assert all(isinstance(t, Target) for t in targets) and len({t.ip for t in targets}) == 1
    assert calls == ["a.test"]
    time.sleep(0.4)                                        # past the 0.3 s cap
    assert resolver.cached("a.test") is None
    assert isinstance(guard.check("http://a.test/"), Target)
    assert calls == ["a.test", "a.test"]
    guard.close()

# ----------------------------------------------------------------------------- failures
@pytest.mark.parametrize("which", ["silent", "closed"])
def test_unreachable_dns_server_is_a_transient_dns_error(silent_server, which: str, net, tmp_path) -> None:
    """Same kind/reason as any DNS failure (error/dns -> retried), not a crash or a skip."""
    server = silent_server if which == "silent" else f"127.0.0.1:{closed_port()}"
    with pytest.raises(ResolveError):
        DnsResolver([server], timeout_s=0.3)("example.test")
    guard = NetGuard(resolver=DnsResolver([server], timeout_s=0.3), dns_timeout_s=0.3)
    started = time.monotonic()
    decision = guard.check("http://example.test/")
    guard.close()
    assert isinstance(decision, Refusal) and (decision.kind, decision.reason) == ("error", "dns")
    assert time.monotonic() - started < 10          # bounded by the lookup timeout, generously
    cfg = FetchConfig(dns_servers=(server,), connect_timeout_s=0.3, obey_robots=False, timeout_s=5)
    f = Fetcher(cfg, pool_size=2, run_dir=str(tmp_path))
    result = f.fetch("http://example.test/")
    f.close()
    assert (result.kind, result.reason) == ("error", "dns")
    assert classify(result, 1, 5, (5.0,)).verdict is Verdict.RETRY
    assert net.blocked == [] and net.connects == [] and net.lookups == []


def test_fetcher_uses_configured_dns_servers(dns_server, tmp_path) -> None:
    f = Fetcher(FetchConfig(dns_servers=(dns_server.server,), obey_robots=False), pool_size=2,
                run_dir=str(tmp_path))
    result = f.fetch("http://meta.test/latest/meta-data/")
    f.close()
    assert (result.kind, result.reason) == ("skipped", "private_address")
    assert "169.254.169.254" in result.error and dns_server.queries("meta.test") >= 1
