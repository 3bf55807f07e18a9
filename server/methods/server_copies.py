"""Per-client server-block copies in storage kept across rounds (SplitFed V1, LLA-SFL).

A method that trains one server-block copy per selected client used to deepcopy the block
and build an optimiser per client every round, then copy every trained copy again to
average it: page faults and allocator traffic that grew with the clients and dominated the
run's system time. Here a copy is a slot, made once and reused: each round the slots the
round needs are reset in place from the global block (`copy_` of every parameter and
buffer, gradients dropped, each submodule's train/eval flag copied) and their optimisers'
state cleared, which is exactly the state a fresh deepcopy and a fresh optimiser have, so
a run is bit for bit the one it was. The pool holds as many slots as the most clients a
round selected, never one per client of the fleet.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

Signature = tuple[object, ...]


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (non-persistent ones too: a deepcopy has them)."""
    return itertools.chain(module.named_parameters(), module.named_buffers())


def signature(module: nn.Module) -> Signature:
    """What a slot must match to be reset from `module` in place: the module itself, and
    its tensors' names, shapes, dtypes and devices."""
    return (id(module), *((n, tuple(t.shape), t.dtype, t.device) for n, t in _tensors(module)))


@torch.no_grad()
def reset_from(slot: nn.Module, source: nn.Module) -> None:
    """Make `slot` (a deepcopy of `source` once) hold what a fresh deepcopy would now."""
    for (_, dst), (_, src) in zip(_tensors(slot), _tensors(source), strict=True):
        dst.copy_(src)
    for param in slot.parameters():
        param.grad = None
    for dst_module, src_module in zip(slot.modules(), source.modules(), strict=True):
        dst_module.training = src_module.training


def array_views(module: nn.Module, prefix: str) -> dict[str, np.ndarray]:
    """A module's state as `<prefix>/<name>` NumPy arrays that share its memory on the CPU
    (one host copy per tensor on an accelerator): for reading, never for sending."""
    return {f"{prefix}/{name}": t.detach().cpu().numpy()
            for name, t in module.state_dict().items()}


class ServerCopies:
    """Slots of server-block copies with their optimisers, reused round after round."""

    def __init__(self, build: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
        self._build = build  # the server tier's optimiser for a module
        self._slots: list[tuple[nn.Module, torch.optim.Optimizer]] = []
        self._signature: Signature | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def checkout(self, source: nn.Module, agents: list[str]
                 ) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        """A copy of `source` and a fresh-state optimiser over it for each agent, in order:
        existing slots reset in place, new ones only when this round selects more agents
        than any round before (or the block changed shape)."""
        wanted = signature(source)
        if wanted != self._signature:
            self._slots, self._signature = [], wanted
        while len(self._slots) < len(agents):
            module = copy.deepcopy(source)
            self._slots.append((module, self._build(module)))
        modules, optimizers = {}, {}
        for agent, (module, optimizer) in zip(agents, self._slots, strict=False):
            reset_from(module, source)
            optimizer.state.clear()
            modules[agent], optimizers[agent] = module, optimizer
        return modules, optimizers
