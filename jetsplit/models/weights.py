"""Block weights in and out: strict loading (names, shapes, dtypes) and wire-ready arrays.

Used for bundles read from disk and for weights arriving over the network: both are
untrusted, so nothing is loaded unless every tensor matches the module exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from jetsplit.errors import JetsplitError


def load_strict(module: nn.Module, tensors: Mapping[str, torch.Tensor], where: str,
                error: type[JetsplitError] = JetsplitError) -> nn.Module:
    """Load `tensors` into `module` only if names, shapes and dtypes all match."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise error(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if extra:
        raise error(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} in all)")
    for key, want in expected.items():
        got = tensors[key]
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise error(f"{where}: tensor {key!r} is {got.dtype} {list(got.shape)}, "
                        f"the model needs {want.dtype} {list(want.shape)}")
    module.load_state_dict(dict(tensors), strict=True)
    return module


def to_arrays(module: nn.Module, prefix: str, *, copy: bool = True) -> dict[str, np.ndarray]:
    """A module's state as `<prefix>/<name>` NumPy arrays: copies, safe to send; with
    `copy=False` the CPU tensors' own memory (a device tensor is still copied to the host),
    only for a block dropped right after, whose memory the arrays then own."""
    return {f"{prefix}/{name}": (a.copy() if copy else a)
            for name, t in module.state_dict().items()
            for a in (t.detach().cpu().numpy(),)}


def stand_ins(module: nn.Module, prefix: str) -> dict[str, np.ndarray]:
    """A module's state as `<prefix>/<name>` arrays with each tensor's shape and dtype but
    no memory of their own (zero-stride, read-only): what replies are checked against, not
    a copy of the weights held for the whole run."""
    return {f"{prefix}/{name}": np.broadcast_to(
                np.zeros((), torch.empty((), dtype=t.dtype).numpy().dtype), tuple(t.shape))
            for name, t in module.state_dict().items()}


def to_load(arrays: Mapping[str, np.ndarray], prefix: str) -> dict[str, torch.Tensor]:
    """The `<prefix>/…` entries as tensors for `load_strict` only, which copies them into
    the module: sharing the arrays' memory where they are writable (an average just
    computed) instead of copying them first; a read-only one is copied."""
    start = f"{prefix}/"
    return {name[len(start):]: torch.from_numpy(
                value if value.flags.writeable else np.array(value, copy=True))
            for name, value in arrays.items() if name.startswith(start)}


def from_arrays(arrays: Mapping[str, np.ndarray], prefix: str) -> dict[str, torch.Tensor]:
    """The `<prefix>/…` entries of received arrays as writable torch tensors."""
    start = f"{prefix}/"
    return {name[len(start):]: torch.from_numpy(np.array(value, copy=True))
            for name, value in arrays.items() if name.startswith(start)}
