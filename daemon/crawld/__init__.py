"""crawld: a Celery-free distributed crawl fetch-worker daemon."""
__version__ = "0.1.0"
