"""Fetcher against local servers: redirects, caps, bombs, deadlines, Retry-After, stats."""
from __future__ import annotations

import base64
import email.utils
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from crawld.config import FetchConfig
from crawld.fetch import Fetcher, FetchResult, classify_exception, parse_retry_after

try:
    from fetch_servers import (LocalServer, closed_port, drip_body, drip_headers, encoded,
                               forbid_external_network, gzip_bomb, gzip_zeros, page, raw_response,
                               redirect, truncated)
except ImportError:  # tests/ imported as a package
    from tests.fetch_servers import (LocalServer, closed_port, drip_body, drip_headers, encoded,
                                     forbid_external_network, gzip_bomb, gzip_zeros, page,
                                     raw_response, redirect, truncated)

MB = 1024 * 1024


@pytest.fixture(autouse=True)
def net(monkeypatch):
    return forbid_external_network(monkeypatch)


@pytest.fixture
def make(tmp_path):
    made: list[Fetcher] = []

    def build(run_dir: str = str(tmp_path), **overrides) -> Fetcher:
        kw = {k: overrides.pop(k) for k in ("politeness_wait_s", "stats") if k in overrides}
        cfg = FetchConfig(**{"allow_networks": ("127.0.0.0/8",), "obey_robots": False,
                             "timeout_s": 5.0, **overrides})
        made.append(Fetcher(cfg, pool_size=8, run_dir=run_dir, **kw))
        return made[-1]
    yield build
    for f in made:
        f.close()


# ----------------------------------------------------------------------------- basics
def test_plain_response_headers_and_content_type(make) -> None:
    with LocalServer({"/": page(b"<p>hi</p>", headers={"X-A": "1"})}) as srv:
        r = make().fetch(srv.url("/"))
        sent = srv.seen[0].headers
    assert (r.kind, r.http_status, r.body, r.redirects) == ("response", 200, b"<p>hi</p>", 0)
    assert r.final_url == r.url == srv.url("/") and r.chain == [srv.url("/")]
    assert r.content_type == "text/html; charset=utf-8" and r.headers["X-A"] == "1"
    assert sent["User-Agent"] == "crawld/0.1 (+contact URL)"
    assert "text/html" in sent["Accept"]
    assert {"gzip", "deflate", "br"} <= {e.strip() for e in sent["Accept-Encoding"].split(",")}


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_content_encodings_are_decoded(make, encoding: str) -> None:
    body = b"crawl " * 5000
    with LocalServer({"/": encoded(body, encoding)}) as srv:
        f = make()
        r = f.fetch(srv.url("/"))
    assert (r.kind, r.body) == ("response", body)
    assert f.stats.get("httpcompression/response_count") == 1


def test_http_errors_are_responses(make) -> None:
    with LocalServer({"/gone": page(b"x", 410), "/boom": page(b"x", 500)}) as srv:
        f = make()
        assert f.fetch(srv.url("/gone")).http_status == 410
        assert f.fetch(srv.url("/boom")).kind == "response"
        assert f.stats.get("downloader/response_status_count/410") == 1
        assert f.stats.get("downloader/response_status_count/500") == 1


# ----------------------------------------------------------------------------- redirects
def test_redirect_chain_records_final_url_and_length(make) -> None:
    routes = {"/r3": redirect("/r2", 301), "/r2": redirect("r1", 302), "/r1": redirect("/final?x=1", 307),
              "/final": page(b"end")}
    with LocalServer(routes) as srv:
        f = make()
        r = f.fetch(srv.url("/r3"))
    assert (r.kind, r.http_status, r.body, r.redirects) == ("response", 200, b"end", 3)
    assert r.url == srv.url("/r3") and r.final_url == srv.url("/final?x=1")
    assert r.chain == [srv.url(p) for p in ("/r3", "/r2", "/r1", "/final?x=1")]
    assert f.stats.get("downloader/response_status_count/307") == 1


def test_too_many_redirects(make) -> None:
    routes = {"/r3": redirect("/r2"), "/r2": redirect("/r1"), "/r1": redirect("/final"), "/final": page()}
    with LocalServer(routes) as srv:
        r = make(max_redirects=2).fetch(srv.url("/r3"))
        assert srv.hits("/final") == 0
    assert (r.kind, r.reason, r.redirects) == ("failed", "too_many_redirects", 2)
    assert "more than 2 redirects" in r.error


