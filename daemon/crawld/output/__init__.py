"""Output formats for fetched pages (WARC files)."""
