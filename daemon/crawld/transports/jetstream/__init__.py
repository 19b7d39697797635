from crawld.transports.jetstream.core import *  # noqa: F401,F403  (split in progress)
