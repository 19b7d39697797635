from crawld.transports.amqp.core import *  # noqa: F401,F403  (split in progress)
