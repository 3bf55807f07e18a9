"""What the envelope's decoder promises, each test written to fail when the code is wrong in a
plausible way: a device signature verifies under its sender's key over exactly the covered
bytes, whatever the message's length; `signed` means something verified it; the header is
parsed strictly (no coercion of strings into numbers) with its documented defaults; a
checksum mismatch is caught whichever way it falls; a length mismatch names which way it
is wrong; descriptors must add up to the body exactly; and a message over the size cap is
taken only within the bound its sender and kind were accounted, at the bound's edge too."""

from __future__ import annotations

import dataclasses
import json
import struct
import time

import numpy as np
import pytest

from jetsplit.wire import Message, MessageType, decode_message, encode_message
from jetsplit.wire.envelope import (
    PREFIX,
    Limits,
    TensorDescriptor,
    check_descriptors,
    parse_header,
    peek_type,
)
from jetsplit.wire.errors import (
    BadMagic,
    BadSignature,
    ChecksumMismatch,
    MalformedHeader,
    OversizedMessage,
    TruncatedMessage,
)

pytestmark = pytest.mark.device_pure

KEY = b"a fleet key"


def message(pad: int = 0, **over: object) -> Message:
    fields = {"type": MessageType.REPLY, "run": "run-1", "sender": "a0", "seq": 7,
              "round": 2, "step": 5, "kind": "forward", "meta": {"pad": "x" * pad},
              "tensors": {"activations": np.arange(6, dtype=np.float32).reshape(2, 3)},
              "ts": 1700000000.5}
    return Message(**{**fields, **over})  # type: ignore[arg-type]


# ---------------------------------------------------------------- signatures


@pytest.mark.parametrize("pad", range(8))
def test_a_device_signature_verifies_under_its_senders_key_at_every_length(pad: int) -> None:
    """Eight lengths in a row: the signed span is the message less its checksum and
    signature for every one (an off-by-a-bit span agrees with it for some lengths)."""
    ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
    from jetsplit.identity import KeyRing, Signer

    key = ed25519.Ed25519PrivateKey.generate()
    ring = KeyRing({"a0": key.public_key()})
    data = encode_message(message(pad), signer=Signer("a0", key))
    out = decode_message(data, keyring=ring)
    assert out.signed and out.meta == {"pad": "x" * pad}
    assert out.tensors["activations"].tolist() == [[0, 1, 2], [3, 4, 5]]
    other = KeyRing({"a0": ed25519.Ed25519PrivateKey.generate().public_key()})
    with pytest.raises(BadSignature, match="does not verify under a0's key"):
        decode_message(data, keyring=other)


def test_signed_means_verified() -> None:
    """A fleet-signed message read without the fleet key was verified by nobody."""
    data = encode_message(message(), fleet_key=KEY)
    assert decode_message(data, fleet_key=KEY).signed
    assert not decode_message(data).signed
    assert not decode_message(encode_message(message())).signed


# ---------------------------------------------------------------- the header


def header(**over: object) -> dict:
    return {"run": "r", "seq": 1, "sender": "a0", "ts": 1.0, **over}


