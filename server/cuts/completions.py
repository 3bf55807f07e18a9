"""Per-device cuts: device k trains layers 1..c_k, the coordinator completes it to c*.

The server cut c* is the deepest device cut (or one the planner names); the method's server
block starts there, so SCALA concatenates, and GAPSL compares, tensors of one shape. A
shallow device's activations at c_k go through the coordinator's *completion copy* of layers
c_k+1..c* before the server block, and its gradient flows back through that copy in the
same backward pass (the copy takes its own SGD step, like the device's block).

Where completion copies live: one per agent, on the coordinator, like SplitFed V1's server
copies. Methods that average client blocks (SplitFed, SCALA) reload every copy from the
global block at round start, and average each layer over all its copies at round end: agent
k contributes layer l from its device when c_k ≥ l and from its completion copy otherwise,
weight |D_k| (so each agent's device block ∪ completion copy is one whole block 1..c*,
and the layer-wise mean is FedAvg over those). Methods that never average client blocks
(PSL, GAPSL) keep each agent's copy across rounds: it is the coordinator-side part of that
agent's own block, evaluated and checkpointed with it. With every cut equal to c* there are
no copies and the methods run exactly the common-cut code.

Ampere trains without server gradients, so it keeps no copies: layers are averaged over the
devices that hold them (`aggregation.layerwise_fedavg`), and `Completions.carry` takes a
shallow device's one-shot upload forward through the global layers c_k+1..c*.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from jetsplit.errors import ConfigError
from jetsplit.models.split import eval_mode
from jetsplit.models.weights import from_arrays, load_strict, to_arrays

Arrays = dict[str, np.ndarray]


def check_cuts(cuts: Mapping[str, int], server_cut: int, model: str) -> dict[str, int]:
    """Each agent's cut as an int in 1..c*; one ConfigError line naming the agent."""
    out = {}
    for agent, cut in sorted(cuts.items()):
        if isinstance(cut, bool) or not isinstance(cut, int) or not 1 <= cut <= server_cut:
            raise ConfigError(f"agent {agent}: cut {cut!r} is out of range for {model}: "
                              f"choose 1..{server_cut} (the server cut)")
        out[agent] = cut
    return out


def layer_names(block: nn.Sequential) -> list[str]:
    return [name for name, _ in block.named_children()]


def block_names(template: nn.Sequential, cut: int, prefix: str = "client") -> list[str]:
    """Tensor names (`client/<layer>.<param>`) of layers 1..cut of `template`."""
    layers = set(layer_names(template)[:cut])
    return [f"{prefix}/{k}" for k in template.state_dict() if k.split(".", 1)[0] in layers]


def subset(arrays: Arrays, names: list[str]) -> Arrays:
    return {n: arrays[n] for n in names}


