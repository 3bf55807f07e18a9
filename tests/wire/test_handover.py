"""Handing a message over by reference (jetsplit/wire/handover.py) is decoding its encoding
without the body: the same header, meta, tensors and checks, the same length booked, and
read-only tensors a receiver cannot write through."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jetsplit.wire import Limits, Message, MessageType, decode_message, encode_message
from jetsplit.wire.handover import hand_over


def reply(**tensors: np.ndarray) -> Message:
    return Message(MessageType.REPLY, run="r", sender="a0", seq=7, round=1, step=2,
                   kind="forward", meta={"re": 3, "samples": 2}, tensors=tensors, ts=5.0)


def test_the_booked_length_is_the_encodings_counted_by_hand() -> None:
    """2 int64 labels and 2×3 float32 activations: prefix 20 B, this JSON header, body
    2×8 + 6×4 = 40 B, CRC 4 B."""
    msg = reply(labels=np.array([1, 0]), activations=np.ones((2, 3), np.float32))
    header = (
        '{"run":"r","round":1,"step":2,"seq":7,"sender":"a0","ts":5.0,"kind":"forward",'
        '"tensors":[{"name":"labels","dtype":"int64","shape":[2],"codec":"raw",'
        '"compression":"none","length":16,"params":[]},{"name":"activations",'
        '"dtype":"float32","shape":[2,3],"codec":"fp32","compression":"none","length":24,'
        '"params":[]}],"meta":{"re":3,"samples":2}}')
    assert json.loads(header)  # what the hand count is of
    handed = hand_over(msg)
    assert handed is not None
    assert handed.nbytes == 20 + len(header) + 40 + 4 == 402  # a 338-byte header
    assert handed.nbytes == len(encode_message(msg))
    assert handed.header == header.encode()


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float64).reshape(3, 4),     # fp32 codec: travels as float32
    np.arange(6, dtype=np.float16),
    np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, ::2],  # not contiguous
    np.float32(2.5) * np.ones(()),                     # 0-d
    np.array([True, False]), np.arange(5, dtype=np.uint8), np.arange(4, dtype=np.int32),
])
def test_receiving_gives_what_decoding_the_encoding_gives(array: np.ndarray) -> None:
    msg = reply(x=array)
    decoded = decode_message(encode_message(msg))
    handed = hand_over(msg)
    assert handed is not None
    got = handed.receive()
    assert handed.nbytes == len(encode_message(msg))
    assert (got.type, got.key, got.kind, got.meta, got.ts) == (
        decoded.type, decoded.key, decoded.kind, decoded.meta, decoded.ts)
    x, want = got.tensors["x"], decoded.tensors["x"]
    assert (x.dtype, x.shape, x.tobytes()) == (want.dtype, want.shape, want.tobytes())
    assert not x.flags.writeable and not want.flags.writeable


def test_meta_crosses_as_json_as_on_the_wire() -> None:
    msg = Message(MessageType.COMMAND, run="r", sender="coordinator", seq=1, kind="train",
                  meta={"steps": (1, 2), "lr": 0.5}, ts=1.0)
    handed = hand_over(msg)
    assert handed is not None
    assert handed.receive().meta == decode_message(encode_message(msg)).meta == {
        "steps": [1, 2], "lr": 0.5}


@pytest.mark.parametrize(("codec", "compression", "array"), [
    ("fp16", "none", np.ones(3, np.float32)),   # lossy: only the codec says what arrives
    ("int8", "none", np.ones(3, np.float32)),
    ("fp32", "lz4", np.ones(3, np.float32)),    # compressed: only the codec says the length
    ("fp32", "none", np.arange(3, dtype=">i8")),  # non-native bytes travel raw
    ("fp32", "none", np.zeros((0, 3), np.float32)),  # the encoder refuses it: let it say so
])
def test_only_exact_codecs_hand_over(codec: str, compression: str, array: np.ndarray) -> None:
    assert hand_over(reply(x=array), codec=codec, compression=compression) is None


def test_integers_hand_over_whatever_the_float_codec() -> None:
    assert hand_over(reply(labels=np.arange(3)), codec="int8") is not None


def test_the_receivers_checks_still_apply() -> None:
    """Oversized without an allowance, over the allowance, a bad tensor name: refused with
    the error the decoder gives."""
    big = reply(x=np.zeros(1000, np.float32))
    small = Limits(max_message_bytes=1024, max_decoded_bytes=1024)
    handed = hand_over(big)
    assert handed is not None
    for allowance in (None, lambda sender, kind: 2000 if kind == "forward" else None,
                      lambda sender, kind: 3000 if sender == "a1" else None):
        with pytest.raises(Exception) as wire:
            decode_message(encode_message(big), limits=small, allowance=allowance)
        with pytest.raises(type(wire.value), match=str(wire.value)):
            handed.receive(small, allowance)
    assert handed.receive(small, lambda s, k: 8000).tensors["x"].shape == (1000,)
    bad = hand_over(reply(**{"no spaces": np.zeros(2, np.float32)}))
    assert bad is not None
    with pytest.raises(Exception) as wire:
        decode_message(encode_message(reply(**{"no spaces": np.zeros(2, np.float32)})))
    with pytest.raises(type(wire.value)):
        bad.receive()


def test_a_receiver_cannot_write_through_what_it_was_handed() -> None:
    sent = np.arange(4, dtype=np.float32)
    handed = hand_over(reply(x=sent))
    assert handed is not None
    got = handed.receive().tensors["x"]
    assert np.shares_memory(got, sent)  # by reference: no copy …
    with pytest.raises(ValueError, match="read-only"):
        got[0] = 99.0  # … and no write through it
    with pytest.raises(ValueError, match="read-only"):
        np.add(got, 1, out=got)
    assert sent.tolist() == [0.0, 1.0, 2.0, 3.0] and sent.flags.writeable
