"""A tiny seeded server block and per-device activations and labels: the hand-checked step
tests of the methods (SCALA's family, SplitFed, PSL) all start from the same one."""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn


def toy_step(sizes: Tuple[int, ...] = (2, 3, 4), dim: int = 3, classes: int = 3
             ) -> Tuple[nn.Linear, List[torch.Tensor], List[torch.Tensor]]:
    """A seeded Linear(dim, classes), one (n, dim) activation batch per entry of `sizes`,
    and labels 0, 1, 2, 0 cut to each n."""
    gen = torch.Generator().manual_seed(0)
    server = nn.Linear(dim, classes)
    with torch.no_grad():
        server.weight.copy_(torch.randn(classes, dim, generator=gen))
        server.bias.copy_(torch.randn(classes, generator=gen))
    acts = [torch.randn(n, dim, generator=gen) for n in sizes]
    labels = [torch.tensor([0, 1, 2, 0][:n]) for n in sizes]
    return server, acts, labels
