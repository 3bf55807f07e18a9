"""Tensor codecs for the wire: fp32 (raw), fp16, bf16, int8 (affine), each optionally lz4/zstd.

Pure NumPy on purpose: the wire layer must not need torch, and decoding untrusted bytes
must only ever build plain arrays. A codec turns an array into (parameters, payload bytes);
the parameters travel in the envelope header's tensor descriptor.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Tuple, Union

import numpy as np

from jetsplit.wire.errors import CodecError

CODECS = ("fp32", "fp16", "bf16", "int8")
COMPRESSIONS = ("none", "lz4", "zstd")
# dtypes the wire carries exactly (raw); float codecs apply to floating arrays only.
RAW_DTYPES = ("float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


@dataclass(frozen=True)
class Encoded:
    """One encoded tensor: how to decode it, and its payload."""

    dtype: str  # dtype of the decoded array
    shape: Tuple[int, ...]
    codec: str  # "raw" for non-float arrays, else one of CODECS
    compression: str
    payload: Union[bytes, memoryview]
    params: Tuple[float, ...] = ()  # int8: per-channel (min, scale) pairs


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even truncation of fp32 to its top 16 bits (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _channel_view(x: np.ndarray) -> np.ndarray:
    """int8 ranges are per channel (axis 1) for 4-D activations, per tensor otherwise."""
    if x.ndim == 4:
        return np.moveaxis(x, 1, 0).reshape(x.shape[1], -1)
    return x.reshape(1, -1)


_DEQUANT_BLOCK = 1 << 20  # elements per float64 block while dequantising


def _quantize_int8(x: np.ndarray) -> tuple[bytes, tuple[float, ...]]:
    rows = _channel_view(x.astype(np.float32, copy=False))
    if rows.size and not np.isfinite(rows).all():
        raise CodecError("int8 codec cannot encode NaN or infinity")
    lo = rows.min(axis=1) if rows.shape[1] else np.zeros(rows.shape[0], np.float32)
    hi = rows.max(axis=1) if rows.shape[1] else np.zeros(rows.shape[0], np.float32)
    scale = (hi.astype(np.float64) - lo) / 255.0
    scale[scale == 0] = 1.0
    q = np.rint((rows - lo[:, None]) / scale[:, None]) - 128.0
    q = np.clip(q, -128, 127).astype(np.int8)
    if x.ndim == 4:
        q = np.moveaxis(q.reshape(x.shape[1], x.shape[0], *x.shape[2:]), 0, 1)
    params = tuple(float(v) for pair in zip(lo, scale) for v in pair)
    return np.ascontiguousarray(q).tobytes(), params


def _dequantize_int8(q: np.ndarray, shape: tuple[int, ...], params: tuple[float, ...]
                     ) -> np.ndarray:
    """float32 output, computed in float64 a block at a time: the peak stays at the output
    plus one block instead of 12 bytes per element (a 256 MiB int8 tensor once took 1.2 GB)."""
    channels = shape[1] if len(shape) == 4 else 1
    if len(params) != 2 * channels:
        raise CodecError(f"int8 tensor needs {2 * channels} range parameters, got {len(params)}")
    pairs = np.asarray(params, dtype=np.float64).reshape(channels, 2)
    if not np.isfinite(pairs).all():
        raise CodecError("int8 range parameters must be finite")
    out = np.empty(shape, dtype=np.float32)
    flat_in, flat_out = q.reshape(-1), out.reshape(-1)
    plane = int(np.prod(shape[2:])) if len(shape) == 4 else max(1, flat_in.size)
    lo, scale = pairs[:, 0], pairs[:, 1]
    for start in range(0, flat_in.size, _DEQUANT_BLOCK):
        stop = min(start + _DEQUANT_BLOCK, flat_in.size)
        channel = (np.arange(start, stop, dtype=np.int64) // max(1, plane)) % channels
        block = flat_in[start:stop].astype(np.float64) + 128.0
        flat_out[start:stop] = block * scale[channel] + lo[channel]
    return out


def _compress(data: bytes | memoryview, compression: str) -> bytes | memoryview:
    if compression == "none":
        return data
    if compression == "lz4":
        import lz4.frame

        return lz4.frame.compress(bytes(data))
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=3).compress(bytes(data))
    raise CodecError(f"unknown compression {compression!r}; choose one of {COMPRESSIONS}")


_STREAM_BLOCK = 1 << 20


def _decompress(data: bytes | memoryview, compression: str, expected: int
                ) -> bytes | bytearray | memoryview:
    """Decompress at most `expected` bytes, streamed: a decompression bomb is cut off after
    `expected + 1` bytes of output, never expanded further."""
    if compression == "none":
        out = data
    elif compression == "lz4":
        import lz4.frame

        try:
            decompressor = lz4.frame.LZ4FrameDecompressor()
            out = decompressor.decompress(bytes(data), max_length=expected)
            if not decompressor.eof or decompressor.unused_data:
                raise CodecError("lz4 payload is longer or shorter than its descriptor says")
        except RuntimeError as exc:
            raise CodecError(f"lz4 payload is corrupt: {_first_line(exc)}") from None
    elif compression == "zstd":
        import zstandard

        try:
            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(bytes(data)))
            buffer = bytearray(expected)  # the caller bounded `expected` before calling
            view, got = memoryview(buffer), 0
            while got < expected:
                n = reader.readinto(view[got:got + _STREAM_BLOCK])
                if not n:
                    break
                got += n
            view.release()
            if got < expected:
                raise CodecError(f"payload decodes to {got} bytes, descriptor says {expected}")
            if reader.read(1):
                raise CodecError(f"payload decodes to more than the {expected} bytes its "
                                 "descriptor says")
            out = buffer
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd payload is corrupt: {_first_line(exc)}") from None
    else:
        raise CodecError(f"unknown compression {compression!r}")
    if len(out) != expected:
        raise CodecError(f"payload decodes to {len(out)} bytes, descriptor says {expected}")
    return out


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def encode(x: np.ndarray, codec: str = "fp32", compression: str = "none") -> Encoded:
    """Encode an array. Float arrays use `codec`; other dtypes travel raw and exact."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    if compression not in COMPRESSIONS:
        raise CodecError(f"unknown compression {compression!r}; choose one of {COMPRESSIONS}")
    x = np.asarray(x)
    dtype = x.dtype.name
    if dtype not in RAW_DTYPES and dtype != "float16":
        raise CodecError(f"dtype {dtype} cannot travel on the wire")
    params: tuple[float, ...] = ()
    if not np.issubdtype(x.dtype, np.floating):
        used, payload = "raw", memoryview(np.ascontiguousarray(x)).cast("B")
    elif codec == "fp32":
        used = "fp32"
        x32 = np.ascontiguousarray(x, dtype=np.float32)  # no copy when already fp32 contiguous
        payload = memoryview(x32).cast("B")
    elif codec == "fp16":
        used, payload = "fp16", x.astype(np.float16).tobytes()
    elif codec == "bf16":
        used, payload = "bf16", _f32_to_bf16_bits(x).tobytes()
    else:
        used = "int8"
        payload, params = _quantize_int8(x)
    out_dtype = "float32" if used in CODECS else dtype
    return Encoded(out_dtype, tuple(int(d) for d in x.shape), used, compression,
                   _compress(payload, compression), params)


