"""The binary envelope every jetsplit message travels in.

Layout (network byte order)::

    prefix  20 B   "JSPL" | version u8 | type u8 | flags u8 | 0 u8 | header_len u32 | body_len u64
    header         UTF-8 JSON: run, round, step, seq, sender, ts, kind, tensor descriptors, meta
    body           tensor payloads back to back, in descriptor order
    trailer  4 B   CRC32 of prefix+header+body        (always)
            32 B   HMAC-SHA256 of the same bytes      (flag SIGNED, with a fleet key)
         or 64 B   Ed25519 signature of the same bytes (flag ED25519, the sender's own key)

Decoding trusts nothing: lengths are checked against hard limits before anything is
allocated, the header is parsed against a strict schema, tensors are decoded without
copies where the codec allows (fp32 and raw views into the message), and every failure is
a typed `WireError`. There is no pickle anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import time
import zlib
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, Callable, Dict, List, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from typing_extensions import Annotated

from jetsplit.wire import codecs
from jetsplit.wire.errors import (
    BadMagic,
    BadSignature,
    ChecksumMismatch,
    MalformedHeader,
    OversizedMessage,
    TruncatedMessage,
    UnknownType,
    UnsupportedVersion,
)

MAGIC = b"JSPL"
WIRE_VERSION = 1
PREFIX = struct.Struct("!4sBBBBIQ")
CRC = struct.Struct("!I")
HMAC_BYTES = 32
FLAG_SIGNED = 0x01
FLAG_ED25519 = 0x02
ED25519_BYTES = 64
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a Jetson Nano has 4 GB shared with its GPU
# Identifiers on the wire (run, sender, tensor names): short, and safe in topics and logs.
WIRE_NAME = r"^[A-Za-z0-9._:/-]{1,128}$"
WireName = Annotated[str, Field(pattern=WIRE_NAME)]


class MessageType(IntEnum):
    """What a message is for; the header's `kind` says which payload (for byte counters)."""

    PRESENCE = 1
    REGISTER = 2
    COMMAND = 3
    REPLY = 4
    CHUNK = 5
    ACK = 6
    ERROR = 7
    PEER = 8  # agent → agent on a direct topic (SHeRL-FL's smashed data and gradients)


@dataclass(frozen=True)
class Limits:
    """Hard limits applied before allocation; the defaults suit Jetson-class peers."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # encoded, after reassembly
    max_decoded_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # all tensors of a message, decoded
    max_header_bytes: int = 64 * 1024
    max_tensors: int = 256
    max_tensor_elements: int = 1 << 28
    max_ndim: int = 8

    @classmethod
    def of_mib(cls, mib: int) -> Limits:
        """One configurable figure: encoded and decoded bytes per message, in MiB."""
        return cls(max_message_bytes=mib << 20, max_decoded_bytes=mib << 20)


# (sender, kind) → the bound a message of that kind from that sender was accounted for
# (say, the weights a coordinator asked for, or the blocks an agent's manifest declares);
# None where it was not, and the hard `Limits` apply.
Allowance = Callable[[str, str], Optional[int]]


def accounted_bound(tensor_bytes: int, limits: Limits = Limits()) -> int:
    """The largest envelope of a message whose tensors hold `tensor_bytes` raw bytes and
    travel uncompressed in fp32 or raw codecs (weights): the tensors plus the most its
    prefix, header and trailer may take, so a bound from known block sizes never refuses
    an honest message and a sender cannot add a byte beyond what was accounted."""
    return PREFIX.size + limits.max_header_bytes + tensor_bytes + CRC.size + ED25519_BYTES


Scalar = Optional[Union[str, int, float, bool]]
_Text = Annotated[str, Field(max_length=4096)]


class TensorDescriptor(BaseModel):
    """Where one tensor sits in the body and how to decode it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: WireName
    dtype: str
    shape: List[Annotated[int, Field(ge=0, le=1 << 31)]]
    codec: Literal["fp32", "fp16", "bf16", "int8", "raw"]
    compression: Literal["none", "lz4", "zstd"] = "none"
    length: Annotated[int, Field(ge=0)]
    params: List[Annotated[float, Field(allow_inf_nan=False)]] = Field(
        default_factory=list, max_length=2 * 65536)


