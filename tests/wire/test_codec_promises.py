"""What the tensor codecs promise, with hand-computed values (each test fails when the code
is wrong in a plausible way): bf16 rounds to nearest even and a NaN stays a NaN; int8 maps
each channel's range onto all 256 levels, within half a step, for empty tensors too; a
payload or parameter list of the wrong length is refused in one exact line; names that
arrive from a parsed header (not interned literals) select the same codec; a size limit
holds at its edge and counts the decoded float32, not the smaller payload. Torch-free."""

from __future__ import annotations

import dataclasses
import tracemalloc
import warnings

import numpy as np
import pytest

from jetsplit.wire import codecs
from jetsplit.wire.codecs import decode, encode, output_nbytes
from jetsplit.wire.errors import CodecError

pytestmark = pytest.mark.device_pure


def parsed(name: str) -> str:
    """`name` as a header parser hands it over: an equal string, not the same object."""
    text = "".join(list(name))
    assert text == name
    if len(name) > 1:
        assert text is not name
    return text


def roundtrip(x: np.ndarray, codec: str, compression: str = "none") -> np.ndarray:
    enc = encode(x, codec, compression)
    return decode(bytes(enc.payload), enc.dtype, enc.shape, enc.codec, enc.compression,
                  enc.params)


def f32(bits: int) -> np.ndarray:
    return np.array([bits], dtype=np.uint32).view(np.float32)


def bf16_bits(x: np.ndarray) -> list[int]:
    return np.frombuffer(bytes(encode(x, "bf16").payload), dtype=np.uint16).tolist()


# ---------------------------------------------------------------- bf16


@pytest.mark.parametrize(("bits", "expected"), [
    (0x3F808000, 0x3F80),  # a tie, bit 16 even (0x3F80): stays
    (0x3F818000, 0x3F82),  # a tie, bit 16 odd (0x3F81): up to even
    (0x3F808001, 0x3F81),  # just above the tie: up
    (0x3F807FFF, 0x3F80),  # just below the tie: down
    (0xBF818000, 0xBF82),  # negative, odd tie: away from zero to even
])
def test_bf16_rounds_to_nearest_even(bits: int, expected: int) -> None:
    assert bf16_bits(f32(bits)) == [expected]


@pytest.mark.parametrize("bits", [0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001])
def test_bf16_keeps_every_nan_a_nan_as_the_canonical_quiet_nan(bits: int) -> None:
    """Rounding 0x7FFFFFFF's low half would carry into the sign (0x8000: -0.0), and
    0xFFFFFFFF's past 32 bits (0x0000: +0.0); 0x7F800001 (a signalling NaN) would round to
    infinity."""
    assert bf16_bits(f32(bits)) == [0x7FC0]
    assert np.isnan(roundtrip(f32(bits), "bf16")).all()


# ---------------------------------------------------------------- int8


def test_int8_uses_all_256_levels_and_decodes_the_ends_exactly() -> None:
    """Range [-1, 2.4] over 255 steps: the minimum is level -128, the maximum 127, and
    both decode to themselves; every value within half a step."""
    x = np.array([-1.0, 0.3, 2.4, 1.1], dtype=np.float32)
    enc = encode(x, "int8")
    step = (2.4 - -1.0) / 255
    assert enc.params == pytest.approx((-1.0, step))
    q = np.frombuffer(bytes(enc.payload), dtype=np.int8)
    assert q[0] == -128 and q[2] == 127
    out = roundtrip(x, "int8")
    assert out[[0, 2]] == pytest.approx([-1.0, 2.4], abs=1e-6)
    assert np.abs(out - x).max() <= step / 2 + 1e-6


def test_int8_rounds_to_the_nearest_level_not_down() -> None:
    """Range [0, 255]: one level per unit; 10.7 is level 11 (10.7 - 0.3 would floor to 10)."""
    x = np.array([0.0, 10.7, 255.0], dtype=np.float32)
    assert roundtrip(x, "int8").tolist() == pytest.approx([0.0, 11.0, 255.0], abs=1e-4)