def test_redirect_loop_ends_with_a_clear_reason(make) -> None:
    routes = {"/a": redirect("/b"), "/b": redirect("/c"), "/c": redirect("/a"), "/self": redirect("/self")}
    with LocalServer(routes) as srv:
        f = make(max_redirects=20)
        loop = f.fetch(srv.url("/a"))
        own = f.fetch(srv.url("/self"))
        assert srv.hits("/a") == 1           # detected before asking again
    assert (loop.kind, loop.reason, loop.redirects) == ("failed", "redirect_loop", 2)
    assert loop.error.endswith("after 3 redirect(s)") and "redirects back to" in loop.error
    assert (own.kind, own.reason) == ("failed", "redirect_loop")


def test_redirect_without_location_is_a_response(make) -> None:
    with LocalServer({"/": page(b"", 302)}) as srv:
        r = make().fetch(srv.url("/"))
    assert (r.kind, r.http_status, r.redirects) == ("response", 302, 0)


def test_redirect_to_other_scheme_is_skipped(make) -> None:
    with LocalServer({"/": redirect("ftp://127.0.0.1/file")}) as srv:
        r = make().fetch(srv.url("/"))
    assert (r.kind, r.reason, r.redirects, r.final_url) == ("skipped", "scheme", 1, "ftp://127.0.0.1/file")


def test_credentials_dropped_on_origin_change(make) -> None:
    with LocalServer({"/end": page()}) as other:
        routes = {"/same": redirect("/cross"), "/cross": redirect(other.url("/end"))}
        with LocalServer(routes) as srv:
            r = make().fetch(f"http://user:p%40ss@127.0.0.1:{srv.port}/same")
            auths = [s.headers.get("Authorization") for s in srv.seen]
        assert r.redirects == 2 and r.http_status == 200
        expected = "Basic " + base64.b64encode(b"user:p@ss").decode()
        assert auths == [expected, expected]                     # same origin: kept
        assert "Authorization" not in other.seen[0].headers      # other port = other origin


# ----------------------------------------------------------------------------- size caps
def test_content_length_over_cap_rejected_without_reading(make) -> None:
    release, finished = threading.Event(), threading.Event()

    def announces_20mb(h) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(20 * MB))
        h.end_headers()
        h.wfile.write(b"x" * 1024)
        release.wait(30)            # would stall a reader that trusted the announced size
        finished.set()
    with LocalServer({"/": announces_20mb}) as srv:
        try:
            r = make(max_body_bytes=10 * MB).fetch(srv.url("/"))
            stalled_server_still_waiting = not finished.is_set()
        finally:
            release.set()
    assert (r.kind, r.reason, r.http_status) == ("failed", "too_large", 200)
    assert stalled_server_still_waiting and r.elapsed_s < 10.0   # did not wait for the body


def test_streamed_body_over_cap_is_cut(make) -> None:
    def chunked(h) -> None:
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for _ in range(64):
            h.wfile.write(b"4000\r\n" + b"y" * 0x4000 + b"\r\n")
        h.wfile.write(b"0\r\n\r\n")
    with LocalServer({"/": chunked, "/small": page(b"ok")}) as srv:
        f = make(max_body_bytes=100_000)
        big = f.fetch(srv.url("/"))
        small = f.fetch(srv.url("/small"))       # the pool did not keep a half-read connection
    assert (big.kind, big.reason) == ("failed", "too_large")
    assert (small.kind, small.body) == ("response", b"ok")


BOMB_CHILD = textwrap.dedent("""
    import json, sys, time
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    from crawld.config import FetchConfig
    from crawld.fetch import Fetcher
    url, cap, run_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    f = Fetcher(FetchConfig(max_body_bytes=cap, obey_robots=False, timeout_s=20,
                            allow_networks=("127.0.0.0/8",)), pool_size=2, run_dir=run_dir)
    try:    # reset the peak so VmHWM measures the fetch only (Linux >= 4.0)
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pass
    base = status("VmRSS")
    started = time.monotonic()
    r = f.fetch(url)
    print(json.dumps({"kind": r.kind, "reason": r.reason, "elapsed": time.monotonic() - started,
                      "base": base, "peak": status("VmHWM")}))
""")


