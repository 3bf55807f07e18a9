"""The one optimiser builder: the coordinator's server-side tiers and the agents' client and
edge blocks build their SGD or Adam here, so a name and its arguments mean the same on
either side of the wire (protocol `OptimizerArgs`)."""

from __future__ import annotations

from typing import Iterable

import torch

OPTIMIZERS = ("sgd", "adam")


def build_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float,
                    momentum: float = 0.0, weight_decay: float = 0.0
                    ) -> torch.optim.Optimizer:
    """SGD (with `momentum`) or Adam over `params`; any other name is a ValueError."""
    params = list(params)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; one of {', '.join(OPTIMIZERS)}")
