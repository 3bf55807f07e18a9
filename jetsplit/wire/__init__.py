"""Wire protocol: binary envelopes, tensor codecs, chunking, integrity and replay protection."""

from jetsplit.wire.chunking import (
    DEFAULT_CHUNK_BYTES,
    Reassembler,
    chunk_count,
    chunk_message,
)
from jetsplit.wire.codecs import CODECS, COMPRESSIONS
from jetsplit.wire.envelope import (
    WIRE_VERSION,
    Allowance,
    Limits,
    Message,
    MessageType,
    accounted_bound,
    decode_message,
    encode_message,
    peek_type,
)
from jetsplit.wire.errors import WireError
from jetsplit.wire.replay import PresenceGuard, ReplayGuard, SequenceCounter

__all__ = [
    "Allowance",
    "CODECS",
    "COMPRESSIONS",
    "DEFAULT_CHUNK_BYTES",
    "WIRE_VERSION",
    "Limits",
    "Message",
    "MessageType",
    "PresenceGuard",
    "Reassembler",
    "ReplayGuard",
    "SequenceCounter",
    "WireError",
    "accounted_bound",
    "chunk_count",
    "chunk_message",
    "decode_message",
    "encode_message",
    "peek_type",
]
