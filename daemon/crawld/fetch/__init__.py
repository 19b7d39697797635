from crawld.fetch.fetcher import *  # noqa: F401,F403  (split in progress)