_ITEM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def element_count(shape: tuple[int, ...]) -> int:
    """Elements of a shape in exact Python integers (NumPy's int64 product wraps around)."""
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def decoded_nbytes(dtype: str, shape: tuple[int, ...], codec: str) -> int:
    """Bytes the uncompressed payload must have; validates dtype/codec pairs."""
    count = element_count(shape)
    if codec == "raw":
        if dtype not in RAW_DTYPES and dtype != "float16":
            raise CodecError(f"dtype {dtype!r} cannot travel on the wire")
        return count * np.dtype(dtype).itemsize
    if codec not in _ITEM_BYTES:
        raise CodecError(f"unknown codec {codec!r}")
    if dtype != "float32":
        raise CodecError(f"codec {codec} decodes to float32, descriptor says {dtype!r}")
    return count * _ITEM_BYTES[codec]


def output_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes the decoded array occupies (float codecs decode to float32)."""
    return element_count(shape) * np.dtype(dtype).itemsize


def decode(
    payload: bytes | memoryview,
    dtype: str,
    shape: tuple[int, ...],
    codec: str,
    compression: str = "none",
    params: tuple[float, ...] = (),
    max_bytes: int | None = None,
) -> np.ndarray:
    """Decode one tensor from untrusted bytes; every mismatch is a CodecError.

    Sizes are checked before anything is decompressed or allocated: the payload may expand
    to at most `max_bytes` (the caller's limit), and to exactly what the descriptor says."""
    expected = decoded_nbytes(dtype, shape, codec)
    if max_bytes is not None and max(expected, output_nbytes(dtype, shape)) > max_bytes:
        raise CodecError(f"tensor of shape {list(shape)} would decode to more than "
                         f"{max_bytes} bytes")
    raw = _decompress(payload, compression, expected)
    try:
        if codec == "raw":
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
        if codec == "fp32":
            return np.frombuffer(raw, dtype=np.float32).reshape(shape)
        if codec == "fp16":
            return np.frombuffer(raw, dtype=np.float16).astype(np.float32).reshape(shape)
        if codec == "bf16":
            return _bf16_bits_to_f32(np.frombuffer(raw, dtype=np.uint16)).reshape(shape)
        return _dequantize_int8(np.frombuffer(raw, dtype=np.int8), shape, params)
    except (ValueError, OverflowError, TypeError) as exc:  # shape/dtype combinations NumPy refuses
        raise CodecError(f"tensor of shape {list(shape)} does not decode: {_first_line(exc)}"
                         ) from None
