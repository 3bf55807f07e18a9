"""`jetsplit profile` on a JetPack 5 device: no ONNX Runtime is one note and no wasted export;
torch 1.13's exporter (no ``dynamo`` flag) still exports."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jetsplit.export import onnx_export
from jetsplit.export.profiler import measure_ort_layers
from jetsplit.models import build_model
from jetsplit.runtimes.onnx_runtime import ORT_MISSING


def test_no_onnxruntime_is_one_note_and_no_export(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails

    def no_export(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("exported a layer with no runtime to time it")

    monkeypatch.setattr(onnx_export, "export_onnx", no_export)
    model = build_model("vgg11", (1, 16, 16), 10, seed=0)
    times, notes = measure_ort_layers(model, batch=2, repeats=1)
    assert times == [None] * len(model)
    assert notes == [f"ONNX Runtime timing skipped: {ORT_MISSING}"]


def test_legacy_export_without_a_dynamo_flag(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """torch 1.13's ``torch.onnx.export`` has no ``dynamo`` parameter: none is passed."""
    assert onnx_export._legacy_exporter_flag() == {"dynamo": False}  # torch 2.13 here
    calls: list[dict[str, Any]] = []

    def export_113(model: nn.Module, args: Any, f: str, export_params: bool = True,
                   verbose: bool = False, training: Any = None, input_names: Any = None,
                   output_names: Any = None, operator_export_type: Any = None,
                   opset_version: Any = None, do_constant_folding: bool = True,
                   dynamic_axes: Any = None) -> None:
        calls.append({"opset_version": opset_version, "dynamic_axes": dynamic_axes})
        Path(f).write_bytes(b"onnx")

    monkeypatch.setattr(torch.onnx, "export", export_113)
    path = onnx_export.export_onnx(nn.Linear(4, 2), (4,), tmp_path / "x.onnx", opset=13)
    assert path.read_bytes() == b"onnx"
    assert calls == [{"opset_version": 13, "dynamic_axes": {"input": {0: "batch"},
                                                            "output": {0: "batch"}}}]
