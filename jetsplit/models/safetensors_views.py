"""A safetensors file's tensors as views into the one buffer it was read (and hashed) into.

safetensors' own loader from bytes copies every tensor out of them, so loading a verified
weights file held three copies at once: the file's bytes, the loaded tensors and the
module they are copied into (240 MB at AlexNet's server block). Here the tensors are
views of the buffer (which they keep alive), copied into the module and dropped. The
format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the data.
"""

from __future__ import annotations

import json
import math
import sys

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class UnreadableWeights(ValueError):
    """The buffer is not a safetensors file this reader takes (one-line reason)."""


def tensor_views(buffer: bytearray) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file in `buffer`, as a view into it (checked: a
    header that does not parse, an unknown dtype, or a byte range that does not fit its
    shape or lies outside the data raises UnreadableWeights)."""
    if sys.byteorder != "little":
        raise UnreadableWeights("a big-endian host cannot view little-endian tensors")
    if len(buffer) < 8:
        raise UnreadableWeights("shorter than its 8-byte header length")
    size = int.from_bytes(buffer[:8], "little")
    if size > len(buffer) - 8:
        raise UnreadableWeights(f"header of {size} bytes past the file's end")
    try:
        header = json.loads(bytes(buffer[8:8 + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnreadableWeights(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise UnreadableWeights("header is not a JSON object")
    start, end = 8 + size, len(buffer)
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, first, last = _entry(name, entry)
        count = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if last - first != count * itemsize:
            raise UnreadableWeights(f"tensor {name!r}: bytes [{first}, {last}) do not hold "
                                    f"{shape} of {entry['dtype']}")
        if start + last > end:
            raise UnreadableWeights(f"tensor {name!r}: bytes [{first}, {last}) lie past the "
                                    f"{end - start} bytes of data")
        out[name] = (torch.empty(shape, dtype=dtype) if count == 0 else torch.frombuffer(
            buffer, dtype=dtype, count=count, offset=start + first).view(shape))
    return out


def _entry(name: str, entry: object) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, first byte, end byte) of one header entry, checked."""
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise UnreadableWeights(f"tensor {name!r}: unknown dtype")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise UnreadableWeights(f"tensor {name!r}: bad shape")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
            isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets) \
            or offsets[0] > offsets[1]:
        raise UnreadableWeights(f"tensor {name!r}: bad data_offsets")
    return DTYPES[entry["dtype"]], shape, offsets[0], offsets[1]
