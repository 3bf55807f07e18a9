"""Wire format: codec accuracy as properties, and a decoder that survives hostile bytes."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jetsplit.wire import (
    CODECS,
    COMPRESSIONS,
    Limits,
    Message,
    MessageType,
    Reassembler,
    ReplayGuard,
    SequenceCounter,
    WireError,
    chunk_message,
    decode_message,
    encode_message,
)
from jetsplit.wire import errors as wire_errors

from wire_fuzz import mutate_bytes, seeds  # testing/ (see conftest.py)

# torch-free device side: `.ci/run` also runs this on Python 3.9
pytestmark = pytest.mark.device_pure

FLOAT_DTYPES = [np.float32, np.float64, np.float16]
COMPRESSION = st.sampled_from(COMPRESSIONS)
shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=6)


def arrays_of(dtype: type) -> st.SearchStrategy[np.ndarray]:
    elements = st.floats(-1e3, 1e3, width=16 if dtype is np.float16 else 32,
                         allow_nan=False, allow_infinity=False)
    return hnp.arrays(dtype, shapes, elements=elements)


def roundtrip(x: np.ndarray, codec: str, compression: str) -> np.ndarray:
    msg = Message(MessageType.REPLY, run="run-1", sender="agent-1", seq=1,
                  tensors={"x": x})
    return decode_message(encode_message(msg, codec=codec, compression=compression)).tensors["x"]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOAT_DTYPES), compression=COMPRESSION)
def test_fp32_is_bit_exact(data: st.DataObject, dtype: type, compression: str) -> None:
    x = data.draw(arrays_of(dtype))
    out = roundtrip(x, "fp32", compression)
    assert out.dtype == np.float32 and out.shape == x.shape
    assert np.array_equal(out.view(np.uint32), x.astype(np.float32).view(np.uint32))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOAT_DTYPES), compression=COMPRESSION)
def test_fp16_relative_error_is_within_1e3(data: st.DataObject, dtype: type, compression: str):
    x = data.draw(arrays_of(dtype)).astype(np.float32)
    out = roundtrip(x, "fp16", compression)
    normal = np.abs(x) >= 6.2e-5  # fp16 subnormals carry absolute, not relative, precision
    assert np.all(np.abs(out - x)[normal] <= 1e-3 * np.abs(x)[normal])
    assert np.all(np.abs(out - x)[~normal] <= 6e-8)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOAT_DTYPES), compression=COMPRESSION)
def test_bf16_relative_error_is_within_2_pow_minus_8(data: st.DataObject, dtype: type,
                                                     compression: str) -> None:
    x = data.draw(arrays_of(dtype)).astype(np.float32)
    out = roundtrip(x, "bf16", compression)
    assert np.all(np.abs(out - x) <= 2.0**-8 * np.abs(x) + 1e-38)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOAT_DTYPES), compression=COMPRESSION)
def test_int8_error_is_within_range_over_254_per_channel(data: st.DataObject, dtype: type,
                                                          compression: str) -> None:
    x = data.draw(arrays_of(dtype)).astype(np.float32)
    out = roundtrip(x, "int8", compression)
    rows_in = np.moveaxis(x, 1, 0).reshape(x.shape[1], -1) if x.ndim == 4 else x.reshape(1, -1)
    rows_out = (np.moveaxis(out, 1, 0).reshape(out.shape[1], -1) if out.ndim == 4
                else out.reshape(1, -1))
    span = rows_in.max(axis=1) - rows_in.min(axis=1)
    bound = span / 254 + 1e-6 * np.abs(rows_in).max(axis=1) + 1e-30
    assert np.all(np.abs(rows_out - rows_in).max(axis=1) <= bound)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.bool_, np.int8])
@pytest.mark.parametrize("codec", CODECS)
def test_integer_tensors_travel_exactly_whatever_the_codec(dtype: type, codec: str) -> None:
    x = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    out = roundtrip(x, codec, "zstd")
    assert out.dtype == x.dtype and np.array_equal(out, x)


def test_fp32_decode_is_a_view_into_the_message() -> None:
    x = np.arange(1000, dtype=np.float32)
    raw = encode_message(Message(MessageType.REPLY, run="r", sender="s", seq=1, tensors={"x": x}))
    out = decode_message(raw).tensors["x"]
    assert not out.flags.owndata and not out.flags.writeable


def test_header_fields_and_meta_round_trip() -> None:
    msg = Message(MessageType.COMMAND, run="run-7", sender="coordinator", seq=42, round=3,
                  step=9, kind="forward", meta={"batch": 32, "lr": 0.01, "ids": [1, 2]})
    out = decode_message(encode_message(msg))
    assert (out.type, out.key, out.kind, out.meta) == (
        MessageType.COMMAND, ("run-7", 3, 9, 42, "coordinator"), "forward", msg.meta)


KEY = b"fleet-secret"


def test_signed_messages_need_the_right_key() -> None:
    msg = Message(MessageType.REPLY, run="r", sender="s", seq=1, tensors={"x": np.ones(3)})
    signed = encode_message(msg, fleet_key=KEY)
    assert decode_message(signed, fleet_key=KEY).signed
    with pytest.raises(wire_errors.BadSignature):
        decode_message(signed, fleet_key=b"other")
    with pytest.raises(wire_errors.BadSignature):
        decode_message(encode_message(msg), fleet_key=KEY)
    # Tampering that keeps the CRC valid is still caught by the HMAC.
    tampered = bytearray(signed)
    tampered[-40] ^= 1
    body_end = len(tampered) - 36
    tampered[body_end:body_end + 4] = zlib.crc32(bytes(tampered[:body_end])).to_bytes(4, "big")
    with pytest.raises(wire_errors.BadSignature):
        decode_message(bytes(tampered), fleet_key=KEY)


def test_replay_guard_rejects_repeats_old_and_stale() -> None:
    guard = ReplayGuard(window=8, max_skew_s=10)
    guard.check("a", 100, ts=1000.0, now=1000.0)
    with pytest.raises(wire_errors.ReplayedMessage):
        guard.check("a", 100, ts=1000.0, now=1000.0)
    for seq in range(101, 120):
        guard.check("a", seq, ts=1000.0, now=1000.0)
    with pytest.raises(wire_errors.ReplayedMessage):
        guard.check("a", 105, ts=1000.0, now=1000.0)  # fell out of the window
    with pytest.raises(wire_errors.ReplayedMessage):
        guard.check("a", 500, ts=900.0, now=1000.0)
    guard.check("b", 100, ts=1000.0, now=1000.0)  # per sender


def test_sequence_numbers_keep_rising_across_a_restart() -> None:
    first = SequenceCounter()
    a, b = first.next(), first.next()
    restarted = SequenceCounter()
    assert b == a + 1 and restarted.next() > b


@pytest.mark.parametrize(("run", "sender"), [("r", "s s"), ("", "s"), ("r", "x" * 129)])
def test_bad_identifiers_in_headers_are_rejected(run: str, sender: str) -> None:
    raw = encode_message(Message(MessageType.ACK, run=run, sender=sender, seq=1))
    with pytest.raises(wire_errors.MalformedHeader, match="run|sender"):
        decode_message(raw)


def test_chunking_reassembles_out_of_order_and_ignores_redelivery() -> None:
    x = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    whole = encode_message(Message(MessageType.REPLY, run="r", sender="s", seq=1,
                                   tensors={"x": x}))
    chunks = chunk_message(whole, run="r", sender="s", seq_start=2, msg_id="m", chunk_bytes=65536)
    assert len(chunks) > 10 and max(map(len, chunks)) <= 65536
    order = list(range(len(chunks)))
    random.Random(1).shuffle(order)
    reassembler = Reassembler()
    results = [reassembler.feed(decode_message(chunks[i])) for i in order + order[:3]]
    done = [r for r in results if r is not None]
    assert done == [whole]
    assert np.array_equal(decode_message(done[0]).tensors["x"], x)


def test_reassembly_is_bounded_and_times_out() -> None:
    whole = encode_message(Message(MessageType.REPLY, run="r", sender="s", seq=1,
                                   tensors={"x": np.zeros(50_000, np.float32)}))
    chunks = [decode_message(c) for c in chunk_message(
        whole, run="r", sender="s", seq_start=2, msg_id="m", chunk_bytes=8192)]
    small = Reassembler(per_sender_bytes=len(whole) - 1)
    with pytest.raises(wire_errors.OversizedMessage):
        small.feed(chunks[0])
    full = Reassembler(max_buffered_bytes=len(whole) - 1)
    with pytest.raises(wire_errors.OversizedMessage, match="buffer is full"):
        for chunk in chunks:
            full.feed(chunk)
    capped = Reassembler(Limits(max_message_bytes=1000))
    with pytest.raises(wire_errors.OversizedMessage):
        capped.feed(chunks[0])
    slow = Reassembler(timeout_s=0.0)
    assert slow.feed(chunks[0]) is None
    assert slow.expire(now=float("inf")) == 1


def _valid_messages() -> list[bytes]:
    """The fuzzer's seeds (every codec and compression, a chunk, an ACK) and a signed ACK."""
    return [*seeds(), encode_message(Message(MessageType.ACK, run="r", sender="s", seq=1),
                                     fleet_key=KEY)]


def test_ten_thousand_hostile_inputs_are_rejected_with_typed_errors() -> None:
    rng = random.Random(1234)
    valid = _valid_messages()
    rejected: dict[str, int] = {}
    accepted = 0
    for i in range(10_000):
        if i % 4 == 0:
            # random.randbytes is 3.9+ (this file also runs on 3.8)
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
            if i % 8 == 0:
                data = b"JSPL\x01" + data
        else:
            data = mutate_bytes(rng.choice(valid), rng)
        try:
            decode_message(data, limits=Limits(max_message_bytes=1 << 20))
            accepted += 1  # a mutation can land in padding-free but harmless places (seq, ts)
        except WireError as exc:
            rejected[type(exc).__name__] = rejected.get(type(exc).__name__, 0) + 1
            assert str(exc) and "\n" not in str(exc)
    assert sum(rejected.values()) + accepted == 10_000
    assert sum(rejected.values()) > 9_000
    assert {"BadMagic", "TruncatedMessage", "ChecksumMismatch", "MalformedHeader"} <= set(rejected)
