"""NATS JetStream transport: topology, connection, consumer + settling, publisher, status."""
from crawld.transports.base import TopologyError
from crawld.transports.jetstream.connection import RETRYABLE, open_connection
from crawld.transports.jetstream.consumer import JetStreamTransport
from crawld.transports.jetstream.leases import BUCKET as SHARD_BUCKET
from crawld.transports.jetstream.publisher import JetStreamPublisher
from crawld.transports.jetstream.stats import jetstream_stats
from crawld.transports.jetstream.topology import (DEAD_FILTER, DEAD_PREFIX, DEAD_STREAM, MSG_ID_HEADER,
                                                  SHARD_FILTER, SHARD_PREFIX, STREAM, WORK_FILTER,
                                                  WORK_PREFIX, consumer_config, dead_stream_config,
                                                  dead_subject, max_ack_pending, shard_consumer_name,
                                                  shard_subject, work_stream_config, work_subject)

__all__ = ["DEAD_FILTER", "DEAD_PREFIX", "DEAD_STREAM", "MSG_ID_HEADER", "RETRYABLE", "SHARD_BUCKET",
           "SHARD_FILTER", "SHARD_PREFIX", "STREAM", "WORK_FILTER", "WORK_PREFIX", "JetStreamPublisher",
           "JetStreamTransport", "TopologyError",
           "consumer_config", "dead_stream_config", "dead_subject", "jetstream_stats",
           "max_ack_pending", "open_connection", "shard_consumer_name", "shard_subject",
           "work_stream_config", "work_subject"]
