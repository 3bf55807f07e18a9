"""Per-tier training settings: the optimiser, learning rate and batch each tier (client,
server, edge, cloud) trains with, the server loss's reduction, and each method's defaults.

Why one place: the coordinator builds the server-side optimisers, ships the client's to the
agents (protocol `OptimizerArgs`, in the bundle install and in SHeRL-FL's edge load), and
the methods read per-client batches and reductions; all of them resolve a setting the same
way:

    the tier's own setting ([train] client_lr, server_lr, …)
    > the method's value in the chosen preset ([train] preset: `default` or `paper`)
    > the general setting ([train] lr, optimizer, momentum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TIERS = ("client", "server", "edge", "cloud")
OPTIMIZERS = ("sgd", "adam")
REDUCTIONS = ("mean", "sum")

#: What each paper trains with, where it says so (`preset = "paper"`). GAPSL (gapsl.txt
#: §IV-A, VGG-16 on CIFAR-10): SGD with momentum 0.9, client lr 0.005, server lr 0.01, batch
#: 128 per client, and L_g a sum over clients (eq. 8), as PSL's L. SHeRL-FL (sherl-fl.txt,
#: Experiments): Adam on every tier; the paper's learning-rate value is lost in its text,
#: 1e-3 is Adam's customary default. The other papers' settings are for their own models and
#: data (SCALA: ResNet/CIFAR; Ampere: per-model tables) and are left to the general settings.
PAPER: dict[str, dict[str, Any]] = {
    "psl": {"psl_reduction": "sum"},
    "gapsl": {"optimizer": "sgd", "momentum": 0.9, "client_lr": 0.005, "server_lr": 0.01,
              "client_batch": 128, "psl_reduction": "sum"},
    "sherl": {"optimizer": "adam", "momentum": 0.0, "client_lr": 1e-3, "edge_lr": 1e-3,
              "cloud_lr": 1e-3},
}
#: What each method trains with by default: settings that train the shipped models on the
#: shipped data. PSL and GAPSL step their server block on the clients' mean loss, so its
#: step does not grow with the number of clients (the paper's sum with momentum 0.9 diverged
#: in round 1 on AlexNet/MNIST at 5 clients), and GAPSL trains like PSL (plain SGD at `lr`,
#: B_k ∝ |D_k|) so the two differ in the method alone. SHeRL-FL keeps its paper's Adam.
DEFAULT: dict[str, dict[str, Any]] = {
    "psl": {"psl_reduction": "mean"},
    "gapsl": {"psl_reduction": "mean"},
    "sherl": PAPER["sherl"],
}
PRESETS: dict[str, dict[str, dict[str, Any]]] = {"default": DEFAULT, "paper": PAPER}


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
    preset = PRESETS.get(getattr(settings, "preset", None) or "default")
    if preset is None:
        raise ValueError(f"unknown preset {settings.preset!r}; one of {', '.join(PRESETS)}")
    return preset.get(getattr(settings, "algorithm", ""), {}).get(name, fallback)


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


def reduction(settings: Any) -> str:
    """How PSL's and GAPSL's server loss combines the clients' losses: "mean" (its step
    independent of how many clients are summed) or "sum" (gapsl.txt eq. 8)."""
    value = str(_setting(settings, "psl_reduction", "mean"))
    if value not in REDUCTIONS:
        raise ValueError(f"unknown psl_reduction {value!r}; one of {', '.join(REDUCTIONS)}")
    return value
