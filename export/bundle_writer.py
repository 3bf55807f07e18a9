"""Write a bundle for one split: safetensors weights, ONNX blocks and a hashed manifest.

Every ONNX file is checked in ONNX Runtime against PyTorch before the bundle is written, so
an agent never receives a block that computes something else. Engines are never written
here: they are tied to the TensorRT version and GPU and are built on the device
(`jetsplit export engine`). The bundle is assembled in a temporary sibling folder and moved
into place, so a failed export never leaves half a bundle behind.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from jetsplit import __version__
from jetsplit.bundle import (
    BUNDLE_FORMAT_VERSION,
    ENGINE_NAME,
    MANIFEST_NAME,
    ONNX_FILES,
    WEIGHT_FILES,
    Bundle,
    CodeEntry,
    FileEntry,
    Manifest,
    SpecEntry,
    load_bundle,
    role_files,
    sha256_file,
)
from jetsplit.errors import BundleError
from jetsplit.export.onnx_export import compare_onnx, export_onnx
from jetsplit.model_source import code_identity
from jetsplit.models import (
    ZOO_VERSION,
    ModelSpec,
    activation_shape,
    build_aux_head,
    build_model,
    check_split,
    split,
)

ONNX_ATOL = 1e-4
OPTIONAL_KEYS = ("code", "initial_weights_sha256", "classes")
CHECK_BATCHES = (1, 32)


@dataclass(frozen=True)
class BundleReport:
    """What was written and how closely each ONNX block matches PyTorch."""

    path: Path
    manifest: Manifest
    max_abs_diff: dict[str, dict[int, float]]  # block -> batch -> max |Δ| (ONNX vs PyTorch)
    tar_path: Path | None = None
    files: dict[str, FileEntry] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # e.g. the initial weights and what they re-initialised


def _save_weights(module: nn.Module, path: Path) -> None:
    """One metadata key only: safetensors orders a header map at random, and a bundle of the
    same spec and seed should hash the same every time."""
    tensors = {key: value.detach().contiguous() for key, value in module.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _load_trained(model: nn.Module, aux: nn.Module | None, weights: dict[str, torch.Tensor]
                  ) -> None:
    """Trained weights: the full model's state dict, plus the aux head's under `aux.`."""
    aux_part = {k[4:]: v for k, v in weights.items() if k.startswith("aux.")}
    model_part = {k: v for k, v in weights.items() if not k.startswith("aux.")}
    targets: list[tuple[str, nn.Module, dict[str, torch.Tensor]]] = [("model", model, model_part)]
    if aux_part:
        if aux is None:
            raise BundleError("weights hold aux.* tensors but the bundle has no aux head")
        targets.append(("aux head", aux, aux_part))
    for what, module, part in targets:
        expected = module.state_dict()
        missing, extra = sorted(set(expected) - set(part)), sorted(set(part) - set(expected))
        if missing or extra:
            kind, key = ("missing", missing[0]) if missing else ("unexpected", extra[0])
            raise BundleError(f"weights do not fit the {what}: {kind} tensor {key!r}")
        for key, want in expected.items():
            if tuple(part[key].shape) != tuple(want.shape):
                raise BundleError(f"weights do not fit the {what}: {key!r} is "
                                  f"{list(part[key].shape)}, needs {list(want.shape)}")
        module.load_state_dict(part, strict=True)


def _check_replaceable(out_dir: Path) -> None:
    """Only an empty folder or an earlier bundle (with its engines) may be replaced."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise BundleError(f"output {out_dir} exists and is not a folder")
    if not out_dir.exists():
        return
    names = set(ONNX_FILES.values()) | set(WEIGHT_FILES.values()) | {MANIFEST_NAME}
    for entry in os.scandir(out_dir):
        bundle_like = entry.name in names or ENGINE_NAME.match(entry.name)
        if not bundle_like or not stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
            raise BundleError(f"output {out_dir} is not empty and not a bundle "
                              f"(found {entry.name!r}); choose another --out")


def _export_checked(module: nn.Module, shape: tuple[int, ...], path: Path, opset: int
                    ) -> dict[int, float]:
    export_onnx(module, shape, path, opset=opset)
    diffs = {b: compare_onnx(module, path, shape, batches=(b,)) for b in CHECK_BATCHES}
    for batch, diff in diffs.items():
        if not diff <= ONNX_ATOL:  # also catches NaN
            raise BundleError(f"{path.name}: ONNX Runtime differs from PyTorch by {diff:.2e} "
                              f"at batch {batch} (limit {ONNX_ATOL:g})")
    return diffs


def _write_tar(src: Path, archive: Path, compresslevel: int = 9) -> None:
    """Reproducible .tar.gz: flat regular files, sorted, no owners, zero mtimes."""
    tmp = archive.with_name(f".{archive.name}.tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                               mtime=0, compresslevel=compresslevel) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(src.iterdir()):
            info = tarfile.TarInfo(path.name)
            info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
    os.replace(tmp, archive)


def _finish(staging: Path, manifest: Manifest, out_dir: Path) -> None:
    """Write the manifest, check the reader accepts the folder, move it into place."""
    data = manifest.model_dump(mode="json", exclude_none=False)
    for key in OPTIONAL_KEYS:  # absent, not null: a zoo bundle's manifest stays as it was
        if data.get(key) is None:
            data.pop(key, None)
    if isinstance(data.get("code"), dict):
        data["code"] = {k: v for k, v in data["code"].items() if v is not None}
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    (staging / MANIFEST_NAME).write_text(text, encoding="utf-8")
    for path in staging.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; agents may run as another user
    load_bundle(staging)  # the reader accepts what the writer wrote
    staging.chmod(0o755)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)


