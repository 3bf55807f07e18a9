"""`jetsplit export model RUN_DIR`: the trained model leaves the run as one ONNX file.

A run keeps the trained blocks apart (`client.safetensors` + `server.safetensors`; PSL and
GAPSL keep one client block per agent in `clients/<agent>.safetensors`). Here they are
composed back into the whole model (client layers, then server layers), exported to ONNX
with a dynamic batch, and the file is checked in ONNX Runtime against the PyTorch
composition before it is kept. The model spec and cut come from the bundle the run shipped
(`checkpoint/bundle.tar.gz`), so the layer names are the ones the run trained.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from jetsplit.errors import ConfigError, JetsplitError
from jetsplit.models import ModelSpec

TOLERANCE = 1e-4  # max |Δ| between ONNX Runtime and PyTorch on random inputs


@dataclass(frozen=True)
class ExportedModel:
    """One exported file and how closely ONNX Runtime matched PyTorch."""

    name: str  # "model" or the agent id for per-client models
    path: Path
    max_delta: float


@dataclass(frozen=True)
class TrainedRun:
    """What a run folder holds for export: model spec, cut, server and client weights."""

    spec: ModelSpec
    split: int
    server: Path
    clients: dict[str, Path]  # "model" → client.safetensors, or agent id → its own block


def read_run(run_dir: Path) -> TrainedRun:
    """Find the trained blocks and the shipped bundle's spec; one-line errors otherwise."""
    from jetsplit.bundle import load_bundle

    if not run_dir.is_dir():
        raise ConfigError(f"run {run_dir}: not a folder")
    archive = run_dir / "checkpoint" / "bundle.tar.gz"
    if not archive.is_file():
        raise ConfigError(f"run {run_dir}: no checkpoint/bundle.tar.gz (not a finished run?)")
    server = run_dir / "server.safetensors"
    if not server.is_file():
        raise ConfigError(f"run {run_dir}: no server.safetensors (this method keeps no server "
                          "block in one file, or the run did not finish)")
    per_client = sorted((run_dir / "clients").glob("*.safetensors"))
    if per_client:
        clients = {p.stem: p for p in per_client}
    elif (run_dir / "client.safetensors").is_file():
        clients = {"model": run_dir / "client.safetensors"}
    else:
        raise ConfigError(f"run {run_dir}: no client.safetensors or clients/*.safetensors")
    with tempfile.TemporaryDirectory(prefix="jetsplit-export-") as tmp:
        bundle = load_bundle(archive, extract_to=tmp)
        spec, split = bundle.spec, bundle.split
    return TrainedRun(spec, split, server, clients)


def _load(path: Path, prefix: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from jetsplit.models.weights import from_arrays

    try:
        arrays = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{path}: unreadable weights ({exc})") from None
    tensors = from_arrays(arrays, prefix)
    if not tensors:
        raise ConfigError(f"{path}: no '{prefix}/' tensors in it")
    return tensors


def compose(run: TrainedRun, client_weights: Path) -> nn.Module:
    """client∘server with the run's trained weights, in eval mode."""
    from jetsplit.models import build_model
    from jetsplit.models.split import split
    from jetsplit.models.weights import load_strict

    client, server = split(build_model(run.spec, seed=0), run.split)
    load_strict(client, _load(client_weights, "client"), str(client_weights), ConfigError)
    load_strict(server, _load(run.server, "server"), str(run.server), ConfigError)
    return nn.Sequential(*client.children(), *server.children()).eval()


def export_model(run_dir: Path, out: Path, *, opset: int = 17) -> list[ExportedModel]:
    """Write `out` (one model) or `out`'s folder with `<stem>-<agent>.onnx` per client, each
    checked against PyTorch; a file that does not match is deleted and reported."""
    from jetsplit.export.onnx_export import compare_onnx, export_onnx

    run = read_run(run_dir)
    shape = tuple(run.spec.input_shape)
    results = []
    for name, weights in run.clients.items():
        module = compose(run, weights)
        path = out if name == "model" else out.with_name(f"{out.stem}-{name}{out.suffix}")
        export_onnx(module, shape, path, opset=opset)
        delta = compare_onnx(module, path, shape, batches=(1, 16))
        if not delta <= TOLERANCE:
            path.unlink(missing_ok=True)
            raise JetsplitError(f"{path.name}: ONNX Runtime differs from PyTorch by {delta:.2e} "
                                f"(> {TOLERANCE:g}); not kept")
        results.append(ExportedModel(name, path, delta))
    return results
