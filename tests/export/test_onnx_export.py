"""ONNX export: every zoo client block matches PyTorch in ONNX Runtime, with a dynamic batch."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from jetsplit.errors import JetsplitError
from jetsplit.export.onnx_export import compare_onnx, export_onnx
from jetsplit.models import MODEL_NAMES, activation_shape, build_model, split

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

SHAPE = (3, 32, 32)
ATOL = 1e-4


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_client_block_matches_pytorch_legacy_exporter(name: str, tmp_path: Path) -> None:
    model = build_model(name, SHAPE, 10, seed=0)
    client, _ = split(model, 2)
    path = export_onnx(client, SHAPE, tmp_path / "client.onnx", opset=17)
    assert path.is_file()
    assert compare_onnx(client, path, SHAPE, batches=(1, 32)) <= ATOL


def test_dynamo_exporter_matches_pytorch(tmp_path: Path) -> None:
    client, _ = split(build_model("alexnet", SHAPE, 10, seed=0), 2)
    path = export_onnx(client, SHAPE, tmp_path / "client.onnx", opset=18)
    assert compare_onnx(client, path, SHAPE, batches=(1, 32)) <= ATOL
    import onnx

    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == ["input"]
    assert [o.name for o in graph.output] == ["output"]
    assert not graph.input[0].type.tensor_type.shape.dim[0].HasField("dim_value")  # dynamic


def test_legacy_export_names_and_dynamic_batch(tmp_path: Path) -> None:
    import onnx

    client, _ = split(build_model("alexnet", SHAPE, 10, seed=0), 2)
    path = export_onnx(client, SHAPE, tmp_path / "client.onnx", opset=17)
    model = onnx.load(str(path))
    assert model.opset_import[0].version == 17
    graph = model.graph
    assert [i.name for i in graph.input] == ["input"]
    assert [o.name for o in graph.output] == ["output"]
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_token_sequence_input(tmp_path: Path) -> None:
    """A ViT activation is (tokens, dim) per sample: a rank-2 per-sample input exports too."""
    model = build_model("vit-small", SHAPE, 10, seed=0)
    block = nn.Sequential(model[2])
    shape = activation_shape(model, 2)
    assert len(shape) == 2
    path = export_onnx(block, shape, tmp_path / "block.onnx", opset=17)
    assert compare_onnx(block, path, shape, batches=(1, 4)) <= ATOL


def test_export_keeps_training_mode_and_is_quiet(tmp_path: Path, capfd) -> None:
    client, _ = split(build_model("resnet18", SHAPE, 10, seed=0), 2)
    client.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_onnx(client, SHAPE, tmp_path / "c.onnx", opset=17)
    assert client.training and all(m.training for m in client.modules())
    assert not caught
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.parametrize(("opset", "dynamo"), [(12, None), (21, None), (18, False), (17, True)])
def test_bad_opset_is_one_line(opset: int, dynamo: bool | None, tmp_path: Path) -> None:
    with pytest.raises(JetsplitError) as info:
        export_onnx(nn.Linear(4, 2), (4,), tmp_path / "x.onnx", opset=opset, dynamo=dynamo)
    assert "opset" in str(info.value) and "\n" not in str(info.value)


def test_compare_detects_a_different_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(8, 3), nn.Linear(8, 3)
    path = export_onnx(a, (8,), tmp_path / "a.onnx")
    assert compare_onnx(a, path, (8,)) <= ATOL
    assert compare_onnx(b, path, (8,)) > 1e-2