def raw(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def test_round_and_step_default_to_zero() -> None:
    parsed = parse_header(raw(header()), Limits())
    assert (parsed.round, parsed.step, parsed.kind, parsed.tensors, parsed.meta) == \
        (0, 0, "", [], {})
    assert (Message(MessageType.ACK, "r", "a0", 1).round,
            Message(MessageType.ACK, "r", "a0", 1).step) == (0, 0)
    out = decode_message(encode_message(Message(MessageType.ACK, "r", "a0", 1)))
    assert (out.round, out.step) == (0, 0)


@pytest.mark.parametrize("field", [{"seq": "1"}, {"round": "2"}, {"round": 2.0},
                                   {"ts": "1.0"}, {"sender": 5}])
def test_the_header_is_parsed_strictly(field: dict) -> None:
    with pytest.raises(MalformedHeader):
        parse_header(raw(header(**field)), Limits())


@pytest.mark.parametrize("change", [{"length": "8"}, {"shape": ["2"]}, {"shape": [2.0]},
                                    {"params": ["1.0"]}])
def test_a_tensor_descriptor_is_parsed_strictly(change: dict) -> None:
    descriptor = {"name": "x", "dtype": "float32", "shape": [2], "codec": "fp32",
                  "length": 8, **change}
    with pytest.raises(MalformedHeader, match="tensors"):
        parse_header(raw(header(tensors=[descriptor])), Limits())


def test_a_descriptor_holds_at_most_two_range_parameters_per_channel_of_65536() -> None:
    def with_params(n: int) -> bytes:
        return raw(header(tensors=[{"name": "x", "dtype": "float32", "shape": [1],
                                    "codec": "int8", "length": 1, "params": [0.0] * n}]))

    assert len(parse_header(with_params(2 * 65536), Limits()).tensors[0].params) == 131072
    with pytest.raises(MalformedHeader, match="params"):
        parse_header(with_params(2 * 65536 + 1), Limits())


def test_limits_cannot_be_changed_after_the_fact() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Limits().max_tensors = 10_000  # type: ignore[misc]


# ---------------------------------------------------------------- lengths and checksum


def test_every_single_byte_corruption_of_the_body_is_a_checksum_mismatch() -> None:
    """Sixty corruptions: the computed checksum lands above the carried one for some and
    below it for others; each is caught."""
    data = encode_message(message(pad=40))
    body_end = len(data) - 4
    for i in range(body_end - 60, body_end):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        with pytest.raises(ChecksumMismatch):
            decode_message(bytes(bad))


def test_a_length_mismatch_names_which_way_it_is_wrong() -> None:
    data = encode_message(message())
    with pytest.raises(TruncatedMessage, match="its prefix declares"):
        decode_message(data[:-1])
    with pytest.raises(MalformedHeader, match="its prefix declares"):
        decode_message(data + b"\x00")


@pytest.mark.parametrize("body", [12, 4])
def test_descriptors_must_add_up_to_the_body_exactly(body: int) -> None:
    descriptor = TensorDescriptor(name="x", dtype="float32", shape=[2], codec="fp32",
                                  length=8)
    check_descriptors([descriptor], 8, Limits())
    with pytest.raises(MalformedHeader, match="do not add up to the body length"):
        check_descriptors([descriptor], body, Limits())


# ---------------------------------------------------------------- the cap and allowances


def capped(data: bytes) -> Limits:
    """The limits under which `data` is exactly at the message cap."""
    return Limits(max_message_bytes=len(data), max_decoded_bytes=1 << 20)


def test_a_message_exactly_at_the_cap_needs_no_allowance() -> None:
    data = encode_message(message())
    assert decode_message(data, limits=capped(data)).seq == 7
    with pytest.raises(OversizedMessage, match=f"message of {len(data)} bytes exceeds"):
        decode_message(data, limits=capped(data[:-1]))


def test_an_accounted_message_is_taken_up_to_its_bound_and_not_a_byte_more() -> None:
    data = encode_message(message())
    limits = capped(data[:-10])  # the cap is 10 bytes short
    asked: list[tuple[str, str]] = []

    def exactly(sender: str, kind: str) -> int:
        asked.append((sender, kind))
        return len(data)

    assert decode_message(data, limits=limits, allowance=exactly).seq == 7
    assert asked == [("a0", "forward")]
    assert decode_message(data, limits=limits, allowance=lambda s, k: len(data) + 100).seq == 7
    with pytest.raises(OversizedMessage, match=f"forward message of {len(data)} bytes from "
                                               f"a0 exceeds its accounted {len(data) - 1}"):
        decode_message(data, limits=limits, allowance=lambda s, k: len(data) - 1)


def test_an_unaccounted_oversized_message_is_refused() -> None:
    data = encode_message(message())
    limits = capped(data[:-10])
    for allowance in (None, lambda sender, kind: None):
        with pytest.raises(OversizedMessage, match=f"message of {len(data)} bytes exceeds "
                                                   f"{len(data) - 10}"):
            decode_message(data, limits=limits, allowance=allowance)


def with_header_len(data: bytes, header_len: int) -> bytes:
    out = bytearray(data)
    fields = list(PREFIX.unpack_from(out))
    fields[5] = header_len
    struct.pack_into(PREFIX.format, out, 0, *fields)
    return bytes(out)


def test_an_oversized_message_whose_prefix_overstates_its_header_is_refused() -> None:
    """The allowance reads only a header inside the message: a prefix claiming one that
    runs past the end (by a byte, by the prefix's size, by far) is the size refusal, not a
    parse of bytes beyond it; one that ends exactly at the message's end is parsed (and,
    being the header and the rest, is no JSON)."""
    data = encode_message(message())
    limits = capped(data[:-10])
    for claimed in (len(data) - PREFIX.size + 1, len(data), len(data) + 1000):
        with pytest.raises(OversizedMessage, match=f"message of {len(data)} bytes exceeds"):
            decode_message(with_header_len(data, claimed), limits=limits,
                           allowance=lambda sender, kind: 1 << 20)
    with pytest.raises(MalformedHeader, match="not UTF-8 JSON"):
        decode_message(with_header_len(data, len(data) - PREFIX.size), limits=limits,
                       allowance=lambda sender, kind: 1 << 20)


def test_an_oversized_message_is_read_for_its_allowance_only_within_the_header_limit() -> None:
    data = encode_message(message())
    real = header_len(data)
    at = Limits(max_message_bytes=len(data) - 10, max_header_bytes=real)
    assert decode_message(data, limits=at, allowance=lambda s, k: len(data)).seq == 7
    under = Limits(max_message_bytes=len(data) - 10, max_header_bytes=real - 1)
    with pytest.raises(OversizedMessage, match=f"message of {len(data)} bytes exceeds"):
        decode_message(data, limits=under, allowance=lambda s, k: len(data))


# ---------------------------------------------------------------- every limit at its edge


def two_tensors() -> Message:
    return message(tensors={"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)})


def header_len(data: bytes) -> int:
    return PREFIX.unpack_from(data)[5]


def test_each_limit_takes_a_message_at_it_and_refuses_one_past_it() -> None:
    """Two tensors of 6 and 4 elements (24 + 16 bytes decoded, 2 dims at most): each limit
    set to exactly what the message needs passes, one less refuses in its own words."""
    data = encode_message(two_tensors())
    at = {"max_tensors": 2, "max_tensor_elements": 6, "max_ndim": 2,
          "max_decoded_bytes": 40, "max_header_bytes": header_len(data)}
    assert decode_message(data, limits=Limits(**at)).tensors["a"].shape == (2, 3)
    refusals = {"max_tensors": "2 tensors exceed 1",
                "max_tensor_elements": "tensor a has 6 elements",
                "max_ndim": "tensor a has 2 dims > 1",
                "max_decoded_bytes": "tensors would decode to more than 39 bytes",
                "max_header_bytes": f"header of {at['max_header_bytes']} bytes exceeds "
                                    f"{at['max_header_bytes'] - 1}"}
    for name, words in refusals.items():
        with pytest.raises(OversizedMessage, match=words):
            decode_message(data, limits=Limits(**{**at, name: at[name] - 1}))


def test_a_tensor_named_twice_is_refused() -> None:
    descriptor = TensorDescriptor(name="x", dtype="float32", shape=[2], codec="fp32",
                                  length=8)
    with pytest.raises(MalformedHeader, match="tensor x appears twice"):
        check_descriptors([descriptor, descriptor], 16, Limits())


# ---------------------------------------------------------------- more of the header


def test_a_meta_key_holds_at_most_4096_characters() -> None:
    assert "k" * 4096 in parse_header(raw(header(meta={"k" * 4096: 1})), Limits()).meta
    with pytest.raises(MalformedHeader, match="meta"):
        parse_header(raw(header(meta={"k" * 4097: 1})), Limits())


def test_sequence_zero_is_a_sequence_and_a_negative_length_is_not() -> None:
    assert parse_header(raw(header(seq=0)), Limits()).seq == 0
    descriptor = {"name": "x", "dtype": "float32", "shape": [0], "codec": "fp32",
                  "length": -1}
    with pytest.raises(MalformedHeader, match="tensors"):
        parse_header(raw(header(tensors=[descriptor])), Limits())


def test_a_header_refusal_names_its_first_bad_field() -> None:
    with pytest.raises(MalformedHeader, match="header field run: "):
        parse_header(raw({"seq": -1, "sender": "a0", "ts": 1.0}), Limits())


@pytest.mark.parametrize(("meta", "why"), [({"x": float("nan")}, "Out of range float"),
                                           ({"x": {1, 2}}, "set is not JSON")])
def test_a_header_that_is_not_json_is_refused_at_encoding(meta: dict, why: str) -> None:
    with pytest.raises(MalformedHeader, match=f"header is not JSON-serialisable: .*{why}"):
        encode_message(message(meta=meta))


def test_an_unstamped_message_is_stamped_when_encoded_and_unsigned() -> None:
    bare = Message(MessageType.ACK, "r", "a0", 1)
    assert (bare.ts, bare.signed) == (0.0, False)
    before = time.time()
    stamped = decode_message(encode_message(bare)).ts
    assert before <= stamped <= time.time()
    assert decode_message(encode_message(message())).ts == 1700000000.5


# ---------------------------------------------------------------- the prefix and signatures


def test_the_prefix_alone_names_the_type_and_a_byte_less_is_truncated() -> None:
    data = encode_message(message())
    assert peek_type(data[:PREFIX.size]) == MessageType.REPLY
    with pytest.raises(TruncatedMessage, match="shorter than its prefix"):
        peek_type(data[:PREFIX.size - 1])


@pytest.mark.parametrize("magic", [b"AAAA", b"ZZZZ", b"JSPM", b"JSPK"])
def test_any_other_magic_is_refused(magic: bytes) -> None:
    data = magic + encode_message(message())[4:]
    with pytest.raises(BadMagic):
        decode_message(data)


@pytest.mark.parametrize("pad", range(8))
def test_a_fleet_signature_verifies_at_every_length(pad: int) -> None:
    data = encode_message(message(pad), fleet_key=KEY)
    assert decode_message(data, fleet_key=KEY).meta == {"pad": "x" * pad}
    with pytest.raises(BadSignature, match="HMAC mismatch"):
        decode_message(data, fleet_key=b"another key")


def test_a_fleet_signed_message_is_no_device_signature() -> None:
    pytest.importorskip("cryptography")
    from jetsplit.identity import KeyRing

    with pytest.raises(BadSignature, match="without a device signature"):
        decode_message(encode_message(message(), fleet_key=KEY), keyring=KeyRing({}))


@pytest.mark.parametrize("length", [63, 65])
def test_a_signer_must_give_64_bytes(length: int) -> None:
    class Short:
        def sign(self, data: bytes) -> bytes:
            return b"s" * length

    with pytest.raises(ValueError, match="an Ed25519 signature has 64 bytes"):
        encode_message(message(), signer=Short())
