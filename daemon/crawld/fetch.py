"""HTTP fetching (first cut): one shared urllib3 PoolManager per worker process.

Contract used by the worker (keep it stable):
    fetcher = Fetcher(cfg.fetch, pool_size=threads, run_dir=...)
    result: FetchResult = fetcher.fetch(url)      # never raises for network problems
    fetcher.close()

``FetchResult.kind`` is one of:
    "response" -- an HTTP response was received (any status); redirects already followed
    "skipped"  -- policy refused it (reason: robots, scheme, private_address, out_of_scope)
    "error"    -- transient: timeout, connection, dns, tls, proxy, robots_unavailable, politeness
    "failed"   -- permanent, not HTTP: too_large, redirect_loop, too_many_redirects, bad_url
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import urllib3

from .config import FetchConfig


@dataclass
class FetchResult:
    kind: str
    url: str
    final_url: str = ""
    http_status: int | None = None
    reason: str = ""
    error: str = ""
    content_type: str = ""
    body: bytes = b""
    redirects: int = 0
    retry_after_s: float | None = None
    elapsed_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


class Fetcher:
    def __init__(self, cfg: FetchConfig, pool_size: int = 16, run_dir: str = "") -> None:
        self.cfg = cfg
        self.pool = urllib3.PoolManager(num_pools=64, maxsize=pool_size, block=False,
                                        retries=False)

    def fetch(self, url: str) -> FetchResult:
        started = time.monotonic()
        if not url.startswith(("http://", "https://")):
            return FetchResult("skipped", url, reason="scheme", error="not http(s)")
        try:
            resp = self.pool.request(
                "GET", url, preload_content=False, redirect=True,
                retries=urllib3.Retry(total=False, redirect=self.cfg.max_redirects, raise_on_redirect=False),
                timeout=urllib3.Timeout(connect=self.cfg.connect_timeout_s, read=self.cfg.timeout_s),
                headers={"User-Agent": self.cfg.user_agent})
            body = resp.read(self.cfg.max_body_bytes + 1, decode_content=True)
            resp.release_conn()
        except urllib3.exceptions.TimeoutError as exc:
            return FetchResult("error", url, reason="timeout", error=str(exc),
                               elapsed_s=time.monotonic() - started)
        except urllib3.exceptions.HTTPError as exc:
            return FetchResult("error", url, reason="connection", error=str(exc),
                               elapsed_s=time.monotonic() - started)
        if len(body) > self.cfg.max_body_bytes:
            return FetchResult("failed", url, reason="too_large", http_status=resp.status,
                               elapsed_s=time.monotonic() - started)
        final_url = resp.geturl() or url
        return FetchResult("response", url, final_url=final_url, http_status=resp.status,
                           content_type=resp.headers.get("Content-Type", ""), body=body,
                           redirects=len(resp.retries.history) if resp.retries else 0,
                           retry_after_s=_retry_after(resp.headers.get("Retry-After")),
                           elapsed_s=time.monotonic() - started)

    def close(self) -> None:
        self.pool.clear()


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
