"""Coordinator checkpoints: after every round, everything needed to continue the run as if
it had never stopped (`--resume DIR`).

A checkpoint is `DIR/checkpoint/`: `state.json` (round index, RNG states, fleet state,
byte counters, the method's small state) and `arrays-<round>.safetensors` (models and
optimizer state). `state.json` is replaced atomically and names its arrays file, so a
coordinator killed mid-write leaves the previous checkpoint intact. The bundle archive is
kept beside it: a resumed run ships exactly the bytes the agents already verified.
Checkpoints are read back as untrusted input: JSON only, safetensors only, shapes and
names checked when loaded into modules; nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jetsplit.errors import JetsplitError

Arrays = dict[str, np.ndarray]
FORMAT = 1
STATE_FILE = "state.json"
BUNDLE_FILE = "bundle.tar.gz"
MAX_STATE_BYTES = 64 * 1024 * 1024


class CheckpointError(JetsplitError):
    """A checkpoint is missing, damaged, or belongs to a different run setup."""


@dataclass
class Checkpoint:
    """What `load_checkpoint` returns: the last completed round and its state."""

    round: int
    meta: dict[str, Any]
    arrays: Arrays
    bundle: Path


def optimizer_state(optimizer: torch.optim.Optimizer, prefix: str) -> tuple[Arrays, dict]:
    """An optimizer's state dict as arrays (per-parameter buffers) plus JSON (groups)."""
    state = optimizer.state_dict()
    arrays: Arrays = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, buffers in state["state"].items():
        for key, value in buffers.items():
            if isinstance(value, torch.Tensor):
                arrays[f"{prefix}/{index}/{key}"] = value.detach().cpu().numpy()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return arrays, {"param_groups": state["param_groups"], "scalars": scalars}


def load_optimizer_state(optimizer: torch.optim.Optimizer, prefix: str, arrays: Arrays,
                         meta: dict[str, Any]) -> None:
    """Inverse of `optimizer_state`; a mismatch with the live optimizer is a CheckpointError."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in arrays.items():
        if not name.startswith(prefix + "/"):
            continue
        index, key = name[len(prefix) + 1:].split("/", 1)
        state.setdefault(int(index), {})[key] = torch.from_numpy(np.array(value))
    for index, values in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(values)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint optimizer state does not fit: {exc}") from None


def _json_safe(value: Any) -> Any:
    """RNG states hold big ints and arrays; JSON keeps big ints exactly."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def save_arrays(arrays: Arrays, path: Path) -> None:
    """Arrays to safetensors, keeping 0-d tensors 0-d (np.ascontiguousarray makes them 1-d,
    which a later strict load would reject)."""
    from safetensors.numpy import save_file

    out = {k: np.asarray(v) for k, v in arrays.items()}
    save_file({k: v if v.flags.c_contiguous else np.ascontiguousarray(v)
               for k, v in out.items()}, str(path))


def save_checkpoint(directory: Path, round_: int, meta: dict[str, Any], arrays: Arrays,
                    bundle_archive: Path) -> None:
    """Write round `round_`'s checkpoint; the previous one stays valid until the switch."""
    directory.mkdir(parents=True, exist_ok=True)
    bundle = directory / BUNDLE_FILE
    if not bundle.exists():
        tmp_bundle = directory / f".{BUNDLE_FILE}.tmp"
        shutil.copyfile(bundle_archive, tmp_bundle)
        os.replace(tmp_bundle, bundle)
    name = f"arrays-{round_}.safetensors"
    tmp_arrays = directory / f".{name}.tmp"
    save_arrays(arrays, tmp_arrays)
    os.replace(tmp_arrays, directory / name)
    state = {"format": FORMAT, "round": round_, "arrays": name, **_json_safe(meta)}
    tmp_state = directory / f".{STATE_FILE}.tmp"
    tmp_state.write_text(json.dumps(state))
    os.replace(tmp_state, directory / STATE_FILE)
    for old in directory.glob("arrays-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)


def load_checkpoint(directory: Path) -> Checkpoint:
    """The last completed round's checkpoint under `directory` (one-line errors)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = directory / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {directory} (expected {STATE_FILE})")
    if path.stat().st_size > MAX_STATE_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_STATE_BYTES} bytes")
    try:
        state = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a jetsplit checkpoint of format {FORMAT}")
    round_, name = state.get("round"), state.get("arrays")
    if not isinstance(round_, int) or round_ < 0 or not isinstance(name, str) \
            or "/" in name or not name.startswith("arrays-"):
        raise CheckpointError(f"{path}: bad round or arrays entry")
    try:
        arrays = load_file(str(directory / name))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"{directory / name}: cannot read ({exc})") from None
    bundle = directory / BUNDLE_FILE
    if not bundle.is_file():
        raise CheckpointError(f"{directory}: the bundle archive {BUNDLE_FILE} is missing")
    return Checkpoint(round=round_, meta=state, arrays=arrays, bundle=bundle)


def subset(arrays: Arrays, prefix: str) -> Arrays:
    """The arrays under `prefix/`, with their names kept."""
    return {k: v for k, v in arrays.items() if k.startswith(prefix + "/")}


def strip(arrays: Arrays, prefix: str) -> Arrays:
    """The arrays under `prefix/`, with the prefix removed."""
    return {k[len(prefix) + 1:]: v for k, v in arrays.items() if k.startswith(prefix + "/")}