class Completions:
    """The coordinator's per-agent copies of layers c_k+1..c* (see the module docstring)."""

    def __init__(self, template: nn.Sequential, cuts: Mapping[str, int],
                 optimizer: Callable[[Any], torch.optim.Optimizer],
                 input_shape: tuple[int, ...], device: torch.device | str = "cpu") -> None:
        """`optimizer(params)` builds a copy's optimiser: the client tier's (the copies
        train client layers, so they step as the devices' blocks do)."""
        self.template, self.cuts, self.make_optimizer = template, dict(cuts), optimizer
        self.device = torch.device(device)  # where the copies train: the server's device
        self.input_shape = tuple(input_shape)
        self.server_cut = len(template)
        self.copies: dict[str, nn.Sequential] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tail: tuple[int, Arrays, nn.Sequential] | None = None  # `carry`'s last module

    def cut(self, agent: str) -> int:
        return self.cuts.get(agent, self.server_cut)

    def shallow(self, agent: str) -> bool:
        return self.cut(agent) < self.server_cut

    @property
    def heterogeneous(self) -> bool:
        return any(c < self.server_cut for c in self.cuts.values())

    def activation_shape(self, cut: int) -> tuple[int, ...]:
        block = nn.Sequential(OrderedDict(list(self.template.named_children())[:cut]))
        with eval_mode(block), torch.no_grad():
            out = block(torch.zeros(1, *self.input_shape))
        return tuple(out.shape[1:])

    # ------------------------------------------------------------------ weights

    def layers_after(self, cut: int, global_client: Arrays, what: str) -> nn.Sequential:
        """Layers cut+1..c* of the template with the global block's weights, on the
        coordinator's device."""
        children = list(copy.deepcopy(self.template).named_children())[cut:]
        module = nn.Sequential(OrderedDict(children))
        names = [f"client/{k}" for k in module.state_dict()]
        load_strict(module, from_arrays(subset(global_client, names), "client"), what)
        return module.to(self.device)

    def load(self, agent: str, global_client: Arrays) -> None:
        """(Re)build agent's copy from the global block's layers c_k+1..c*."""
        cut = self.cut(agent)
        if cut >= self.server_cut:
            return
        module = self.layers_after(cut, global_client, f"completion copy of {agent}")
        self.copies[agent] = module
        self.optimizers[agent] = self.make_optimizer(module.parameters())

    def carry(self, cut: int, global_client: Arrays, acts: np.ndarray,
              chunk: int = 256) -> np.ndarray:
        """Activations at `cut` carried to c* through the global layers cut+1..c* (eval
        mode, no gradient): Ampere's consolidated store holds one shape, so a shallow
        device's one-shot upload is completed here before it is stored. Chunked: an upload
        slice can be large, the intermediate maps of the first layers larger."""
        if cut >= self.server_cut:
            return acts
        if self._tail is None or self._tail[0] != cut or self._tail[1] is not global_client:
            self._tail = (cut, global_client,
                          self.layers_after(cut, global_client, f"layers after cut {cut}"))
        module = self._tail[2]
        out = []
        with eval_mode(module), torch.no_grad():
            for start in range(0, len(acts), chunk):
                x = torch.from_numpy(np.array(acts[start:start + chunk], dtype=np.float32))
                out.append(module(x.to(self.device)).float().cpu().numpy())
        return np.concatenate(out) if out else acts

    def begin_round(self, agents: list[str], global_client: Arrays, *, fresh: bool) -> None:
        """`fresh`: every shallow agent's copy restarts from the global block (averaging
        methods); otherwise only missing copies are built (PSL/GAPSL keep theirs)."""
        for agent in agents:
            if self.shallow(agent) and (fresh or agent not in self.copies):
                self.load(agent, global_client)

    def move(self, agent: str, cut: int) -> None:
        """Agent's cut is now `cut` (live re-planning): its copy, built for the old cut, is
        dropped; the next `begin_round` (or a method's `load`) builds the new one."""
        self.cuts[agent] = cut
        self.copies.pop(agent, None)
        self.optimizers.pop(agent, None)
        self._pending.pop(agent, None)

    def state(self, agent: str) -> Arrays:
        module = self.copies.get(agent)
        return {} if module is None else to_arrays(module, "client")

    def whole(self, agent: str, device: Arrays) -> Arrays:
        """Agent k's whole block 1..c*: its device layers and its completion layers."""
        return {**device, **self.state(agent)} if self.shallow(agent) else device

    # ------------------------------------------------------------------ training

    def forward(self, agents: list[str], acts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Shallow agents' activations through their copies (graph kept for `backward`)."""
        out = []
        for agent, x in zip(agents, acts, strict=True):
            if not self.shallow(agent):
                out.append(x)
                continue
            module = self.copies[agent]
            leaf = x.clone().requires_grad_(True)
            module.train()
            with torch.enable_grad():
                h = module(leaf)
            self._pending[agent] = (leaf, h)
            out.append(h.detach())
        return out

    def backward(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Chain each shallow agent's gradient at c* back to c_k, stepping its copy; agents
        that got no gradient (GAPSL's unselected) leave their copy untouched."""
        out = dict(grads)
        for agent, (leaf, h) in self._pending.items():
            if agent not in grads:
                continue
            optimizer = self.optimizers[agent]
            optimizer.zero_grad(set_to_none=True)
            h.backward(grads[agent])
            optimizer.step()
            out[agent] = leaf.grad.detach()
        self._pending = {}
        return out
