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
                               forbid_external_network, gzip_bomb, gzip_zeros, page, redirect,
                               truncated)
except ImportError:  # tests/ imported as a package
    from tests.fetch_servers import (LocalServer, closed_port, drip_body, drip_headers, encoded,
                                     forbid_external_network, gzip_bomb, gzip_zeros, page, redirect,
                                     truncated)

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


def test_shared_fetcher_across_threads(make) -> None:
    from concurrent.futures import ThreadPoolExecutor
    with LocalServer({"*": page(b"x" * 1000)}) as srv:
        f = make(per_host_concurrency=8)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(f.fetch, [srv.url(f"/p{i}") for i in range(200)]))
    assert all(r.kind == "response" and r.body == b"x" * 1000 for r in results)
