from crawld.store.base import *  # noqa: F401,F403  (split in progress)
