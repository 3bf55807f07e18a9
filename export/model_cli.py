"""`jetsplit export model RUN_DIR` and `jetsplit predict MODEL --dataset D`: take the trained
model out of a run, check it, optionally build a TensorRT engine, and measure it on data."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from jetsplit.errors import ConfigError

if TYPE_CHECKING:
    from jetsplit.data import ImageOptions


def model(
    run_dir: Annotated[Path, typer.Argument(help="A finished run folder.")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="ONNX file to write (default RUN_DIR/model.onnx; per-client models "
        "get -<agent> before the suffix).")] = None,
    opset: Annotated[int, typer.Option("--opset", help="ONNX opset (13-17: TensorRT 8).")
                     ] = 17,
    engine: Annotated[bool, typer.Option(
        "--engine", help="Also build and validate a TensorRT engine (on the device).")
    ] = False,
    fp16: Annotated[bool, typer.Option("--fp16", help="FP16 engine (validated).")] = False,
) -> None:
    """The trained model as one ONNX file (one per client for PSL / GAPSL), checked in ONNX
    Runtime against the PyTorch composition."""
    from jetsplit.export.model_export import TOLERANCE, export_model, read_run

    target = out or run_dir / "model.onnx"
    if target.suffix != ".onnx":
        raise ConfigError(f"--out {target}: must end in .onnx")
    if engine:
        from jetsplit.runtimes.tensorrt_runtime import tensorrt_available

        if tensorrt_available() is None:  # fail before the export, in one line
            raise ConfigError("--engine: TensorRT is not installed here (it ships with JetPack "
                              "on a Jetson: run this there); ONNX export works without it")
    results = export_model(run_dir, target, opset=opset)
    for r in results:
        typer.echo(f"{r.path}: max |Δ| vs PyTorch {r.max_delta:.1e} (≤ {TOLERANCE:g})")
    if engine:
        from jetsplit.runtimes.tensorrt_runtime import (
            build_engine,
            engine_path_for,
            validate_engine,
        )

        shape = tuple(read_run(run_dir).spec.input_shape)
        for r in results:
            path = engine_path_for(r.path)
            build_engine(r.path, path, input_shape_chw=shape, max_batch=64, opt_batch=32,
                         fp16=fp16)
            diff = validate_engine(path, r.path, shape)
            typer.echo(f"{path}: max |Δ| vs ONNX Runtime {diff:.1e}")


def predict(
    model_path: Annotated[Path, typer.Argument(help="ONNX file (from `export model`).")],
    dataset: Annotated[str, typer.Option("--dataset", help="mnist | digits | npz:PATH | "
                                         "cifar10:DIR | folder:DIR | csv:FILE")] = "mnist",
    split: Annotated[str, typer.Option(
        "--split", help="test: the held-out part a run evaluated on; all: every sample.")
    ] = "test",
    test_fraction: Annotated[float, typer.Option("--test-fraction")] = 0.2,
    seed: Annotated[int, typer.Option("--seed", help="As the run's data seed.")] = 0,
    batch: Annotated[int, typer.Option("--batch", help="Samples per inference call.")] = 64,
) -> None:
    """Accuracy and latency of an exported model on a dataset (ONNX Runtime)."""
    import numpy as np

    from jetsplit.data import load_dataset, load_dataset_split
    from jetsplit.data.checks import check_data_options
    from jetsplit.runtimes.onnx_runtime import OnnxBlock

    if split not in ("test", "all"):
        raise ConfigError(f"--split: expected test or all, got {split!r}")
    if not 1 <= batch <= 65536:
        raise ConfigError(f"--batch: must be 1..65536, got {batch}")
    if not model_path.is_file():
        raise ConfigError(f"model {model_path}: file not found")
    check_data_options(dataset)
    block = OnnxBlock(model_path)
    images = _images_for(block.input_shape, seed)
    data = (load_dataset_split(dataset, test_fraction, seed, images)[1] if split == "test"
            else load_dataset(dataset, images))
    block.run(data.x[:1])  # warm-up (and a clear error when the input shape is wrong)
    hits = np.zeros(data.num_classes, np.int64)
    correct, calls = 0, []
    for start in range(0, len(data), batch):
        x = np.ascontiguousarray(data.x[start:start + batch])
        t0 = time.perf_counter()
        logits = block.run(x)
        calls.append(time.perf_counter() - t0)
        labels = data.y[start:start + batch]
        right = logits.argmax(axis=1) == labels
        correct += int(right.sum())
        np.add.at(hits, labels[right], 1)
    accuracy = correct / len(data)
    per_batch = 1e3 * float(np.median(calls))
    typer.echo(f"{model_path.name} on {dataset} ({split}, {len(data)} samples): accuracy "
               f"{accuracy:.4f}; latency {per_batch:.2f} ms per batch of {batch} (median), "
               f"{1e3 * sum(calls) / len(data):.3f} ms per sample, on "
               f"{block.providers[0]}")
    names = getattr(data, "classes", None)
    if names is not None:  # an image folder or manifest: accuracy per class, by name
        counts = np.bincount(data.y, minlength=data.num_classes)
        typer.echo("per class: " + ", ".join(
            f"{name} {hits[c] / counts[c]:.4f} ({counts[c]})" if counts[c] else f"{name} —"
            for c, name in enumerate(names)))
    skipped = getattr(data, "skips", None)
    if skipped is not None and skipped.report()["skipped"]:
        typer.echo(f"skipped {skipped.report()['skipped']} undecodable image(s), e.g. "
                   f"{skipped.report()['skipped_examples'][0]}")


def _images_for(input_shape: tuple[object, ...], seed: int) -> ImageOptions:
    """Images (a folder: or csv: dataset) come out at the model's own input size and
    channels, cropped and normalised as the run evaluated them."""
    from jetsplit.data import ImageOptions

    dims = [d if isinstance(d, int) else None for d in input_shape[1:]]
    channels, height, width = (dims + [None, None, None])[:3]
    size = height if height is not None and height == width else None
    return ImageOptions(image_size=size, channels=channels if channels in (1, 3) else None,
                        seed=seed)