class Header(BaseModel):
    """The envelope header; `meta` carries small command arguments and results."""

    model_config = ConfigDict(extra="forbid", strict=True)

    run: WireName
    round: Annotated[int, Field(ge=0)] = 0
    step: Annotated[int, Field(ge=0)] = 0
    seq: Annotated[int, Field(ge=0)]
    sender: WireName
    ts: Annotated[float, Field(allow_inf_nan=False)]
    kind: Annotated[str, Field(pattern=r"^[A-Za-z0-9._:/-]{0,128}$")] = ""
    tensors: List[TensorDescriptor] = Field(default_factory=list)
    meta: Dict[_Text, Any] = Field(default_factory=dict)


@dataclass
class Message:
    """A decoded (or to-be-encoded) message. Tensors decode as NumPy arrays."""

    type: MessageType
    run: str
    sender: str
    seq: int
    round: int = 0
    step: int = 0
    kind: str = ""
    meta: Dict[str, Any] = field(default_factory=dict)
    tensors: Dict[str, np.ndarray] = field(default_factory=dict)
    ts: float = 0.0
    signed: bool = False

    @property
    def key(self) -> tuple[str, int, int, int, str]:
        """Identity for idempotent handling of QoS 1 redeliveries."""
        return (self.run, self.round, self.step, self.seq, self.sender)


def encode_message(
    msg: Message,
    *,
    codec: str = "fp32",
    compression: str = "none",
    fleet_key: bytes | None = None,
    codec_overrides: dict[str, str] | None = None,
    signer: Any = None,
) -> bytes:
    """Serialise a message; `codec_overrides` picks a codec per tensor name (labels stay raw).

    `signer` (a `jetsplit.identity.Signer`) signs with the sender's own Ed25519 key;
    `fleet_key` with the fleet's shared HMAC key; not both."""
    if signer is not None and fleet_key:
        raise ValueError("sign with a device key or the fleet key, not both")
    descriptors: list[dict[str, Any]] = []
    payloads: list[bytes | memoryview] = []
    for name, array in msg.tensors.items():
        chosen = (codec_overrides or {}).get(name, codec)
        enc = codecs.encode(np.asarray(array), chosen, compression)
        descriptors.append({
            "name": name, "dtype": enc.dtype, "shape": list(enc.shape), "codec": enc.codec,
            "compression": enc.compression, "length": len(enc.payload),
            "params": list(enc.params),
        })
        payloads.append(enc.payload)
    header_bytes = header_json(msg, descriptors)
    body_len = sum(len(p) for p in payloads)
    flags = FLAG_SIGNED if fleet_key else FLAG_ED25519 if signer is not None else 0
    prefix = PREFIX.pack(MAGIC, WIRE_VERSION, int(msg.type), flags, 0, len(header_bytes),
                         body_len)
    parts: list[bytes | memoryview] = [prefix, header_bytes, *payloads]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    parts.append(CRC.pack(crc))
    if fleet_key:
        mac = hmac.new(fleet_key, digestmod=hashlib.sha256)
        for part in parts[:-1]:
            mac.update(part)
        parts.append(mac.digest())
    out = b"".join(parts)
    if signer is not None:
        signature = signer.sign(out[:len(out) - CRC.size])
        if len(signature) != ED25519_BYTES:
            raise ValueError("an Ed25519 signature has 64 bytes")
        out += signature
    return out


def header_json(msg: Message, descriptors: list[dict[str, Any]]) -> bytes:
    """The envelope header of `msg` with these tensor descriptors, as the bytes it travels
    in (`ts` stamped now when the message has none); the in-process engine's by-reference
    path (jetsplit/wire/handover.py) builds the very same bytes."""
    header = {
        "run": msg.run, "round": msg.round, "step": msg.step, "seq": msg.seq,
        "sender": msg.sender, "ts": float(msg.ts or time.time()), "kind": msg.kind,
        "tensors": descriptors, "meta": msg.meta,
    }
    try:
        return json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise MalformedHeader(f"header is not JSON-serialisable: {exc}") from None


