"""Splitting encoded messages into broker-sized chunks and reassembling them, bounded.

A chunk is itself an envelope of type CHUNK (so it is checksummed and, with a fleet key,
signed) whose body is one slice of the full message. The reassembler bounds what a peer can
make it hold: bytes per message, messages in flight, total buffered bytes, and age. A chunk
names the kind of the message it carries, so a message larger than the limits is taken
only where its receiver accounted for it (its `Allowance`); the whole message's own header
is checked against that bound again when it is decoded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np

from jetsplit.wire.envelope import Allowance, Limits, Message, MessageType, encode_message
from jetsplit.wire.errors import OversizedMessage, ReassemblyError

DEFAULT_CHUNK_BYTES = 1024 * 1024
CHUNK_OVERHEAD = 1024  # prefix + JSON header + trailer (CRC + signature) of a CHUNK, generously


def chunk_count(total_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """How many envelopes a message of `total_bytes` travels in (1 when it fits)."""
    if total_bytes <= chunk_bytes:
        return 1
    return -(-total_bytes // (chunk_bytes - CHUNK_OVERHEAD))


def chunk_message(
    encoded: bytes,
    *,
    run: str,
    sender: str,
    seq_start: int,
    msg_id: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fleet_key: bytes | None = None,
    signer: Any = None,
    kind: str = "",
) -> list[bytes]:
    """The message itself if it fits in one chunk, else CHUNK envelopes carrying its slices
    (each naming the carried message's `kind`, for its receiver's allowance)."""
    if chunk_bytes < 4 * CHUNK_OVERHEAD:
        raise ValueError(f"chunk size must be at least {4 * CHUNK_OVERHEAD} bytes")
    if len(encoded) <= chunk_bytes:
        return [encoded]
    size = chunk_bytes - CHUNK_OVERHEAD  # each chunk's whole envelope stays within chunk_bytes
    count = -(-len(encoded) // size)
    chunks = []
    for index in range(count):
        piece = np.frombuffer(encoded, dtype=np.uint8,
                              count=min(size, len(encoded) - index * size), offset=index * size)
        msg = Message(MessageType.CHUNK, run=run, sender=sender, seq=seq_start + index,
                      kind="chunk", meta={"id": msg_id, "index": index, "count": count,
                                          "total": len(encoded), "size": size, "of": kind},
                      tensors={"data": piece})
        chunks.append(encode_message(msg, codec="fp32", fleet_key=fleet_key, signer=signer))
    return chunks


@dataclass
class _Partial:
    total: int
    count: int
    size: int
    pieces: Dict[int, bytes] = field(default_factory=dict)  # held bytes = what arrived
    held: int = 0
    accounted: bool = False  # over the limits, within its receiver's allowance
    started: float = field(default_factory=time.monotonic)


class Reassembler:
    """Collects CHUNK messages per (sender, id) into whole encoded messages.

    Budgets are per sender: a sender holds at most `per_sender_in_flight` unfinished messages
    and `per_sender_bytes` declared bytes. A sender over its budget loses its own oldest
    unfinished message, never another sender's, so one flooding peer cannot starve the rest.
    Chunks are kept as they arrive (no buffer sized by a declared total), and the overall
    `max_buffered_bytes` bounds what all senders together hold. A message over the limits
    that `allowance(sender, kind)` accounted for is bounded by that allowance instead, and
    counts against neither budget: its receiver asked for it."""

    def __init__(
        self,
        limits: Limits = Limits(),
        *,
        max_in_flight: int = 1024,
        max_buffered_bytes: int = 1024 * 1024 * 1024,
        timeout_s: float = 60.0,
        per_sender_in_flight: int = 4,
        per_sender_bytes: int | None = None,
        allowance: Optional[Allowance] = None,
    ) -> None:
        self.limits = limits
        self.allowance = allowance
        self.max_in_flight = max_in_flight
        self.max_buffered_bytes = max_buffered_bytes
        self.timeout_s = timeout_s
        self.per_sender_in_flight = per_sender_in_flight
        self.per_sender_bytes = (2 * limits.max_message_bytes if per_sender_bytes is None
                                 else per_sender_bytes)
        self._partials: dict[tuple[str, str], _Partial] = {}
        self.expired = 0
        self.evicted = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes actually held (chunks received of unfinished messages)."""
        return sum(p.held for p in self._partials.values())

    def _of(self, sender: str) -> list[tuple[tuple[str, str], _Partial]]:
        return [(k, p) for k, p in self._partials.items() if k[0] == sender]

    def expire(self, now: float | None = None) -> int:
        """Drop messages whose chunks stopped arriving; returns how many were dropped."""
        now = time.monotonic() if now is None else now
        stale = [k for k, p in self._partials.items() if now - p.started > self.timeout_s]
        for key in stale:
            del self._partials[key]
        self.expired += len(stale)
        return len(stale)

    def _accounted(self, sender: str, kind: str, total: int) -> bool:
        """Whether a message over the limits is one its receiver accounted for (else it is
        refused, with the bound it broke)."""
        if 0 < total <= self.limits.max_message_bytes:
            return False
        bound = self.allowance(sender, kind) if self.allowance is not None and kind else None
        if bound is None or total <= 0:
            raise OversizedMessage(f"chunked message of {total} bytes exceeds the limit")
        if total > bound:
            raise OversizedMessage(f"chunked {kind} message of {total} bytes from {sender} "
                                   f"exceeds its accounted {bound}")
        return True

    def _make_room(self, sender: str, total: int, accounted: bool = False) -> None:
        """Evict the sender's own oldest unfinished messages until the new one fits its
        budget; refuse it when even an empty budget cannot hold it or the whole table is full.
        An accounted message does not count against the budget."""
        size = 0 if accounted else total
        if size > self.per_sender_bytes:
            raise OversizedMessage(f"chunked message of {total} bytes exceeds {sender}'s "
                                   f"budget of {self.per_sender_bytes}")
        mine = self._of(sender)  # insertion order: oldest first
        while mine and (len(mine) >= self.per_sender_in_flight
                        or sum(p.total for _, p in mine if not p.accounted) + size
                        > self.per_sender_bytes):
            key, _ = mine.pop(0)
            del self._partials[key]
            self.evicted += 1
        if len(self._partials) >= self.max_in_flight:
            raise OversizedMessage(f"more than {self.max_in_flight} chunked messages in flight")

    def feed(self, chunk: Message) -> bytes | None:
        """Add one decoded CHUNK; returns the full encoded message once all chunks arrived."""
        self.expire()
        meta = chunk.meta
        try:
            msg_id, index = str(meta["id"]), int(meta["index"])
            count, total, size = int(meta["count"]), int(meta["total"]), int(meta["size"])
            data = chunk.tensors["data"]
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ReassemblyError("chunk header lacks id/index/count/total or data") from None
        if data.dtype != np.uint8 or data.ndim != 1:
            raise ReassemblyError("chunk data must be a 1-D byte tensor")
        accounted = self._accounted(chunk.sender, str(meta.get("of") or ""), total)
        if size <= 0 or count != -(-total // size) or not 0 <= index < count:
            raise ReassemblyError(f"chunk {index} of {count} (size {size}) is out of range")
        expected_len = size if index < count - 1 else total - size * (count - 1)
        if len(data) != expected_len or expected_len <= 0:
            raise ReassemblyError(f"chunk {index} has {len(data)} bytes, expected {expected_len}")
        key = (chunk.sender, msg_id)
        partial = self._partials.get(key)
        if partial is None:
            self._make_room(chunk.sender, total, accounted)
            partial = _Partial(total, count, size, accounted=accounted)
            self._partials[key] = partial
        if (partial.total, partial.count, partial.size) != (total, count, size):
            raise ReassemblyError(f"chunk {index} disagrees with its message's size")
        if index in partial.pieces:
            return None  # QoS 1 redelivery: idempotent
        unaccounted = sum(p.held for p in self._partials.values() if not p.accounted)
        if not partial.accounted and unaccounted + len(data) > self.max_buffered_bytes:
            raise OversizedMessage("reassembly buffer is full")
        partial.pieces[index] = data.tobytes()
        partial.held += len(data)
        if len(partial.pieces) < count:
            return None
        del self._partials[key]
        return b"".join(partial.pieces[i] for i in range(count))
