"""Per-tier training settings: the optimiser, learning rate and batch each tier (client,
server, edge, cloud) trains with, and each method's defaults from its paper.

Why one place: the coordinator builds the server-side optimisers, ships the client's to the
agents (protocol `OptimizerArgs`, in the bundle install and in SHeRL-FL's edge load), and
the methods read per-client batches; all of them resolve a setting the same way:

    the tier's own setting ([train] client_lr, server_lr, …)
    > the method's paper default (`PAPER_DEFAULTS`)
    > the general setting ([train] lr, optimizer, momentum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TIERS = ("client", "server", "edge", "cloud")
OPTIMIZERS = ("sgd", "adam")

#: What each paper trains with, where it says so. GAPSL (gapsl.txt §IV-A, VGG-16): SGD with
#: momentum 0.9, client lr 0.005, server lr 0.01, batch 128 per client. SHeRL-FL
#: (sherl-fl.txt, Experiments): Adam on every tier; the paper's learning-rate value is lost
#: in its text, 1e-3 is Adam's customary default. The other papers' settings are for their
#: own models and data (SCALA: ResNet/CIFAR; Ampere: per-model tables) and are left to the
#: general settings.
PAPER_DEFAULTS: dict[str, dict[str, Any]] = {
    "gapsl": {"optimizer": "sgd", "momentum": 0.9, "client_lr": 0.005, "server_lr": 0.01,
              "client_batch": 128},
    "sherl": {"optimizer": "adam", "momentum": 0.0, "client_lr": 1e-3, "edge_lr": 1e-3,
              "cloud_lr": 1e-3},
}


@dataclass(frozen=True)
class TierOptimizer:
    """One tier's optimiser: name, learning rate, momentum (SGD), weight decay."""

    name: str
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def build(self, params: Any) -> torch.optim.Optimizer:
        params = list(params)
        if self.name == "adam":
            return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)

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
    paper = PAPER_DEFAULTS.get(getattr(settings, "algorithm", ""), {})
    return paper.get(name, fallback)


def tier_optimizer(settings: Any, tier: str) -> TierOptimizer:
    """The optimiser `tier` trains with under `settings` (see the module docstring)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; one of {', '.join(TIERS)}")
    name = _setting(settings, "optimizer", "sgd")
    return TierOptimizer(
        name=name, lr=float(_setting(settings, f"{tier}_lr", settings.lr)),
        momentum=float(_setting(settings, "momentum", 0.0)) if name == "sgd" else 0.0,
        weight_decay=float(getattr(settings, "weight_decay", 0.0) or 0.0))


def client_batch(settings: Any) -> int | None:
    """A fixed per-client batch (GAPSL's 128, Ampere's B(d)), or None for B_k ∝ |D_k|."""
    value = _setting(settings, "client_batch", None)
    return None if value is None else int(value)
