"""Moving a step's tensors between the wire (NumPy on the host) and the coordinator's device,
and mixed precision on the server block.

A step's activations from all agents cross to the device in one transfer (one pinned host
buffer, one copy), and the activation gradients come back in one: with 100 clients that is
2 copies per step instead of 200, which is what keeps a GPU coordinator busy. On CPU the same
code runs and gives the same values (the views alias one buffer; nothing is rounded).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def to_device(arrays: list[np.ndarray], dtype: type[np.generic], device: torch.device
              ) -> list[torch.Tensor]:
    """`arrays` (any shapes) as `dtype` tensors on `device`, each a view of one buffer that
    crossed in a single copy."""
    if not arrays:
        return []
    sizes = [math.prod(a.shape) for a in arrays]
    parts = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]
    if device.type == "cuda":
        buffer = _pinned_pipeline(parts, sizes, device)
    else:
        buffer = torch.from_numpy(np.concatenate(parts))
    return [part.view(a.shape) for part, a in zip(buffer.split(sizes), arrays, strict=True)]


def _pinned_pipeline(parts: list[np.ndarray], sizes: list[int], device: torch.device
                     ) -> torch.Tensor:
    """`parts` gathered into one pinned host buffer and copied to one device buffer part by
    part: each part's copy to the card runs while the next part is gathered (the caching
    host allocator keeps the pinned block until its copies are done). torch's copy_ gathers
    on every core, NumPy's on one (docs/results.md#on-a-gpu)."""
    dtype = torch.from_numpy(np.empty(0, parts[0].dtype)).dtype
    host = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
    buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
    offset = 0
    for part, n in zip(parts, sizes, strict=True):
        with warnings.catch_warnings():  # a wire buffer is read-only; copy_ only reads it
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(part)
        host[offset:offset + n].copy_(source)
        buffer[offset:offset + n].copy_(host[offset:offset + n], non_blocking=True)
        offset += n
    return buffer


def to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Device tensors as float32 NumPy arrays (same shapes) after one copy to the host."""
    if not tensors:
        return []
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    if flat.is_cuda:  # into pinned memory: a device→host copy at full speed
        flat = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True).copy_(flat)
    flat = flat.cpu().numpy()
    sizes = np.cumsum([t.numel() for t in tensors])[:-1]
    return [part.reshape(t.shape) for part, t in zip(np.split(flat, sizes), tensors,
                                                       strict=True)]


def all_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds only finite values, read to the host in one transfer."""
    if not tensors:
        return []
    return [bool(v) for v in torch.stack([torch.isfinite(t).all() for t in tensors]).tolist()]


def autocast(device: torch.device, mode: str) -> contextlib.AbstractContextManager[None]:
    """`off`: nothing; `bf16` / `fp16`: the server block runs its matmuls and convolutions
    in that precision (weights, optimizer state and the gradients sent back stay fp32).
    fp16 runs without loss scaling, so prefer bf16 where the hardware has it."""
    if mode == "off":
        return contextlib.nullcontext()
    if mode not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast must be off, bf16 or fp16, got {mode!r}")
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[mode])
