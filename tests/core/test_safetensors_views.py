"""The weights reader a bundle loads through: same tensors as safetensors' own loader,
and one clear error for a damaged file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from jetsplit.models.safetensors_views import UnreadableWeights, tensor_views


def _file(header: dict[str, object], data: bytes) -> bytearray:
    text = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(text)) + text + data)


def test_views_equal_safetensors_own_load_for_every_dtype() -> None:
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
               "i": torch.tensor([-3, 2**40], dtype=torch.int64),
               "h": torch.tensor([0.5, -2.25], dtype=torch.float16),
               "b": torch.tensor([1.5, 3.0], dtype=torch.bfloat16),
               "m": torch.tensor([True, False, True]), "empty": torch.zeros(0, 5)}
    raw = save(tensors, metadata={"who": "test"})
    views, reference = tensor_views(bytearray(raw)), load(raw)
    assert sorted(views) == sorted(reference)
    for name, want in reference.items():
        assert views[name].dtype == want.dtype and views[name].shape == want.shape
        assert torch.equal(views[name], want)


def test_a_hand_written_file_reads_as_its_bytes_say() -> None:
    # two float32 values 1.0 and -2.0 (0x3f800000, 0xc0000000 little-endian) as a [1, 2]
    data = struct.pack("<ff", 1.0, -2.0)
    views = tensor_views(_file({"x": {"dtype": "F32", "shape": [1, 2],
                                      "data_offsets": [0, 8]}}, data))
    assert views["x"].tolist() == [[1.0, -2.0]]


@pytest.mark.parametrize(("header", "data", "reason"), [
    ({"x": {"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8,
     "unknown dtype"),
    ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8,
     "bad shape"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8,
     "bad data_offsets"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8,
     "do not hold [3] of F32"),
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8,
     "lie past the 8 bytes of data"),
])
def test_a_damaged_header_is_one_error(header: dict[str, object], data: bytes,
                                       reason: str) -> None:
    with pytest.raises(UnreadableWeights, match=reason.replace("[", r"\[")):
        tensor_views(_file(header, data))


def test_a_header_longer_than_the_file_or_not_json_is_refused() -> None:
    with pytest.raises(UnreadableWeights, match="past the file's end"):
        tensor_views(bytearray(struct.pack("<Q", 100) + b"{}"))
    with pytest.raises(UnreadableWeights, match="not JSON"):
        tensor_views(bytearray(struct.pack("<Q", 2) + b"{x"))
    with pytest.raises(UnreadableWeights, match="8-byte"):
        tensor_views(bytearray(b"\x01"))