def derive_bundle(source: Bundle, role: str, out_dir: str | Path, *, aux: bool = False,
                  edge_layers: int | None = None) -> Manifest:
    """A device bundle cut from a verified `full` bundle: only what `role` runs.

    `client`: the client block and its ONNX (+ the aux head with `aux`); `edge`: SHeRL-FL's
    middle block, server layers [:edge_layers] (no classifier); `full`: the whole model
    (FedAvg). Files are copied byte for byte (their hashes carry over); an edge block is
    saved from the server block's first layers."""
    if source.role != "full":
        raise BundleError(f"bundle {source.source}: device bundles are cut from a full "
                          f"bundle, not a {source.role} one")
    out_dir = Path(out_dir)
    aux = aux and role != "edge"
    if aux and not source.has_aux:
        raise BundleError(f"bundle {source.source}: the method needs an aux head; "
                          "re-export with one (set model.aux_ratio)")
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        names = sorted(role_files(role, aux))
        for name in names:
            if name == WEIGHT_FILES["edge"]:
                from jetsplit.tiers import carve

                if edge_layers is None:
                    raise BundleError("an edge bundle needs edge_layers")
                _save_weights(carve(source.server_module(), edge_layers)[0], staging / name)
            else:
                shutil.copyfile(source.path(name), staging / name)
        files = {name: FileEntry(sha256=sha256_file(staging / name),
                                 size=(staging / name).stat().st_size) for name in names}
        manifest = source.manifest.model_copy(update={
            "role": role, "files": files,
            "aux_ratio": source.manifest.aux_ratio if aux else None,
            "edge_layers": edge_layers if role == "edge" else None})
        manifest = Manifest.model_validate(manifest.model_dump())  # re-check the invariants
        _finish(staging, manifest, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def write_bundle(
    spec: ModelSpec | str,
    k: int,
    out_dir: str | Path,
    *,
    aux_ratio: float | None = 0.5,
    opset: int = 17,
    seed: int = 0,
    weights: dict[str, torch.Tensor] | None = None,
    tar: bool = False,
    initial_weights: str | Path | None = None,
    classes: Sequence[str] | None = None,
    compresslevel: int = 9,
) -> BundleReport:
    """Build the (seeded or given) model, split it at `k`, and write a verified bundle to
    `out_dir` (and `<out_dir>.tar.gz` with `tar`, gzip level `compresslevel`: 0 stores,
    for an archive only the writing process reads, whose float weights deflate barely
    shrinks). `aux_ratio=None` ships no aux head;
    `weights` is a full-model state dict, with the aux head's tensors under `aux.`;
    `initial_weights` a weights file the model starts from (jetsplit/models/initial_weights.py);
    `classes` the run's class names in label order (agents map their own labels to them).
    """
    if isinstance(spec, str):
        spec = ModelSpec(spec)
    out_dir = Path(out_dir)
    code = code_identity(spec.name)  # before building: a source not installed fails here
    model = build_model(spec, seed=seed, weights=initial_weights)
    initial = model.initial_weights
    check_split(model, k)
    aux = None if aux_ratio is None else build_aux_head(model, k, aux_ratio, seed=seed + 1)
    if weights is not None:
        _load_trained(model, aux, weights)
    client, server = split(model, k)
    act_shape = activation_shape(model, k)
    _check_replaceable(out_dir)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        blocks: dict[str, nn.Module] = {"client": client, "server": server}
        if aux is not None:
            blocks["aux"] = aux
        for block, module in blocks.items():
            _save_weights(module, staging / WEIGHT_FILES[block])
        diffs = {"client": _export_checked(client, spec.input_shape,
                                           staging / ONNX_FILES["client"], opset)}
        if aux is not None:
            diffs["aux"] = _export_checked(aux, act_shape, staging / ONNX_FILES["aux"], opset)

        files = {path.name: FileEntry(sha256=sha256_file(path), size=path.stat().st_size)
                 for path in sorted(staging.iterdir())}
        manifest = Manifest(
            format_version=BUNDLE_FORMAT_VERSION, jetsplit_version=__version__,
            zoo_version=ZOO_VERSION,
            model=SpecEntry(name=spec.name, input_shape=spec.input_shape,
                            num_classes=spec.num_classes),
            split=k, input_shape=spec.input_shape, activation_shape=act_shape,
            client_layers=tuple(n for n, _ in client.named_children()),
            server_layers=tuple(n for n, _ in server.named_children()),
            aux_ratio=aux_ratio, opset=opset, codec="fp32", files=files, role="full",
            code=None if code is None else CodeEntry(**code),
            initial_weights_sha256=None if initial is None else initial.sha256,
            classes=None if classes is None else tuple(classes),
        )
        _finish(staging, manifest, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise

    tar_path = None
    if tar:
        tar_path = out_dir.with_name(out_dir.name + ".tar.gz")
        _write_tar(out_dir, tar_path, compresslevel)
    return BundleReport(path=out_dir, manifest=manifest, max_abs_diff=diffs, tar_path=tar_path,
                        files=files, notes=() if initial is None else (initial.note(),))
