"""The envelope's bytes against its documented layout (jetsplit/wire/envelope.py's
docstring), built and read here by hand with struct, zlib, hmac and json.

A peer built from another code base (or an older jetsplit) meets these bytes, not the
Python objects the round-trip tests compare: every constant of the format (magic, version,
type numbers, flag bits, byte order, field widths, what the checksum and each signature
cover) is pinned here, so a change to one fails a test instead of a fleet.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import zlib

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from jetsplit.identity import Signer
from jetsplit.wire import Message, MessageType, decode_message, encode_message
from jetsplit.wire.envelope import Limits, accounted_bound
from jetsplit.wire.errors import (
    BadMagic,
    MalformedHeader,
    OversizedMessage,
    UnknownType,
    UnsupportedVersion,
)

KEY = b"a fleet key"
TS = 1700000000.5
#: The message types by the numbers the layout gives them.
TYPE_NUMBERS = {"PRESENCE": 1, "REGISTER": 2, "COMMAND": 3, "REPLY": 4, "CHUNK": 5, "ACK": 6,
                "ERROR": 7, "PEER": 8}


def _message() -> Message:
    return Message(MessageType.REPLY, run="run-1", sender="a0", seq=7, round=2, step=5,
                   kind="forward", meta={"batch": 2},
                   tensors={"activations": np.array([[1.0, -2.0]], np.float32),
                            "labels": np.array([3], np.int64)}, ts=TS)


def _expected_header() -> bytes:
    """The header as the layout says: compact UTF-8 JSON, fields in this order."""
    descriptors = [
        {"name": "activations", "dtype": "float32", "shape": [1, 2], "codec": "fp32",
         "compression": "none", "length": 8, "params": []},
        {"name": "labels", "dtype": "int64", "shape": [1], "codec": "raw",
         "compression": "none", "length": 8, "params": []},
    ]
    header = {"run": "run-1", "round": 2, "step": 5, "seq": 7, "sender": "a0", "ts": TS,
              "kind": "forward", "tensors": descriptors, "meta": {"batch": 2}}
    return json.dumps(header, separators=(",", ":")).encode()


#: The body: the tensors back to back, little-endian (what every Jetson and x86 host is).
BODY = struct.pack("<2f", 1.0, -2.0) + struct.pack("<q", 3)


def _prefix(flags: int, header: bytes, body: bytes = BODY, *, magic: bytes = b"JSPL",
            version: int = 1, mtype: int = 4, reserved: int = 0) -> bytes:
    """20 bytes, network order: magic, version u8, type u8, flags u8, 0 u8, header_len u32,
    body_len u64, packed field by field."""
    return (magic + bytes([version, mtype, flags, reserved]) + len(header).to_bytes(4, "big")
            + len(body).to_bytes(8, "big"))


def test_the_message_types_keep_their_numbers() -> None:
    assert {t.name: int(t) for t in MessageType} == TYPE_NUMBERS


def test_an_unsigned_message_is_prefix_header_body_and_crc32() -> None:
    data = encode_message(_message())
    header = _expected_header()
    covered = _prefix(0, header) + header + BODY
    assert data == covered + zlib.crc32(covered).to_bytes(4, "big")


def test_a_fleet_signed_message_adds_an_hmac_sha256_of_the_covered_bytes() -> None:
    data = encode_message(_message(), fleet_key=KEY)
    header = _expected_header()
    covered = _prefix(0x01, header) + header + BODY
    mac = hmac.new(KEY, covered, hashlib.sha256).digest()
    assert data == covered + zlib.crc32(covered).to_bytes(4, "big") + mac


def test_a_device_signed_message_adds_an_ed25519_signature_of_the_covered_bytes() -> None:
    key = Ed25519PrivateKey.generate()
    data = encode_message(_message(), signer=Signer("a0", key))
    header = _expected_header()
    covered = _prefix(0x02, header) + header + BODY
    assert data[:len(covered) + 4] == covered + zlib.crc32(covered).to_bytes(4, "big")
    signature = data[len(covered) + 4:]
    assert len(signature) == 64
    key.public_key().verify(signature, covered)  # raises if it covers anything else


def test_bytes_assembled_by_hand_decode_to_the_message() -> None:
    header = _expected_header()
    covered = _prefix(0x01, header) + header + BODY
    data = (covered + zlib.crc32(covered).to_bytes(4, "big")
            + hmac.new(KEY, covered, hashlib.sha256).digest())
    out = decode_message(data, fleet_key=KEY)
    assert (out.type, out.key, out.kind, out.meta, out.ts, out.signed) == (
        MessageType.REPLY, ("run-1", 2, 5, 7, "a0"), "forward", {"batch": 2}, TS, True)
    assert out.tensors["activations"].tolist() == [[1.0, -2.0]]
    assert out.tensors["labels"].dtype == np.int64 and out.tensors["labels"].tolist() == [3]


@pytest.mark.parametrize(("fields", "error"), [
    ({"magic": b"JSPM"}, BadMagic),
    ({"version": 2}, UnsupportedVersion),
    ({"version": 0}, UnsupportedVersion),
    ({"mtype": 0}, UnknownType),
    ({"mtype": 9}, UnknownType),
    ({"reserved": 1}, MalformedHeader),
    ({"flags": 0x04}, MalformedHeader),
    ({"flags": 0x03}, MalformedHeader),  # both signatures at once: neither layout
])
def test_a_prefix_off_the_layout_is_refused(fields: dict, error: type) -> None:
    header = _expected_header()
    flags = fields.pop("flags", 0)
    covered = _prefix(flags, header, **fields) + header + BODY
    with pytest.raises(error):
        decode_message(covered + zlib.crc32(covered).to_bytes(4, "big"))


def _frame(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    covered = _prefix(0, raw, body) + raw + body
    return covered + zlib.crc32(covered).to_bytes(4, "big")


def _header(**fields: object) -> dict:
    return {"run": "r", "seq": 1, "sender": "a0", "ts": TS, **fields}


def test_the_default_limits_are_the_documented_ones() -> None:
    """64 MiB a message (a Nano's 4 GB is shared with its GPU), 64 KiB of header, 256
    tensors of at most 2^28 elements and 8 dims; `of_mib` sets the two byte limits; the
    bound for accounted tensors adds the largest prefix, header and trailer."""
    assert Limits() == Limits(max_message_bytes=64 << 20, max_decoded_bytes=64 << 20,
                              max_header_bytes=65536, max_tensors=256,
                              max_tensor_elements=268435456, max_ndim=8)
    assert Limits.of_mib(3) == Limits(max_message_bytes=3145728, max_decoded_bytes=3145728)
    assert accounted_bound(1000) == 20 + 65536 + 1000 + 4 + 64
    assert accounted_bound(0, Limits(max_header_bytes=100)) == 188


def test_a_tensor_of_eight_dims_decodes_and_one_of_nine_is_refused() -> None:
    for ndim, ok in ((8, True), (9, False)):
        descriptor = {"name": "x", "dtype": "float32", "shape": [1] * ndim, "codec": "fp32",
                      "compression": "none", "length": 4, "params": []}
        frame = _frame(_header(tensors=[descriptor]), struct.pack("<f", 0.5))
        if ok:
            assert decode_message(frame).tensors["x"].reshape(-1).tolist() == [0.5]
        else:
            with pytest.raises(OversizedMessage, match="9 dims > 8"):
                decode_message(frame)


@pytest.mark.parametrize(("fields", "error"), [
    ({"round": -1}, MalformedHeader), ({"step": -1}, MalformedHeader),
    ({"seq": -1}, MalformedHeader), ({"ts": "now"}, MalformedHeader),
    ({"sender": "a b"}, MalformedHeader), ({"sender": "x" * 129}, MalformedHeader),
    ({"kind": "fwd!"}, MalformedHeader), ({"extra": 1}, MalformedHeader),
])
def test_header_fields_off_their_bounds_are_refused(fields: dict, error: type) -> None:
    assert decode_message(_frame(_header(sender="x" * 128, kind="a.b:c/d-e_f"))).seq == 1
    with pytest.raises(error):
        decode_message(_frame(_header(**fields)))


def test_a_dimension_may_reach_two_to_the_31_in_the_header_and_no_further() -> None:
    """The schema bounds each dim (2^31 parses, then the element limit refuses it); one
    more is a malformed header. A negative dim never parses."""
    def frame(dim: int) -> bytes:
        return _frame(_header(tensors=[{"name": "x", "dtype": "float32", "shape": [dim],
                                        "codec": "fp32", "length": 0}]))
    with pytest.raises(OversizedMessage, match="elements"):
        decode_message(frame(1 << 31))
    for dim in ((1 << 31) + 1, -1):
        with pytest.raises(MalformedHeader, match="shape"):
            decode_message(frame(dim))
