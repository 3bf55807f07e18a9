"""`jetsplit export bundle` and `jetsplit export engine`.

torch, ONNX and TensorRT are imported inside the commands, so mounting them costs nothing
on a machine that runs other commands.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def bundle(
    model: str = typer.Option(..., "--model", help="Model source: a zoo name (alexnet), "
                              "module.path:factory, torchvision:NAME or timm:NAME."),
    split: int = typer.Option(..., "--split", help="Split index k: the client runs layers[:k]."),
    out: Path = typer.Option(..., "--out", help="Bundle folder to write (replaced if a bundle)."),
    classes: int = typer.Option(10, "--classes", help="Number of classes."),
    input_shape: str = typer.Option("3,32,32", "--input-shape", help="Input shape C,H,W."),
    aux_ratio: float = typer.Option(0.5, "--aux-ratio", help="Aux head width ratio in (0, 1]."),
    no_aux: bool = typer.Option(False, "--no-aux", help="Ship no auxiliary head."),
    opset: int = typer.Option(17, "--opset", help="ONNX opset (≤17 for TensorRT 8.x)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the initial weights."),
    tar: bool = typer.Option(False, "--tar", help="Also write <out>.tar.gz."),
    weights: Path | None = typer.Option(
        None, "--weights", help="Initial weights: safetensors or a state dict (weights_only)."),
) -> None:
    """Write a bundle (weights, ONNX, manifest) for one split and check ONNX against PyTorch."""
    from jetsplit.cli_types import parse_shape
    from jetsplit.export.bundle_writer import ONNX_ATOL, write_bundle
    from jetsplit.models import ModelSpec

    spec = ModelSpec(model, parse_shape(input_shape), classes)
    console = Console()
    with console.status(f"exporting {model} split {split} …"):
        report = write_bundle(spec, split, out, aux_ratio=None if no_aux else aux_ratio,
                              opset=opset, seed=seed, tar=tar, initial_weights=weights)
    for note in report.notes:
        console.print(note)

    files = Table(title=f"bundle {report.path}", title_justify="left")
    files.add_column("file")
    files.add_column("size", justify="right")
    files.add_column("sha256")
    for name, entry in sorted(report.files.items()):
        files.add_row(name, _size(entry.size), entry.sha256[:16])
    console.print(files)

    checks = Table(title=f"ONNX Runtime vs PyTorch (opset {opset}, limit {ONNX_ATOL:g})",
                   title_justify="left")
    checks.add_column("block")
    batches = sorted({b for diffs in report.max_abs_diff.values() for b in diffs})
    for batch in batches:
        checks.add_column(f"max |Δ| batch {batch}", justify="right")
    for block, diffs in report.max_abs_diff.items():
        checks.add_row(f"{block}.onnx", *(f"{diffs[b]:.2e}" for b in batches))
    console.print(checks)
    if report.tar_path is not None:
        console.print(f"tar: {report.tar_path} ({_size(report.tar_path.stat().st_size)})")


def engine(
    bundle_dir: Path = typer.Argument(..., help="Bundle folder (engines are written into it)."),
    fp16: bool = typer.Option(False, "--fp16", help="Build FP16 engines (validated)."),
    max_batch: int = typer.Option(64, "--max-batch", help="Largest batch the engine accepts."),
    workspace_mb: int = typer.Option(1024, "--workspace-mb", help="TensorRT builder workspace."),
) -> None:
    """Build TensorRT engines for a bundle's ONNX blocks on this device and validate them."""
    from jetsplit.bundle import load_bundle
    from jetsplit.errors import BundleError, ModelError
    from jetsplit.runtimes.tensorrt_runtime import build_engine, engine_path_for, validate_engine

    if not bundle_dir.exists():
        raise BundleError(f"bundle {bundle_dir}: not found")
    if not bundle_dir.is_dir():
        raise BundleError(f"bundle {bundle_dir}: engines are written next to the bundle; pass "
                          "an (extracted) bundle folder")
    if max_batch < 1:
        raise ModelError(f"--max-batch must be ≥ 1, got {max_batch}")
    loaded = load_bundle(bundle_dir)
    blocks = [(loaded.client_onnx, tuple(loaded.manifest.input_shape))]
    if loaded.has_aux:
        blocks.append((loaded.aux_onnx, tuple(loaded.manifest.activation_shape)))
    check_batches = tuple(sorted({1, min(32, max_batch)}))

    console = Console()
    table = Table(title=f"TensorRT engines for {bundle_dir} ({'fp16' if fp16 else 'fp32'})",
                  title_justify="left")
    table.add_column("engine")
    table.add_column("size", justify="right")
    table.add_column(f"max |Δ| vs ONNX Runtime (batch {', '.join(map(str, check_batches))})",
                     justify="right")
    for onnx_path, shape in blocks:
        target = engine_path_for(onnx_path)  # raises the one-line BackendUnavailable here
        with console.status(f"building {target.name} …"):
            build_engine(onnx_path, target, input_shape_chw=shape, max_batch=max_batch,
                         opt_batch=min(32, max_batch), fp16=fp16, workspace_mb=workspace_mb)
        try:
            diff = validate_engine(target, onnx_path, shape, batches=check_batches)
        except BaseException:
            target.unlink(missing_ok=True)  # never leave an engine that failed validation
            raise
        table.add_row(target.name, _size(target.stat().st_size), f"{diff:.2e}")
    console.print(table)
