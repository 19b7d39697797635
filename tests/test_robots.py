"""robots.txt: RFC 9309 outcomes (200/4xx/5xx/timeout), caching, UA token, 500 KiB, hops."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from crawld.config import FetchConfig
from crawld.fetch import Fetcher
from protego import Protego

from crawld.fetch.robots import MAX_ROBOTS_BYTES, RobotsCache, allows_all, user_agent_token

try:
    from fetch_servers import (LocalServer, forbid_external_network, page, redirect, robots,
                               sequence)
except ImportError:  # tests/ imported as a package
    from tests.fetch_servers import (LocalServer, forbid_external_network, page, redirect, robots,
                                     sequence)

RULES = "User-agent: *\nDisallow: /private\n"


@pytest.fixture(autouse=True)
def net(monkeypatch):
    return forbid_external_network(monkeypatch)


@pytest.fixture
def make(tmp_path):
    made: list[Fetcher] = []

    def build(robots_error_ttl_s: float = 30.0, **overrides) -> Fetcher:
        cfg = FetchConfig(**{"allow_networks": ("127.0.0.0/8",), "timeout_s": 2.0, **overrides})
        made.append(Fetcher(cfg, pool_size=4, run_dir=str(tmp_path), robots_error_ttl_s=robots_error_ttl_s))
        return made[-1]
    yield build
    for f in made:
        f.close()


def test_user_agent_token() -> None:
    assert user_agent_token("crawld/0.1 (+contact URL)") == "crawld"
    assert user_agent_token("MyBot") == "MyBot"
    assert user_agent_token("  ") == "*"


def test_200_rules_apply_and_are_cached(make) -> None:
    with LocalServer({"/robots.txt": robots(RULES)}) as srv:
        f = make()
        blocked = f.fetch(srv.url("/private/x"))
        allowed = [f.fetch(srv.url(f"/public/{i}")) for i in range(3)]
        assert srv.hits("/robots.txt") == 1 and srv.hits("/private/x") == 0
    assert (blocked.kind, blocked.reason, blocked.http_status) == ("skipped", "robots", None)
    assert all(r.kind == "response" for r in allowed)
    assert f.stats.get("robotstxt/forbidden") == 1
    assert f.stats.get("robotstxt/response_status_count/200") == 1


def test_rules_for_our_token(make) -> None:
    text = "User-agent: otherbot\nDisallow: /\n\nUser-agent: crawld\nDisallow: /mine\n"
    with LocalServer({"/robots.txt": robots(text)}) as srv:
        f = make()
        assert f.fetch(srv.url("/mine")).reason == "robots"
        assert f.fetch(srv.url("/other")).kind == "response"


@pytest.mark.parametrize("status", [404, 401, 403, 410])
def test_4xx_means_allow_all(make, status: int) -> None:
    with LocalServer({"/robots.txt": page(b"nope", status)}) as srv:
        r = make().fetch(srv.url("/private"))
    assert (r.kind, r.http_status) == ("response", 200)


@pytest.mark.parametrize("status", [500, 503, 429])
def test_5xx_and_429_mean_disallow_for_now(make, status: int) -> None:
    with LocalServer({"/robots.txt": page(b"down", status)}) as srv:
        f = make()
        first = f.fetch(srv.url("/page"))
        second = f.fetch(srv.url("/page"))
        assert srv.hits("/page") == 0
        assert srv.hits("/robots.txt") == 1          # the failure is cached for error_ttl_s
    assert (first.kind, first.reason) == ("error", "robots_unavailable")
    assert str(status) in first.error
    assert second.reason == "robots_unavailable"
    assert f.stats.get("robotstxt/unreachable") == 1


def test_unreachable_robots_is_asked_again_later(make) -> None:
    routes = {"/robots.txt": sequence(page(b"", 500), robots(RULES))}
    with LocalServer(routes) as srv:
        f = make(robots_error_ttl_s=0.2)
        first = f.fetch(srv.url("/page"))
        time.sleep(0.3)
        second = f.fetch(srv.url("/page"))
        assert srv.hits("/robots.txt") == 2
    assert first.reason == "robots_unavailable" and (second.kind, second.http_status) == ("response", 200)


def test_network_back_forgets_robots_failures_at_once(make) -> None:
    """After a pause on this host's network, the robots.txt failures met during the outage
    were the network's: the next page asks again instead of failing (and spending an
    attempt) until error_ttl_s runs out. Rules and 4xx answers are kept."""
    routes = {"/robots.txt": sequence(page(b"", 500), robots(RULES))}
    with LocalServer(routes) as srv, LocalServer({"/robots.txt": page(b"", 404)}) as other:
        f = make()
        assert f.fetch(srv.url("/page")).reason == "robots_unavailable"
        assert f.fetch(other.url("/page")).kind == "response"
        assert f.network_back() == 1
        assert (f.fetch(srv.url("/page")).kind, srv.hits("/robots.txt")) == ("response", 2)
        assert f.network_back() == 0 and other.hits("/robots.txt") == 1


def test_robots_timeout_means_unavailable(make) -> None:
    release = threading.Event()

    def stalls(h) -> None:
        release.wait(30)
        robots("User-agent: *\nAllow: /\n")(h)
    with LocalServer({"/robots.txt": stalls}) as srv:
        try:
            f = make(timeout_s=0.5)
            r = f.fetch(srv.url("/page"))
            answered_before_robots = not release.is_set()
        finally:
            release.set()
        assert srv.hits("/page") == 0
    assert (r.kind, r.reason) == ("error", "robots_unavailable")
    assert "timeout" in r.error and answered_before_robots and r.elapsed_s < 10.0


def test_robots_connection_error_means_unavailable(make) -> None:
    def hang_up(h) -> None:
        h.close_connection = True
        h.connection.shutdown(2)
    with LocalServer({"/robots.txt": hang_up}) as srv:
        r = make().fetch(srv.url("/page"))
        assert srv.hits("/page") == 0
    assert r.reason == "robots_unavailable"


def test_robots_redirects_are_followed(make) -> None:
    routes = {"/robots.txt": redirect("/real-robots.txt"), "/real-robots.txt": robots(RULES)}
    with LocalServer(routes) as srv:
        r = make().fetch(srv.url("/private"))
    assert r.reason == "robots"


def test_robots_redirect_to_private_address_means_unavailable(make) -> None:
    with LocalServer({"/robots.txt": redirect("http://10.0.0.1/robots.txt")}) as srv:
        r = make().fetch(srv.url("/private"))
    assert (r.kind, r.http_status) == ("response", 200)


def test_only_first_500_kib_parsed(make) -> None:
    filler = "# " + "x" * 98 + "\n"
    text = "User-agent: *\nDisallow: /early\n" + filler * (MAX_ROBOTS_BYTES // len(filler) + 10) + "Disallow: /late\n"
    assert len(text) > MAX_ROBOTS_BYTES
    with LocalServer({"/robots.txt": robots(text)}) as srv:
        f = make()
        assert f.fetch(srv.url("/early")).reason == "robots"
        assert f.fetch(srv.url("/late")).kind == "response"


def test_every_redirect_hop_is_checked_against_robots(make) -> None:
    with LocalServer({"/robots.txt": robots(RULES), "/go": redirect("/private/secret")}) as srv:
        r = make().fetch(srv.url("/go"))
        assert srv.hits("/private/secret") == 0
    assert (r.kind, r.reason, r.redirects) == ("skipped", "robots", 1)


def test_obey_robots_false_never_asks(make) -> None:
    with LocalServer({"/robots.txt": robots("User-agent: *\nDisallow: /\n")}) as srv:
        r = make(obey_robots=False).fetch(srv.url("/anything"))
        assert srv.hits("/robots.txt") == 0
    assert r.kind == "response"


def test_robots_for_private_origin_never_fetched(make) -> None:
    with LocalServer({"/robots.txt": robots(RULES)}) as srv:
        r = make(allow_networks=()).fetch(srv.url("/"))
        assert srv.seen == []
    assert r.reason == "private_address"


# ----------------------------------------------------------------------------- unit level
def fake_result(kind: str = "response", status: int | None = 200, body: bytes = b"",
                reason: str = "", error: str = "") -> SimpleNamespace:
    return SimpleNamespace(kind=kind, http_status=status, body=body, reason=reason, error=error)


def test_cache_ttl_is_capped_at_24h_and_one_fetch_per_origin() -> None:
    calls: list[str] = []
    gate = threading.Event()

    def fetch(url: str, deadline: float) -> SimpleNamespace:
        calls.append(url)
        gate.wait(2)
        return fake_result(body=b"User-agent: *\nDisallow: /x\nCrawl-delay: 2\n")
    cache = RobotsCache("crawld/1.0", fetch, ttl_s=10 * 86400)
    assert cache.ttl_s == 86400
    verdicts: list = []
    threads = [threading.Thread(target=lambda: verdicts.append(
        cache.check("http://a.test", "http://a.test/x", time.monotonic() + 5))) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gate.set()
    for t in threads:
        t.join()
    assert calls == ["http://a.test/robots.txt"]
    assert [v.allowed for v in verdicts] == [False] * 6
    assert cache.crawl_delay("http://a.test") == 2.0


@pytest.mark.parametrize("result, allowed, unreachable", [
    (fake_result(status=404), True, False),
    (fake_result(status=418), True, False),
    (fake_result(status=429), False, True),
    (fake_result(status=502), False, True),
    (fake_result("error", None, reason="timeout"), False, True),
    (fake_result("error", None, reason="dns"), False, True),
    (fake_result("failed", None, reason="too_many_redirects"), True, False),
    (fake_result("failed", None, reason="redirect_loop"), True, False),
    (fake_result("skipped", None, reason="private_address"), True, False),
    (fake_result("failed", None, reason="bad_encoding"), False, True),
])
def test_rfc9309_outcomes(result, allowed: bool, unreachable: bool) -> None:
    cache = RobotsCache("crawld", lambda url, deadline: result)
    verdict = cache.check("http://a.test", "http://a.test/page", time.monotonic() + 1)
    assert (verdict.allowed, verdict.unreachable) == (allowed, unreachable)


def test_our_own_politeness_wait_is_not_cached_as_unreachable() -> None:
    calls: list[str] = []

    def fetch(url: str, deadline: float) -> SimpleNamespace:
        calls.append(url)
        return fake_result("error", None, reason="politeness", error="no slot")
    cache = RobotsCache("crawld", fetch)
    for _ in range(2):
        verdict = cache.check("http://a.test", "http://a.test/", time.monotonic() + 1)
        assert (verdict.unreachable, verdict.reason) == (True, "politeness")
    assert len(calls) == 2 and cache.stats.get("robotstxt/unreachable") == 0


def test_request_rate_becomes_a_delay() -> None:
    cache = RobotsCache("crawld", lambda u, d: fake_result(body=b"User-agent: *\nRequest-rate: 1/5s\n"))
    assert cache.check("http://a.test", "http://a.test/", time.monotonic() + 1).crawl_delay_s == 5.0


def test_waiter_gives_up_at_its_deadline() -> None:
    release = threading.Event()

    fetching = threading.Event()

    def fetch(url: str, deadline: float) -> SimpleNamespace:
        fetching.set()
        release.wait(30)
        return fake_result(status=404)
    cache = RobotsCache("crawld", fetch)
    first = threading.Thread(target=cache.check, args=("http://a.test", "http://a.test/", time.monotonic() + 60))
    first.start()
    try:
        assert fetching.wait(10)
        started = time.monotonic()
        verdict = cache.check("http://a.test", "http://a.test/", time.monotonic() + 0.2)
        elapsed = time.monotonic() - started
        assert verdict.unreachable and first.is_alive()      # gave up while the fetch still ran
        assert 0.15 < elapsed < 10
    finally:
        release.set()
        first.join()


@pytest.mark.parametrize("text, expected", [
    ("User-agent: *\nAllow: /\n", True),
    ("User-agent: *\nDisallow:\n", True),
    ("", True),
    ("User-agent: otherbot\nDisallow: /\n", True),            # no group applies to crawld
    ("User-agent: *\nDisallow: /private/\n", False),
    ("User-agent: *\nAllow: /\nUser-agent: crawld\nDisallow: /x\n", False),
    ("User-agent: *\nDisallow: /*.pdf$\n", False),
])
def test_allows_all_is_only_claimed_when_no_rule_disallows(text: str, expected: bool) -> None:
    """The shortcut that skips matching each URL must agree with Protego on every URL."""
    parser = Protego.parse(text)
    assert allows_all(parser, "crawld") is expected
    urls = ["http://a.test/", "http://a.test/private/x", "http://a.test/x", "http://a.test/f.pdf"]
    if expected:
        assert all(parser.can_fetch(url, "crawld") for url in urls)
    else:
        assert not all(parser.can_fetch(url, "crawld") for url in urls)
