"""Export a block to ONNX with a dynamic batch axis, and check it against PyTorch.

Opset ≤ 17 goes through the legacy TorchScript exporter: TensorRT 8.x (JetPack 4/5) needs
those opsets and that exporter's graphs. Opset ≥ 18 goes through the dynamo exporter
(torch's default), for TensorRT 10 on JetPack 6.1+. The exporters talk a lot; that chatter
is silenced so the CLI stays readable.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from jetsplit.errors import JetsplitError, ModelError
from jetsplit.models.split import eval_mode

MIN_OPSET = 13  # TensorRT 8.2 (JetPack 4) reads ≤ 13; older opsets are not worth supporting
MAX_OPSET = 20  # TensorRT 10.x reads 17–20
LEGACY_MAX_OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "output"
_NOISY_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript",
                  "torch._export", "torch._subclasses")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence exporter warnings, log records and prints for the duration of an export."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    sink = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), \
                contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _legacy_exporter_flag() -> dict[str, bool]:
    """``dynamo=False`` where ``torch.onnx.export`` has the flag (torch ≥ 2.5 defaults to
    dynamo from 2.9); torch 1.13 (JetPack 5) has no flag and only the legacy exporter."""
    return {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters \
        else {}


def _check_opset(opset: int) -> None:
    if not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise JetsplitError(
            f"ONNX opset {opset} is out of range: choose {MIN_OPSET}..{MAX_OPSET} "
            f"(≤ {LEGACY_MAX_OPSET} for TensorRT 8.x on JetPack 4/5, 17–20 for TensorRT 10)"
        )


def _check_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(v) for v in input_shape)
    if not shape or any(v <= 0 for v in shape):
        raise ModelError(f"input shape must be positive integers per sample, got {shape}")
    return shape


def export_onnx(
    module: nn.Module,
    input_shape_chw: tuple[int, ...],
    path: str | Path,
    *,
    opset: int = 17,
    dynamo: bool | None = None,
) -> Path:
    """Export `module` (in eval mode) to `path` with input `input`, output `output` and a
    dynamic batch axis. `input_shape_chw` is per sample and of any rank (C,H,W for images,
    (tokens, dim) for a transformer activation). `dynamo=None` picks the exporter by opset."""
    _check_opset(opset)
    shape = _check_shape(input_shape_chw)
    use_dynamo = opset > LEGACY_MAX_OPSET if dynamo is None else dynamo
    if not use_dynamo and opset > LEGACY_MAX_OPSET:
        raise JetsplitError(f"the legacy ONNX exporter supports opset ≤ {LEGACY_MAX_OPSET}, "
                            f"got {opset}")
    if use_dynamo and opset < 18:
        raise JetsplitError(f"the dynamo ONNX exporter needs opset ≥ 18, got {opset}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # batch 2 as the example: a batch-1 trace can specialise the batch axis away
    example = torch.zeros(2, *shape)
    try:
        with eval_mode(module), _quiet(), torch.no_grad():
            if use_dynamo:
                torch.onnx.export(
                    module, (example,), str(path), input_names=[INPUT_NAME],
                    output_names=[OUTPUT_NAME], opset_version=opset, dynamo=True,
                    dynamic_shapes=({0: torch.export.Dim("batch")},),
                    external_data=False, verbose=False, optimize=True,
                )
            else:
                torch.onnx.export(
                    module, (example,), str(path), input_names=[INPUT_NAME],
                    output_names=[OUTPUT_NAME], opset_version=opset,
                    dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                    do_constant_folding=True, **_legacy_exporter_flag(),
                )
    except JetsplitError:
        raise
    except Exception as exc:  # exporter errors are long; keep the first line
        first = " ".join(str(exc).split())[:200]
        if "onnx is not installed" in first.lower():  # newer torch needs the onnx package
            first += " (install the export extra: pip install 'jetsplit[export]')"
        raise JetsplitError(f"ONNX export to {path.name} failed (opset {opset}): {first}"
                            ) from None
    return path


def compare_onnx(
    module: nn.Module,
    onnx_path: str | Path,
    input_shape: tuple[int, ...],
    batches: Sequence[int] = (1, 32),
    seed: int = 0,
) -> float:
    """Max |Δ| between PyTorch (eval mode) and ONNX Runtime (CPU) over random inputs at each
    batch size: the check that the exported file computes what the module does."""
    from jetsplit.runtimes.onnx_runtime import CPU_EP, OnnxBlock

    block = OnnxBlock(onnx_path, providers=[CPU_EP])
    shape = _check_shape(input_shape)
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    with eval_mode(module):
        for batch in batches:
            x = torch.randn(batch, *shape, generator=generator)
            with torch.no_grad():
                expected = module(x).numpy()
            got = block.run(x.numpy())
            if got.shape != expected.shape:
                raise JetsplitError(f"onnx model {Path(onnx_path).name}: output shape "
                                    f"{list(got.shape)} != PyTorch {list(expected.shape)}")
            worst = max(worst, float(np.max(np.abs(got - expected))))
    return worst