def test_int8_of_a_constant_tensor_is_exact_and_warns_nothing() -> None:
    x = np.full((2, 3, 2, 2), 0.5, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enc = encode(x, "int8")
        out = roundtrip(x, "int8")
    assert np.frombuffer(bytes(enc.payload), dtype=np.int8).tolist() == [-128] * x.size
    assert enc.params == (0.5, 1.0) * 3
    assert out.tolist() == x.tolist()


@pytest.mark.parametrize("shape", [(0, 3, 2, 2), (0,), (4, 0)])
def test_int8_of_an_empty_tensor_round_trips(shape: tuple[int, ...]) -> None:
    """An empty 4-D batch still has its channels' ranges (three pairs), as decode asks."""
    x = np.zeros(shape, dtype=np.float32)
    enc = encode(x, "int8")
    assert len(enc.params) == 2 * (shape[1] if len(shape) == 4 else 1)
    assert roundtrip(x, "int8").shape == shape


@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 2, 2, 2, 2), (5,)])
def test_int8_ranges_are_per_tensor_unless_four_dimensional(shape: tuple[int, ...]) -> None:
    """One (lo, scale) pair for a 3-D or 5-D tensor, kept in its own element order."""
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 0.5
    enc = encode(x, "int8")
    assert len(enc.params) == 2
    step = float(x.max() - x.min()) / 255
    assert np.abs(roundtrip(x, "int8") - x).max() <= step / 2 + 1e-6


def test_int8_with_more_channels_than_small_integers_round_trips() -> None:
    """200 channels: 400 range parameters (an identity check of small cached integers
    would pass 6 and fail 400)."""
    x = np.linspace(-3, 3, 400, dtype=np.float32).reshape(2, 200, 1, 1)
    enc = encode(x, "int8")
    assert len(enc.params) == 400
    assert np.abs(roundtrip(x, "int8") - x).max() <= 1e-6


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_refuses_what_it_cannot_range(bad: float) -> None:
    with pytest.raises(CodecError, match="int8 codec cannot encode NaN or infinity"):
        encode(np.array([1.0, bad, 2.0], dtype=np.float32), "int8")