def peek_type(data: bytes | memoryview) -> MessageType:
    """The message type from the prefix alone (to route chunks before full decoding)."""
    if len(data) < PREFIX.size:
        raise TruncatedMessage(f"message of {len(data)} bytes is shorter than its prefix")
    magic, version, mtype, *_ = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise BadMagic("not a jetsplit message (bad magic)")
    if version != WIRE_VERSION:
        raise UnsupportedVersion(f"wire version {version}; this build speaks {WIRE_VERSION}")
    try:
        return MessageType(mtype)
    except ValueError:
        raise UnknownType(f"unknown message type {mtype}") from None


def decode_message(
    data: bytes | memoryview,
    *,
    fleet_key: bytes | None = None,
    limits: Limits = Limits(),
    keyring: Any = None,
    allowance: Optional[Allowance] = None,
) -> Message:
    """Parse and verify one message from untrusted bytes (raises a typed WireError).

    With a `keyring` (a `jetsplit.identity.KeyRing`) every message must carry an Ed25519
    signature that verifies under the key of the sender its header names; the header is
    parsed (bounded) to learn that name, and verified before any tensor is decoded.
    A message over `limits` is refused unless `allowance` accounted for its sender and
    kind (as its bounded header names them) a bound it stays within."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    limits = _allowed(view, limits, allowance)
    mtype = peek_type(view)
    _, _, _, flags, reserved, header_len, body_len = PREFIX.unpack_from(view)
    if reserved != 0 or flags & ~(FLAG_SIGNED | FLAG_ED25519) or flags == 3:
        raise MalformedHeader(f"unknown flags {flags:#x}/{reserved:#x}")
    if header_len > limits.max_header_bytes:
        raise OversizedMessage(f"header of {header_len} bytes exceeds {limits.max_header_bytes}")
    signed = bool(flags & FLAG_SIGNED)
    device_signed = bool(flags & FLAG_ED25519)
    trailer = CRC.size + (HMAC_BYTES if signed else ED25519_BYTES if device_signed else 0)
    expected = PREFIX.size + header_len + body_len + trailer
    if len(view) != expected:
        cls = TruncatedMessage if len(view) < expected else MalformedHeader
        raise cls(f"message has {len(view)} bytes, its prefix declares {expected}")
    covered = PREFIX.size + header_len + body_len
    (crc,) = CRC.unpack_from(view, covered)
    if zlib.crc32(view[:covered]) != crc:
        raise ChecksumMismatch("CRC32 mismatch: message corrupted in transit")
    if fleet_key is not None:
        if not signed:
            raise BadSignature("unsigned message rejected: this fleet requires a key")
        digest = hmac.new(fleet_key, view[:covered], hashlib.sha256).digest()
        if not hmac.compare_digest(digest, bytes(view[covered + CRC.size:])):
            raise BadSignature("HMAC mismatch: wrong fleet key or tampered message")
    if keyring is not None and not device_signed:
        raise BadSignature("message without a device signature rejected: this fleet "
                           "requires one")
    header = parse_header(view[PREFIX.size:PREFIX.size + header_len], limits)
    if keyring is not None:
        keyring.verify(header.sender, view[:covered], view[covered + CRC.size:])
    body = view[PREFIX.size + header_len:covered]
    tensors = _decode_tensors(header.tensors, body, limits)
    return Message(type=mtype, run=header.run, sender=header.sender, seq=header.seq,
                   round=header.round, step=header.step, kind=header.kind, meta=header.meta,
                   tensors=tensors, ts=header.ts,
                   signed=(signed and fleet_key is not None) or keyring is not None)


def _allowed(view: memoryview, limits: Limits, allowance: Optional[Allowance]) -> Limits:
    """The limits for this message: `limits`, or, for a larger message its (sender, kind)
    was accounted for, `limits` raised to that bound. Only the bounded header is read."""
    if len(view) <= limits.max_message_bytes:
        return limits
    refused = OversizedMessage(f"message of {len(view)} bytes exceeds "
                               f"{limits.max_message_bytes}")
    if allowance is None:
        raise refused
    peek_type(view)
    header_len = PREFIX.unpack_from(view)[5]
    if header_len > limits.max_header_bytes or PREFIX.size + header_len > len(view):
        raise refused
    header = parse_header(view[PREFIX.size:PREFIX.size + header_len], limits)
    return accounted_limits(len(view), header, limits, allowance, refused)


def accounted_limits(size: int, header: Header, limits: Limits, allowance: Allowance,
                     refused: OversizedMessage) -> Limits:
    """`limits` raised to the bound `allowance` accounted for a message of `size` bytes
    from the sender and of the kind `header` names; `refused` when it accounted none."""
    bound = allowance(header.sender, header.kind)
    if bound is None:
        raise refused
    if size > bound:
        raise OversizedMessage(f"{header.kind} message of {size} bytes from "
                               f"{header.sender} exceeds its accounted {bound}")
    return replace(limits, max_message_bytes=bound, max_decoded_bytes=bound)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise ValueError("non-finite number")
    return value


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not allowed")  # NaN, Infinity, -Infinity


def parse_header(raw: bytes | memoryview, limits: Limits) -> Header:
    """The header from untrusted bytes, against the strict schema and `limits`."""
    try:
        obj = json.loads(bytes(raw).decode("utf-8"), parse_float=_finite,
                         parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError too
        raise MalformedHeader(f"header is not UTF-8 JSON with finite numbers: "
                              f"{type(exc).__name__}") from None
    try:
        header = Header.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "header"
        raise MalformedHeader(f"header field {where}: {first['msg']}") from None
    if len(header.tensors) > limits.max_tensors:
        raise OversizedMessage(f"{len(header.tensors)} tensors exceed {limits.max_tensors}")
    return header


def _decode_tensors(descriptors: list[TensorDescriptor], body: memoryview, limits: Limits
                    ) -> dict[str, np.ndarray]:
    check_descriptors(descriptors, len(body), limits)
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for d in descriptors:
        payload = body[offset:offset + d.length]
        offset += d.length
        tensors[d.name] = codecs.decode(payload, d.dtype, tuple(d.shape), d.codec,
                                        d.compression, tuple(d.params),
                                        max_bytes=limits.max_decoded_bytes)
    return tensors


def check_descriptors(descriptors: list[TensorDescriptor], body_len: int, limits: Limits
                      ) -> None:
    """Refuse descriptors that do not add up to the body or exceed `limits` (dims,
    elements, names, decoded bytes), before anything is allocated."""
    if sum(d.length for d in descriptors) != body_len:
        raise MalformedHeader("tensor lengths do not add up to the body length")
    # Every declared size is checked before the first byte is decompressed or allocated.
    names: set[str] = set()
    total = 0
    for d in descriptors:
        if len(d.shape) > limits.max_ndim:
            raise OversizedMessage(f"tensor {d.name} has {len(d.shape)} dims > {limits.max_ndim}")
        elements = codecs.element_count(tuple(d.shape))
        if elements > limits.max_tensor_elements:
            raise OversizedMessage(f"tensor {d.name} has {elements} elements")
        if d.name in names:
            raise MalformedHeader(f"tensor {d.name} appears twice")
        names.add(d.name)
        shape = tuple(d.shape)
        total += max(codecs.decoded_nbytes(d.dtype, shape, d.codec),
                     codecs.output_nbytes(d.dtype, shape))
        if total > limits.max_decoded_bytes:
            raise OversizedMessage(f"tensors would decode to more than "
                                   f"{limits.max_decoded_bytes} bytes")
