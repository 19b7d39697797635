"""Hooks the crawl tests load into real workers (tests/ is put on their PYTHONPATH)."""
from __future__ import annotations

from crawld.hooks import Page


def explode_on_boom(page: Page) -> list[str]:
    """Raises on every page whose URL has ``boom`` in it; finds nothing on the others."""
    if "boom" in page.url:
        raise RuntimeError(f"hook exploded on {page.url}")
    return []


NOT_CALLABLE = 42