@pytest.mark.parametrize("given", [4, 8])
def test_int8_range_parameters_must_be_exactly_two_per_channel(given: int) -> None:
    enc = encode(np.ones((1, 3, 2, 2), dtype=np.float32), "int8")
    with pytest.raises(CodecError) as err:
        decode(bytes(enc.payload), "float32", enc.shape, "int8", params=(0.0, 1.0) * (given // 2))
    assert str(err.value) == f"int8 tensor needs 6 range parameters, got {given}"


def test_int8_dequantises_each_channel_with_its_own_range_across_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three channels of 5 × 1 planes, dequantised 4 elements at a time: the blocks
    start mid-plane, and every element still takes its own channel's (lo, scale)."""
    monkeypatch.setattr(codecs, "_DEQUANT_BLOCK", 4)
    q = np.full((2, 3, 5, 1), -128, dtype=np.int8)
    params = (1.0, 0.5, 10.0, 0.5, 100.0, 0.5)
    out = decode(q.tobytes(), "float32", q.shape, "int8", params=params)
    assert out[:, 0].ravel().tolist() == [1.0] * 10
    assert out[:, 1].ravel().tolist() == [10.0] * 10
    assert out[:, 2].ravel().tolist() == [100.0] * 10


def test_int8_dequantises_a_block_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 Mi elements, 2**20 a block: the float64 work over the output costs a quarter of
    what one pass over the whole tensor costs (per element of a block, the same bytes
    whatever NumPy's temporaries are), never half or more."""
    q = np.zeros((4, 4, 512, 512), dtype=np.int8)
    payload = q.tobytes()

    def overhead(block: int) -> int:
        monkeypatch.setattr(codecs, "_DEQUANT_BLOCK", block)
        tracemalloc.start()
        try:
            out = decode(payload, "float32", q.shape, "int8", params=(0.0, 1.0) * 4)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert out.shape == q.shape and float(out.max()) == 128.0
        return peak - out.nbytes

    blocked = overhead(codecs._DEQUANT_BLOCK)
    assert 0 < blocked <= 0.3 * overhead(q.size)


# ---------------------------------------------------------------- lengths and names


def test_a_short_zstd_payload_is_refused_not_padded() -> None:
    pytest.importorskip("zstandard")
    x = np.arange(6, dtype=np.float32)
    enc = encode(x, "fp32", "zstd")
    with pytest.raises(CodecError, match="payload decodes to 24 bytes, descriptor says 32"):
        decode(bytes(enc.payload), "float32", (8,), "fp32", "zstd")


def test_a_long_uncompressed_payload_is_refused_by_its_length() -> None:
    with pytest.raises(CodecError, match="payload decodes to 28 bytes, descriptor says 24"):
        decode(np.zeros(7, np.float32).tobytes(), "float32", (6,), "fp32")


def test_a_short_uncompressed_payload_is_refused_by_its_length() -> None:
    with pytest.raises(CodecError, match="payload decodes to 20 bytes, descriptor says 24"):
        decode(np.zeros(5, np.float32).tobytes(), "float32", (6,), "fp32")


@pytest.mark.parametrize("extra", [b"\x00", b"garbage"])
def test_an_lz4_payload_with_bytes_after_its_frame_is_refused(extra: bytes) -> None:
    pytest.importorskip("lz4")
    enc = encode(np.arange(6, dtype=np.float32), "fp32", "lz4")
    with pytest.raises(CodecError, match="lz4 payload is longer or shorter"):
        decode(bytes(enc.payload) + extra, "float32", (6,), "fp32", "lz4")


def test_a_truncated_lz4_frame_is_refused() -> None:
    pytest.importorskip("lz4")
    enc = encode(np.arange(64, dtype=np.float32), "fp32", "lz4")
    with pytest.raises(CodecError, match="lz4 payload is"):
        decode(bytes(enc.payload)[:-6], "float32", (64,), "fp32", "lz4")


def test_a_library_error_is_reported_by_its_first_line() -> None:
    assert codecs._first_line(ValueError("frame header\nat byte 7")) == "frame header"
    assert codecs._first_line(ValueError("")) == "ValueError"


@pytest.mark.parametrize("dtype", [np.complex64, np.uint16, np.uint32, np.complex128])
def test_dtypes_the_wire_does_not_carry_are_refused_at_encoding(dtype: type) -> None:
    name = np.dtype(dtype).name
    with pytest.raises(CodecError, match=f"dtype {name} cannot travel on the wire"):
        encode(np.zeros(3, dtype=dtype))


def test_a_float16_array_travels_under_each_float_codec() -> None:
    x = np.array([0.5, -2.0, 3.0], dtype=np.float16)
    for codec in ("fp32", "fp16", "bf16", "int8"):
        assert roundtrip(x, codec).tolist() == pytest.approx([0.5, -2.0, 3.0], abs=0.02)


@pytest.mark.parametrize("compression", ["brotli", "gzip", "zzz"])
def test_an_unknown_compression_is_named_not_tried(compression: str) -> None:
    with pytest.raises(CodecError, match=f"unknown compression '{compression}'"):
        decode(b"\x00" * 8, "float32", (2,), "fp32", compression)


@pytest.mark.parametrize("codec", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_names_from_a_parsed_header_select_the_same_codec(codec: str, compression: str
                                                          ) -> None:
    pytest.importorskip({"none": "numpy", "lz4": "lz4", "zstd": "zstandard"}[compression])
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 2, 2)
    enc = encode(x, parsed(codec), parsed(compression))
    assert enc.codec == codec
    out = decode(bytes(enc.payload), parsed(enc.dtype), enc.shape, parsed(enc.codec),
                 parsed(enc.compression), enc.params)
    assert out.tolist() == roundtrip(x, codec, compression).tolist()


def test_raw_arrays_decode_under_a_parsed_codec_name() -> None:
    x = np.arange(5, dtype=np.int64)
    enc = encode(x)
    assert enc.codec == "raw"
    out = decode(bytes(enc.payload), parsed("int64"), enc.shape, parsed("raw"))
    assert out.tolist() == [0, 1, 2, 3, 4]
    half = np.array([1.5, -0.25], dtype=np.float16)  # a raw float16 descriptor decodes too
    out = decode(half.tobytes(), parsed("float16"), (2,), parsed("raw"))
    assert out.dtype == np.float16 and out.tolist() == [1.5, -0.25]


# ---------------------------------------------------------------- size limits


def test_output_bytes_by_hand() -> None:
    assert output_nbytes("float32", (3, 5)) == 60
    assert output_nbytes("int64", (7,)) == 56
    assert output_nbytes("uint8", (2, 2, 2)) == 8


def test_the_limit_counts_the_decoded_float32_of_a_half_precision_payload() -> None:
    """12 fp16 values: a 24-byte payload that decodes to 48 bytes. A 47-byte limit
    refuses it; 48, the exact size, takes it."""
    x = np.ones(12, dtype=np.float32)
    enc = encode(x, "fp16")
    assert len(bytes(enc.payload)) == 24
    with pytest.raises(CodecError, match="more than 47 bytes"):
        decode(bytes(enc.payload), "float32", (12,), "fp16", max_bytes=47)
    assert decode(bytes(enc.payload), "float32", (12,), "fp16", max_bytes=48).tolist() == \
        [1.0] * 12


def test_an_encoded_tensor_cannot_be_altered_after_the_fact() -> None:
    enc = encode(np.ones(2, dtype=np.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        enc.codec = "int8"  # type: ignore[misc]