def test_gzip_bomb_stopped_at_cap_with_bounded_memory(tmp_path) -> None:
    bomb = gzip_zeros(100 * 1000 * 1000)            # 100 MB decoded, ~100 KB on the wire
    with LocalServer({"/bomb": gzip_bomb(bomb)}) as srv:
        proc = subprocess.run([sys.executable, "-c", BOMB_CHILD, srv.url("/bomb"), str(10 * MB), str(tmp_path)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    growth = out["peak"] - out["base"]
    print(f"\ngzip bomb: {len(bomb)} B compressed -> 100 MB; cap 10 MiB; result {out['kind']}/{out['reason']} "
          f"in {out['elapsed']:.2f}s; peak RSS growth {growth / MB:.1f} MiB "
          f"(peak {out['peak'] / MB:.1f} MiB)")
    assert (out["kind"], out["reason"]) == ("failed", "too_large")
    assert growth < 60 * MB            # well below the 100 MB bomb: cap + one copy + buffers


# ----------------------------------------------------------------------------- deadlines
def test_slow_drip_body_stopped_by_total_deadline(make) -> None:
    with LocalServer({"/": drip_body(0.05)}) as srv:
        r = make(timeout_s=1.0).fetch(srv.url("/"))
    assert (r.kind, r.reason) == ("error", "timeout")
    # each recv was fast: only the total deadline fires (the whole drip would take 500 s)
    assert 0.9 < r.elapsed_s < 10.0, r.elapsed_s


def test_slow_drip_headers_stopped_by_total_deadline(make) -> None:
    with LocalServer({"/": drip_headers(0.05)}) as srv:
        f = make(timeout_s=1.0)
        r = f.fetch(srv.url("/"))
    assert (r.kind, r.reason) == ("error", "timeout") and r.elapsed_s < 10.0    # drip: 500 s


def test_read_timeout_and_connection_errors(make) -> None:
    release = threading.Event()

    def silent(h) -> None:
        release.wait(30)
    with LocalServer({"/": silent, "/cut": truncated(1000, b"partial")}) as srv:
        try:
            f = make(timeout_s=0.5)
            slow = f.fetch(srv.url("/"))
            answered_before_server = not release.is_set()
            cut = f.fetch(srv.url("/cut"))
        finally:
            release.set()
    refused = make().fetch(f"http://127.0.0.1:{closed_port()}/")
    assert (slow.kind, slow.reason) == ("error", "timeout") and answered_before_server
    assert 0.4 < slow.elapsed_s < 10.0          # the 0.5 s budget, not the 30 s silence
    assert (cut.kind, cut.reason) == ("error", "connection")
    assert (refused.kind, refused.reason) == ("error", "connection")


def test_undecodable_body_is_a_permanent_failure(make) -> None:
    with LocalServer({"/": page(b"this is not gzip", headers={"Content-Encoding": "gzip"})}) as srv:
        r = make().fetch(srv.url("/"))
    assert (r.kind, r.reason) == ("failed", "bad_encoding")


# ----------------------------------------------------------------------------- Retry-After
def test_parse_retry_after() -> None:
    now = time.time()
    assert parse_retry_after("120", 3600) == 120.0
    assert parse_retry_after(" 0 ", 3600) == 0.0
    assert parse_retry_after("999999", 3600) == 3600.0                # capped
    assert parse_retry_after("-5", 3600) == 0.0
    date = email.utils.formatdate(now + 90, usegmt=True)
    assert 88 <= parse_retry_after(date, 3600, now=now) <= 91
    past = email.utils.formatdate(now - 90, usegmt=True)
    assert parse_retry_after(past, 3600, now=now) == 0.0
    assert parse_retry_after("soon", 3600) is None
    assert parse_retry_after(None, 3600) is None and parse_retry_after("", 3600) is None
    assert parse_retry_after("nan", 3600) is None


def test_retry_after_recorded_for_429_and_503(make, tmp_path) -> None:
    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    routes = {"/429": page(b"", 429, {"Retry-After": "7"}), "/503": page(b"", 503, {"Retry-After": date}),
              "/500": page(b"", 500, {"Retry-After": "7"})}
    with LocalServer(routes) as srv:
        f = make(retry_after_max_s=20, politeness_wait_s=0.0)
        before = time.time()
        r429 = f.fetch(srv.url("/429"))
        # the host is now backing off: the next request waits, here with no patience at all
        waiting = f.fetch(srv.url("/500"))
        since_429 = time.time() - before
        assert srv.hits("/500") == 0
        # HTTP-date form, capped by retry_after_max_s (own run_dir: no back-off inherited)
        r503 = make(run_dir=str(tmp_path / "other"), retry_after_max_s=20).fetch(srv.url("/503"))
    assert (r429.kind, r429.http_status, r429.retry_after_s) == ("response", 429, 7.0)
    assert (waiting.kind, waiting.reason) == ("error", "politeness")
    assert 7 - since_429 <= waiting.retry_after_s <= 7     # what is left of the 7 s, however slow we were
    assert (r503.http_status, r503.retry_after_s) == (503, 20.0)


# ----------------------------------------------------------------------------- contract
@pytest.mark.parametrize("url", ["", "http://", "http://[::1", "http://x:bad/", "ht!tp://x/",
                                 "http://\x00/", "mailto:someone@example.com", "//no-scheme/x",
                                 "http://a..b/", "https://" + "a" * 300 + ".com/"])
def test_never_raises_on_bad_input(make, url: str) -> None:
    r = make().fetch(url)
    assert isinstance(r, FetchResult) and r.kind in ("skipped", "failed", "error")


def test_exception_classification() -> None:
    import ssl

    from urllib3.exceptions import (ConnectTimeoutError, DecodeError, NameResolutionError,
                                    NewConnectionError, ProtocolError, ProxyError, ReadTimeoutError,
                                    SSLError)
    assert classify_exception(NewConnectionError(None, "refused")) == ("error", "connection")
    assert classify_exception(ConnectTimeoutError("slow")) == ("error", "timeout")
    assert classify_exception(ReadTimeoutError(None, "/", "slow")) == ("error", "timeout")
    assert classify_exception(NameResolutionError("h", None, OSError())) == ("error", "dns")
    assert classify_exception(SSLError("bad cert")) == ("error", "tls")
    assert classify_exception(ssl.SSLCertVerificationError()) == ("error", "tls")
    assert classify_exception(ProxyError("p", OSError())) == ("error", "proxy")
    assert classify_exception(ProtocolError("reset")) == ("error", "connection")
    assert classify_exception(DecodeError("gzip")) == ("failed", "bad_encoding")


def test_scrapy_style_stats(make) -> None:
    routes = {"/": page(b"abc"), "/missing": page(b"", 404), "/r": redirect("/")}
    with LocalServer(routes) as srv:
        f = make()
        for path in ("/", "/missing", "/r"):
            f.fetch(srv.url(path))
        f.fetch(f"http://127.0.0.1:{closed_port()}/")
    s = f.stats.snapshot()
    assert s["downloader/request_count"] == 5 and s["downloader/request_method_count/GET"] == 5
    assert s["downloader/response_count"] == 4
    assert s["downloader/response_status_count/200"] == 2
    assert s["downloader/response_status_count/404"] == 1
    assert s["downloader/response_status_count/301"] == 1
    assert s["downloader/response_bytes"] == 6
    assert s["downloader/exception_type_count/urllib3.exceptions.NewConnectionError"] == 1
    assert s["fetch/result_count/response"] == 3 and s["fetch/reason_count/connection"] == 1


def test_stats_count_every_thread_without_a_lock() -> None:
    """Each thread writes its own table; readers sum them while the threads keep counting,
    and threads past MAX_THREAD_COUNTERS share one locked table (bounded memory)."""
    from crawld.stats import MAX_THREAD_COUNTERS, Stats
    stats = Stats()

    def count(key: str, n: int) -> None:
        for _ in range(n):
            stats.inc(key)
            stats.inc("bytes", 2)
    busy = [threading.Thread(target=count, args=("a", 5_000)) for _ in range(8)]
    for t in busy:
        t.start()
    while any(t.is_alive() for t in busy):
        assert stats.snapshot().get("bytes", 0) <= 2 * 40_000
    for t in busy:
        t.join()
    for _ in range(MAX_THREAD_COUNTERS + 50):
        t = threading.Thread(target=count, args=("b", 1))
        t.start()
        t.join()
    assert stats.snapshot() == {"a": 40_000, "b": MAX_THREAD_COUNTERS + 50,
                                "bytes": 2 * (40_000 + MAX_THREAD_COUNTERS + 50)}
    assert len(stats._tables) == MAX_THREAD_COUNTERS
    assert stats.get("a") == 40_000 and stats.get("missing", 7) == 7


def test_shared_fetcher_across_threads(make) -> None:
    from concurrent.futures import ThreadPoolExecutor
    with LocalServer({"*": page(b"x" * 1000)}) as srv:
        f = make(per_host_concurrency=8)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(f.fetch, [srv.url(f"/p{i}") for i in range(200)]))
    assert all(r.kind == "response" and r.body == b"x" * 1000 for r in results)


# ----------------------------------------------------------------------------- response heads
HEAD_NAMES = ["Content-Type", "X-A", "set-cookie", "Set-Cookie", "x~!#$%&'*+-.^_`|", "Bad Name",
              "", "From ", "X:Y", "\u00e9t\u00e9", "X-Long" * 40]
HEAD_VALUE_CHARS = "ab; =,/\"\t \x85\x0b\x0c\x1c\x1d\x1e\r\n\x00\xe9\xff:"


def _random_head(rng) -> bytes:
    """A response head as a server might send it: mostly plain, sometimes folded, odd
    names, line breaks that only str.splitlines() sees, bare LF, a missing terminator."""
    lines = []
    for _ in range(rng.randrange(0, 8)):
        name = rng.choice(HEAD_NAMES)
        plain = rng.random() < 0.6
        chars = "abc; =,/" if plain else HEAD_VALUE_CHARS
        value = "".join(rng.choice(chars) for _ in range(rng.randrange(0, 12)))
        gap = rng.choice([" ", "", "  ", "\t", " \t"])
        eol = "\r\n" if plain or rng.random() < 0.8 else "\n"
        lines.append(f"{name}:{gap}{value}{eol}")
        if not plain and rng.random() < 0.1:
            lines.append(f" folded {value}\r\n")
    end = rng.choice(["\r\n"] * 8 + ["\n", ""])
    return ("".join(lines) + end).encode("latin-1")


def _state(msg) -> dict:  # type: ignore[no-untyped-def]
    # defects are exceptions, equal only to themselves: compare what they say
    return {**vars(msg), "defects": [repr(d) for d in msg.defects], "class": type(msg)}


def test_fast_head_parser_matches_the_email_parser() -> None:
    """Differential: every generated head gives the same HTTPMessage (all its state) from
    our parse_headers as from http.client's, and most plain ones take the fast path."""
    import http.client
    import io
    import random

    from crawld.fetch import responses
    rng = random.Random(17)
    fast = 0
    for _ in range(20_000):
        head = _random_head(rng)
        ours = responses.parse_headers(io.BytesIO(head + b"body"))
        theirs = http.client.parse_headers(io.BytesIO(head + b"body"))
        assert _state(ours) == _state(theirs), head
        fast += responses._PLAIN_HEAD.fullmatch(head.decode("latin-1")) is not None
    assert 2_000 < fast < 18_000, "both paths exercised"


def test_plain_and_folded_heads_over_a_real_socket(make, monkeypatch) -> None:
    """Only the plain head skips the email parser; both read the same as the stdlib would."""
    import email.parser
    parsed = []

    class CountingParser(email.parser.Parser):
        def parsestr(self, text, headersonly=False):  # type: ignore[no-untyped-def]
            if "User-Agent" not in text:    # not the test server reading our request
                parsed.append(text)
            return super().parsestr(text, headersonly)
    monkeypatch.setattr(email.parser, "Parser", CountingParser)
    # Connection: close, as the server hangs up: a pooled connection could be reused before
    # its FIN arrived, and the second fetch would then fail on a dead socket
    plain = (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nX-A:  one  \r\nX-A: two\r\n"
             b"Content-Length: 2\r\nConnection: close\r\n")
    folded = (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nX-B: one\r\n  two\r\n"
              b"Content-Length: 2\r\nConnection: close\r\n")
    with LocalServer({"/plain": raw_response(plain, b"hi"), "/folded": raw_response(folded, b"hi")}) as srv:
        f = make()
        r_plain = f.fetch(srv.url("/plain"))
        assert parsed == []
        r_folded = f.fetch(srv.url("/folded"))
        assert len(parsed) == 1
    assert (r_plain.kind, r_plain.body, r_folded.kind, r_folded.body) == ("response", b"hi", "response", b"hi")
    assert r_plain.hops[-1].response_headers == [("Content-Type", "text/html"), ("X-A", "one  "),
                                                 ("X-A", "two"), ("Content-Length", "2"),
                                                 ("Connection", "close")]
    assert r_plain.headers["X-A"] == "one  , two"
    assert r_folded.headers["X-B"] == "one\r\n  two"


def test_pools_found_by_target_and_replaced_when_closed() -> None:
    from crawld.fetch.netguard import Target
    from crawld.fetch.pools import GuardedPools, num_pools
    pools = GuardedPools(4)
    a = Target("http://a.test/", "http", "a.test", 80, "127.0.0.1", "/")
    b = Target("https://b.test/", "https", "b.test", 443, "127.0.0.1", "/")
    pool_a, pool_b = pools.get(a), pools.get(b)
    assert pools.get(a) is pool_a and pool_a is not pool_b
    assert (pool_a.host, pool_b.host, pool_b.conn_kw.get("server_hostname")) == ("127.0.0.1", "127.0.0.1", "b.test")
    pools.manager.clear()   # the manager forgets it (its LRU evicting it)...
    pool_a.close()          # ...and closes it (as urllib3 1.x did on eviction)
    assert pools.get(a) is not pool_a and pools.get(a).pool is not None
    for i in range(3 * num_pools(4)):
        pools.get(Target(f"http://h{i}.test/", "http", f"h{i}.test", 80, f"127.0.1.{i % 250}", "/"))
    assert len(pools._pools) <= 2 * num_pools(4)
    pools.clear()
    assert pools._pools == {}
