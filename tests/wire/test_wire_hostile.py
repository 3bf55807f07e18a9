"""Hostile input against the wire decoder: fuzzed frames, decompression bombs, sizes that
overflow, non-finite numbers, and one sender trying to starve the reassembler for others."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from jetsplit.wire import (
    Limits,
    Message,
    MessageType,
    Reassembler,
    ReplayGuard,
    WireError,
    chunk_message,
    decode_message,
    encode_message,
)
from jetsplit.wire import errors as wire_errors
from jetsplit.wire.envelope import DEFAULT_MAX_MESSAGE_BYTES

import wire_fuzz as fuzz  # testing/ (see conftest.py)

# torch-free device side: `.ci/run` also runs this on Python 3.9
pytestmark = pytest.mark.device_pure

# Peak Python-heap growth allowed while fuzzing: every fuzz frame is under 64 KB, so no
# frame may make the decoder hold more than a few MiB (the limit itself is 64 MiB).
FUZZ_PEAK_BYTES = 16 * 1024 * 1024
# A rejected bomb may cost its compressed bytes and a bounded read, never its expansion.
BOMB_PEAK_BYTES = 4 * 1024 * 1024


def _fuzz(frames: int, seed: int) -> None:
    tracemalloc.start()
    try:
        for key in (None, fuzz.FUZZ_KEY):
            counts = fuzz.run(frames, seed, key=key)  # an untyped exception fails the test
            rejected = frames - counts.get("accepted", 0)
            assert rejected > 0.85 * frames
            assert {"MalformedHeader", "CodecError", "OversizedMessage"} <= set(counts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < FUZZ_PEAK_BYTES, f"fuzzing peaked at {peak / 2**20:.1f} MiB"


def test_a_thousand_fuzzed_frames_raise_only_typed_errors_in_bounded_memory() -> None:
    _fuzz(1_000, seed=7)


@pytest.mark.slow
def test_ten_thousand_fuzzed_frames_per_mode_raise_only_typed_errors() -> None:
    _fuzz(10_000, seed=1234)


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    return fuzz.bombs()


@pytest.mark.parametrize(("name", "error"), [
    ("lying-256MiB", wire_errors.CodecError),
    ("int8-256MiB", wire_errors.OversizedMessage),
    ("raw-512MiB", wire_errors.OversizedMessage),
    ("int8-4d-255MiB", wire_errors.OversizedMessage),
])
def test_decompression_bombs_are_refused_before_they_expand(bombs: dict[str, bytes], name: str,
                                                             error: type) -> None:
    data = bombs[name]
    assert len(data) < 64 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(error):
            decode_message(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BOMB_PEAK_BYTES, f"{name} peaked at {peak / 2**20:.1f} MiB"


def test_a_message_under_the_limit_decodes_and_the_limit_is_configurable(
        bombs: dict[str, bytes]) -> None:
    data = bombs["raw-60MiB-ok"]
    tracemalloc.start()
    try:
        msg = decode_message(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert msg.tensors["labels"].nbytes == 60 << 20
    assert peak <= DEFAULT_MAX_MESSAGE_BYTES + BOMB_PEAK_BYTES
    del msg
    with pytest.raises(wire_errors.OversizedMessage):
        decode_message(data, limits=Limits.of_mib(32))


def _header_frame(tensors: list[dict], body: bytes = b"", **header: object) -> bytes:
    base = {"run": "r", "seq": 1, "sender": "s", "ts": 1.0, "tensors": tensors}
    base.update(header)
    return fuzz.frame(int(MessageType.REPLY), base, body)


@pytest.mark.parametrize("shape", [[2**31, 2**31, 4], [2**31, 2**31, 2**31, 2**31]])
def test_shapes_whose_product_overflows_int64_are_oversized(shape: list[int]) -> None:
    data = _header_frame([{"name": "x", "dtype": "float32", "shape": shape, "codec": "fp32",
                           "length": 0}])
    with pytest.raises(wire_errors.OversizedMessage):
        decode_message(data)


@pytest.mark.parametrize("shape", [[4, 0, 2, 2], [0, 3, 2, 2], [0]])
def test_empty_int8_tensors_decode_to_empty_arrays(shape: list[int]) -> None:
    channels = shape[1] if len(shape) == 4 else 1
    data = _header_frame([{"name": "x", "dtype": "float32", "shape": shape, "codec": "int8",
                           "length": 0, "params": [0.0, 1.0] * channels}])
    out = decode_message(data).tensors["x"]
    assert out.shape == tuple(shape) and out.dtype == np.float32


def test_int8_blockwise_dequantisation_matches_the_float64_formula() -> None:
    from jetsplit.wire import codecs

    x = np.random.default_rng(3).standard_normal((3, 5, 7, 11)).astype(np.float32)
    enc = codecs.encode(x, "int8")
    q = np.frombuffer(enc.payload, np.int8).reshape(x.shape)
    pairs = np.asarray(enc.params).reshape(5, 2)
    reference = ((q.astype(np.float64) + 128.0) * pairs[None, :, 1, None, None]
                 + pairs[None, :, 0, None, None]).astype(np.float32)
    old_block = codecs._DEQUANT_BLOCK
    try:
        codecs._DEQUANT_BLOCK = 13  # many blocks, straddling channel planes
        out = codecs.decode(enc.payload, "float32", x.shape, "int8", params=enc.params)
    finally:
        codecs._DEQUANT_BLOCK = old_block
    assert np.array_equal(out.view(np.uint32), reference.view(np.uint32))


@pytest.mark.parametrize("text", [b'"ts":NaN', b'"ts":Infinity', b'"ts":1e999'])
def test_non_finite_numbers_in_headers_are_malformed(text: bytes) -> None:
    head = b'{"run":"r","seq":1,"sender":"s",' + text + b"}"
    with pytest.raises(wire_errors.MalformedHeader):
        decode_message(fuzz.frame(int(MessageType.ACK), {}, raw_header=head))


def test_a_chunk_index_of_infinity_is_a_typed_error() -> None:
    head = (b'{"run":"r","seq":1,"sender":"s","ts":1.0,"kind":"chunk","meta":{"id":"m",'
            b'"index":Infinity,"count":2,"total":10,"size":5}}')
    with pytest.raises(WireError):
        decode_message(fuzz.frame(int(MessageType.CHUNK), {}, raw_header=head))


@pytest.mark.parametrize("ts", [math.nan, math.inf, -math.inf, 1e300, -1e300])
def test_replay_guard_rejects_non_finite_and_far_off_timestamps(ts: float) -> None:
    with pytest.raises(wire_errors.ReplayedMessage):
        ReplayGuard().check("a0", 1, ts)


def _chunks(sender: str, msg_id: str, nbytes: int, chunk_bytes: int = 8192) -> list[Message]:
    whole = encode_message(Message(MessageType.REPLY, run="r", sender=sender, seq=1,
                                   tensors={"x": np.zeros(nbytes // 4, np.float32)}))
    return [decode_message(c) for c in chunk_message(
        whole, run="r", sender=sender, seq_start=2, msg_id=msg_id, chunk_bytes=chunk_bytes)]


def test_one_flooding_sender_cannot_starve_the_others() -> None:
    """a0 opens 64 never-finished messages; a1's message still reassembles, and a0 holds
    at most its own budget."""
    reassembler = Reassembler(Limits(max_message_bytes=1 << 20), max_in_flight=16,
                              per_sender_in_flight=4)
    for i in range(64):
        assert reassembler.feed(_chunks("a0", f"m{i}", 40_000)[0]) is None
    assert sum(1 for sender, _ in reassembler._partials if sender == "a0") == 4
    assert reassembler.evicted == 60
    done = [reassembler.feed(c) for c in _chunks("a1", "x", 40_000)]
    assert done[-1] is not None and decode_message(done[-1]).sender == "a1"


def test_a_sender_over_its_byte_budget_evicts_only_its_own_messages() -> None:
    reassembler = Reassembler(Limits(max_message_bytes=1 << 20), per_sender_bytes=100_000)
    other = _chunks("a1", "keep", 40_000)
    reassembler.feed(other[0])
    for i in range(8):  # each declares ~40 KB: the budget holds two at a time
        reassembler.feed(_chunks("a0", f"m{i}", 40_000)[0])
    assert sum(p.total for (s, _), p in reassembler._partials.items() if s == "a0") <= 100_000
    results = [reassembler.feed(c) for c in other[1:]]
    assert results[-1] is not None
    with pytest.raises(wire_errors.OversizedMessage, match="budget"):
        reassembler.feed(_chunks("a0", "big", 200_000)[0])


def test_a_sender_repeating_a_chunk_holds_its_bytes_once_and_starves_nobody() -> None:
    """QoS 1 redelivers, and a hostile sender can repeat a chunk on purpose: a repeat is
    idempotent, so a0's 200 copies of its first chunk hold that chunk's bytes once, and
    a1's whole message still fits the shared buffer sized for exactly the two of them."""
    mine, theirs = _chunks("a0", "m", 40_000), _chunks("a1", "x", 40_000)
    first = len(mine[0].tensors["data"])
    their_bytes = sum(len(c.tensors["data"]) for c in theirs)
    reassembler = Reassembler(Limits(max_message_bytes=1 << 20),
                              max_buffered_bytes=first + their_bytes)
    for _ in range(200):
        assert reassembler.feed(mine[0]) is None
    assert reassembler.buffered_bytes == first
    done = [reassembler.feed(c) for c in theirs]
    assert done[-1] is not None and decode_message(done[-1]).sender == "a1"
    assert reassembler.buffered_bytes == first  # a0's partial message, once
    rest = [reassembler.feed(c) for c in mine[1:]]
    assert rest[-1] is not None and reassembler.buffered_bytes == 0


def test_presence_must_be_fresh_and_never_older_than_the_last_one() -> None:
    from jetsplit.wire import PresenceGuard

    guard = PresenceGuard(max_age_s=3600, max_skew_s=60, will_max_age_s=7 * 86400)
    now = 1_000_000.0
    guard.check("a0", 5, now - 10, now=now)
    guard.check("a0", 5, now - 10, now=now)  # the same retained message again: fine
    for seq, ts in ((6, now - 365 * 86400), (7, now + 3600), (8, math.nan), (4, now - 20)):
        with pytest.raises(wire_errors.StalePresence):
            guard.check("a0", seq, ts, now=now)
    guard.check("a0", 9, now, now=now)
    # the last will was built at connect, before the newest online message: still accepted,
    # and ordered among offline messages only
    guard.check("a0", 3, now - 2 * 86400, "offline", now=now)
    with pytest.raises(wire_errors.StalePresence, match="older"):
        guard.check("a0", 2, now - 3 * 86400, "offline", now=now)
    with pytest.raises(wire_errors.StalePresence, match="off now"):
        guard.check("a1", 2, now - 365 * 86400, "offline", now=now)
