"""Typed wire errors: every rejected message is one of these, counted by its class name."""

from __future__ import annotations

from jetsplit.errors import JetsplitError


class WireError(JetsplitError):
    """A message was rejected; the process keeps running."""


class TruncatedMessage(WireError):
    """Fewer bytes than the fixed prefix or the lengths it declares."""


class BadMagic(WireError):
    """Not a jetsplit message."""


class UnsupportedVersion(WireError):
    """A wire version this build does not speak."""


class UnknownType(WireError):
    """A message type this build does not know."""


class OversizedMessage(WireError):
    """Over a hard limit: message bytes, header bytes, tensor count or elements, chunks."""


class MalformedHeader(WireError):
    """The header is not valid JSON or fails its schema."""


class ChecksumMismatch(WireError):
    """The CRC32 over header and body does not match: corrupted in transit."""


class BadSignature(WireError):
    """Missing or wrong HMAC under the fleet key."""


class ReplayedMessage(WireError):
    """A signed message whose sequence number was already seen or whose timestamp is stale."""


class SenderMismatch(WireError):
    """A message whose sender does not own the topic it arrived on (up/X must come from X)."""


class StalePresence(WireError):
    """A presence message that is older than allowed, from the future, or older than one
    already seen from the same sender (a replayed retained message)."""


class CodecError(WireError):
    """A tensor payload does not decode to what its descriptor says."""


class ReassemblyError(WireError):
    """A chunk that does not fit its message, or a message whose chunks expired."""


class UnexpectedPeer(WireError):
    """A direct message from an agent that is not this agent's assigned peer for it (not
    one of an edge's clients, not a client's edge), or of a kind it may not send."""


class StalePeerMessage(WireError):
    """A direct message for another run, round or step than the one its receiver is in."""


class PeerBacklog(WireError):
    """A direct message over what a receiver holds for commands yet to come (count or
    bytes), or a second copy of one it already holds."""
