"""RabbitMQ transport: topology, connection, consumer, publisher, status numbers."""
from crawld.transports.amqp.connection import (CONNECTION_ERRORS, connect_with_backoff,
                                               connection_parameters, message_properties)
from crawld.transports.amqp.consumer import AmqpTransport
from crawld.transports.amqp.publisher import AmqpPublisher
from crawld.transports.amqp.stats import amqp_stats
from crawld.transports.amqp.topology import (dead_queue_name, declare_topology, retry_queue_name,
                                             topology, work_queue_arguments)

__all__ = ["CONNECTION_ERRORS", "AmqpPublisher", "AmqpTransport", "amqp_stats",
           "connect_with_backoff", "connection_parameters", "dead_queue_name", "declare_topology",
           "message_properties", "retry_queue_name", "topology", "work_queue_arguments"]
