"""Per-tier training settings: the optimiser, learning rate and batch each tier (client,
server, edge, cloud) trains with, the server loss's reduction, and each method's defaults.

Why one place: the coordinator builds the server-side optimisers, ships the client's to the
agents (protocol `OptimizerArgs`, in the bundle install and in SHeRL-FL's edge load), and
the methods read per-client batches and reductions; all of them resolve a setting the same
way:

    the tier's own setting ([train] client_lr, server_lr, …)
    > the method's value in the chosen preset ([train] preset: `default` or `paper`; the
      presets live in the method catalog, jetsplit/catalog.py)
    > the general setting ([train] lr, optimizer, momentum).

The general `lr` itself, when none is given, is the preset's `lr` (a method's own default
rate: PSL's and GAPSL's), else DEFAULT_LR; a given `lr` always beats the preset's `lr`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from jetsplit.catalog import METHODS, PRESETS
from jetsplit.optimizers import build_optimizer

TIERS = ("client", "server", "edge", "cloud")
#: The learning rate of a method whose preset names none, when no `lr` is given.
DEFAULT_LR = 0.01
REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class TierOptimizer:
    """One tier's optimiser: name, learning rate, momentum (SGD), weight decay."""

    name: str
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def build(self, params: Any) -> torch.optim.Optimizer:
        return build_optimizer(params, self.name, self.lr, self.momentum, self.weight_decay)

    def for_module(self, module: nn.Module) -> torch.optim.Optimizer:
        return self.build(module.parameters())

    def wire(self) -> dict[str, Any]:
        """As the agents receive it (`jetsplit.protocol.OptimizerArgs`)."""
        return {"name": self.name, "lr": self.lr, "momentum": self.momentum,
                "weight_decay": self.weight_decay}


def _setting(settings: Any, name: str, fallback: Any) -> Any:
    own = getattr(settings, name, None)
    if own is not None:
        return own
    preset = getattr(settings, "preset", None) or "default"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")
    entry = METHODS.get(getattr(settings, "algorithm", ""))
    return fallback if entry is None else entry.preset(preset).get(name, fallback)


def learning_rate(settings: Any, tier: str) -> float:
    """The rate `tier` trains at under `settings` (see the module docstring)."""
    general = _setting(settings, "lr", DEFAULT_LR)
    return float(_setting(settings, f"{tier}_lr", general))


def tier_optimizer(settings: Any, tier: str) -> TierOptimizer:
    """The optimiser `tier` trains with under `settings` (see the module docstring)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; one of {', '.join(TIERS)}")
    name = _setting(settings, "optimizer", "sgd")
    return TierOptimizer(
        name=name, lr=learning_rate(settings, tier),
        momentum=float(_setting(settings, "momentum", 0.0)) if name == "sgd" else 0.0,
        weight_decay=float(getattr(settings, "weight_decay", 0.0) or 0.0))


def client_batch(settings: Any) -> int | None:
    """A fixed per-client batch (GAPSL's 128, Ampere's B(d)), or None for B_k ∝ |D_k|."""
    value = _setting(settings, "client_batch", None)
    return None if value is None else int(value)


def reduction(settings: Any) -> str:
    """How PSL's and GAPSL's server loss combines the clients' losses: "mean" (its step
    independent of how many clients are summed) or "sum" (the GAPSL paper eq. 8)."""
    value = str(_setting(settings, "psl_reduction", "mean"))
    if value not in REDUCTIONS:
        raise ValueError(f"unknown psl_reduction {value!r}; one of {', '.join(REDUCTIONS)}")
    return value
