"""Fetching one URL safely: SSRF guard, robots.txt, politeness, bounded body and time.

The public API; the modules behind it are split by concern (see fetcher.py's docstring).
"""
from crawld.fetch.fetcher import Fetcher, FetchResult
from crawld.fetch.reasons import Kind, Reason
from crawld.fetch.responses import classify_exception, parse_retry_after

__all__ = ["Fetcher", "FetchResult", "Kind", "Reason", "classify_exception", "parse_retry_after"]
