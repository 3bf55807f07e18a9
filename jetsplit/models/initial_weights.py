"""Initial weights from a file, mapped by parameter name onto the user's network.

A file is safetensors, or a PyTorch state dict read with `torch.load(weights_only=True)`:
nothing else is unpickled. Names are the network's own (the file is applied before the
network is cut into blocks). Every missing, unexpected and mis-shaped name is listed in one
error line, except one case: fine-tuning for another class count, where the tensors whose
shape depends on the class count (found by building the network for one class more) keep
their fresh initialisation and are named in the result.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from jetsplit.errors import ModelError
from jetsplit.models.zoo import ModelSpec

SHOWN = 4  # names listed per kind in an error line


@dataclasses.dataclass(frozen=True)
class InitialWeights:
    """What the file gave: its sha256 and the layers left at their fresh initialisation."""

    path: str
    sha256: str
    reinitialised: Tuple[str, ...] = ()

    def note(self) -> str:
        if not self.reinitialised:
            return f"initial weights {self.path} (sha256 {self.sha256[:16]}…)"
        return (f"initial weights {self.path} (sha256 {self.sha256[:16]}…); re-initialised "
                f"{', '.join(self.reinitialised)} for the new class count")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_state(path: Path) -> Dict[str, torch.Tensor]:
    """Tensors by name from safetensors or a weights_only state dict; one line otherwise."""
    if not path.is_file():
        raise ModelError(f"weights {path}: not found")
    with open(path, "rb") as fh:
        head = fh.read(16)
    if path.suffix == ".safetensors" or head[8:9] == b"{":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelError(f"weights {path}: unreadable safetensors ({exc})") from None
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler refusing a global, a torn file: all one line
        # torch's own text suggests weights_only=False: never repeated here
        raise ModelError(f"weights {path}: refused: not a plain state dict that "
                         f"torch.load(weights_only=True) reads ({type(exc).__name__}); save "
                         "model.state_dict() with torch.save, or as safetensors") from None
    for key in ("state_dict", "model"):  # a training checkpoint holding the state dict
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ModelError(f"weights {path}: refused: holds {type(state).__name__}, not a state "
                         "dict of named tensors")
    return dict(state)


def _names(items: List[str]) -> str:
    more = f" (+{len(items) - SHOWN} more)" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def load_initial_weights(module: nn.Module, path: Path, spec: ModelSpec,
                         rebuild: Callable[[ModelSpec], nn.Module]) -> InitialWeights:
    """Load `path` into `module` by name; `rebuild(spec with one more class)` tells which
    tensors depend on the class count. One ModelError line lists every mismatch."""
    tensors = read_state(path)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = sorted(k for k in set(expected) & set(tensors)
                       if tuple(tensors[k].shape) != tuple(expected[k].shape))
    kept: List[str] = []
    if misshaped and not missing and not unexpected:
        other = dataclasses.replace(spec, num_classes=spec.num_classes + 1)
        varying = {k for k, t in rebuild(other).state_dict().items()
                   if k in expected and tuple(t.shape) != tuple(expected[k].shape)}
        if set(misshaped) <= varying:
            kept, misshaped = misshaped, []
    if missing or unexpected or misshaped:
        parts = [f"missing {_names(missing)}" if missing else "",
                 f"unexpected {_names(unexpected)}" if unexpected else "",
                 "mis-shaped " + _names([f"{k} {list(tensors[k].shape)} (model "
                                         f"{list(expected[k].shape)})" for k in misshaped])
                 if misshaped else ""]
        raise ModelError(f"weights {path} do not fit {spec.name}: "
                         + "; ".join(p for p in parts if p))
    state = {k: v for k, v in tensors.items() if k not in kept}
    module.load_state_dict(state, strict=False)
    layers = tuple(sorted({k.rpartition(".")[0] or k for k in kept}))
    return InitialWeights(str(path), _sha256(path), layers)
