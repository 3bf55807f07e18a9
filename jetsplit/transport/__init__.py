"""Moving jetsplit envelopes between agents and the coordinator: topics, MQTT, counters."""

from jetsplit.transport.counters import ByteCounters
from jetsplit.transport.topics import COORDINATOR, Topics, check_id

__all__ = ["COORDINATOR", "ByteCounters", "Topics", "check_id"]
