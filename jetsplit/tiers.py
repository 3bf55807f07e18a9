"""SHeRL-FL's three tiers of one split model, and the edge tier's training objective.

A bundle cuts a model once, at k1: the client block is layers[:k1], the server block
layers[k1:]. SHeRL-FL (the SHeRL-FL paper, "Model Partitioning") cuts the server block again:
the edge hosts the deeper feature layers [k1:k2] and the cloud keeps the task head
[k2:]. Carving the server block here (rather than a second bundle format) lets both the
edge agent and the coordinator build their part from the bundle they already verified.

The edge trains on a margin contrastive loss over pairs of its batch (the SHeRL-FL paper,
"Training Workflow", eqs. 1-2) with the cosine distance d = 1 - cos(z_i, z_j): a pair of
the same class costs d², a pair of different classes max(0, m - d)². The equations did not
survive in our copy of the paper; we average over all N(N-1)/2 unordered pairs of the
batch, so the step size does not grow with the square of the batch.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from jetsplit.errors import ModelError

DEFAULT_MARGIN = 0.5  # the paper's best margin (Tables 5-6)
COSINE_EPS = 1e-8  # all-zero embeddings (a dead ReLU map) have distance 1 to anything


def check_edge_layers(server_layers: int, edge_layers: int) -> None:
    """The edge needs at least one layer and must leave the cloud at least one."""
    if not isinstance(edge_layers, int) or not 1 <= edge_layers < server_layers:
        raise ModelError(f"the edge tier must host 1..{server_layers - 1} of the "
                         f"{server_layers} server-block layers, got {edge_layers}")


def carve(server: nn.Sequential, edge_layers: int) -> tuple[nn.Sequential, nn.Sequential]:
    """(edge block, cloud head) from a server block; both share its modules, so
    head(edge(a)) is exactly server(a) and training either trains the server block."""
    check_edge_layers(len(server), edge_layers)
    children = list(server.named_children())
    edge = nn.Sequential(OrderedDict(children[:edge_layers])).train(server.training)
    head = nn.Sequential(OrderedDict(children[edge_layers:])).train(server.training)
    return edge, head


def pair_distances(z: torch.Tensor) -> torch.Tensor:
    """Cosine distances 1 - cos(z_i, z_j) of every sample pair, (N, N); z is flattened
    per sample first (feature maps compare as vectors)."""
    unit = nn.functional.normalize(z.flatten(1), dim=1, eps=COSINE_EPS)
    return 1.0 - unit @ unit.T


def contrastive_loss(z: torch.Tensor, labels: torch.Tensor,
                     margin: float = DEFAULT_MARGIN) -> torch.Tensor:
    """Mean over unordered pairs i<j of d² (same class) or max(0, m - d)² (else).

    A batch with fewer than two samples has no pairs: the loss is zero (still attached to
    z, so a backward pass yields zero gradients rather than failing)."""
    n = z.shape[0]
    if n < 2:
        return z.sum() * 0.0
    d = pair_distances(z)
    i, j = torch.triu_indices(n, n, offset=1, device=z.device)
    d = d[i, j]
    same = labels[i] == labels[j]
    per_pair = torch.where(same, d.pow(2), torch.clamp(margin - d, min=0.0).pow(2))
    return per_pair.mean()
