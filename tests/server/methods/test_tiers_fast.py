"""Fast tier (`-m fast`): SHeRL-FL's tiers (jetsplit/tiers.py) by hand: the carving of a
server block into edge and cloud (shared modules, the block's mode, the bounds), the cosine
distances, and the edge's margin contrastive loss on a batch of four, pair by pair."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from jetsplit.errors import ModelError
from jetsplit.tiers import (
    COSINE_EPS,
    DEFAULT_MARGIN,
    carve,
    check_edge_layers,
    contrastive_loss,
    pair_distances,
)

pytestmark = pytest.mark.fast

R2 = 1 / math.sqrt(2)


def _server(layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict((f"l{i}", nn.Linear(2, 2)) for i in range(layers)))


def test_edge_bounds_are_1_to_server_layers_minus_1() -> None:
    for ok in (1, 2, 3):
        check_edge_layers(4, ok)
    for bad in (0, 4, 5, -1, 1.0, "1"):
        with pytest.raises(ModelError) as exc:
            check_edge_layers(4, bad)  # type: ignore[arg-type]
        assert str(exc.value) == ("the edge tier must host 1..3 of the 4 server-block "
                                  f"layers, got {bad}")


def test_carve_shares_the_server_blocks_modules_and_mode() -> None:
    server = _server()
    for m in (1, 3):
        edge, head = carve(server, m)
        assert [n for n, _ in edge.named_children()] == [f"l{i}" for i in range(m)]
        assert [n for n, _ in head.named_children()] == [f"l{i}" for i in range(m, 4)]
        assert all(a is b for a, b in zip([*edge, *head], server, strict=True))
        x = torch.randn(3, 2)
        torch.testing.assert_close(head(edge(x)), server(x), rtol=0, atol=0)
        assert edge.training and head.training
    server.eval()
    edge, head = carve(server, 2)
    assert not edge.training and not head.training
    with pytest.raises(ModelError, match=r"must host 1\.\.3 of the 4 server-block layers"):
        carve(server, 4)


def test_pair_distances_are_one_minus_cosine_of_flattened_samples() -> None:
    """(3, 1, 2) maps flatten to [1, 0], [1, 1], [0, 2]: 45° and 90° apart; scale-free."""
    z = torch.tensor([[[1.0, 0.0]], [[1.0, 1.0]], [[0.0, 2.0]]])
    want = np.array([[0, 1 - R2, 1], [1 - R2, 0, 1 - R2], [1, 1 - R2, 0]])
    np.testing.assert_allclose(pair_distances(z).numpy(), want, atol=1e-6)
    zero = pair_distances(torch.tensor([[0.0, 0.0], [3.0, 4.0]]))  # a dead map: distance 1
    np.testing.assert_allclose(zero.numpy(), [[1, 1], [1, 0]], atol=1e-6)
    assert COSINE_EPS == 1e-8 and DEFAULT_MARGIN == 0.5


def _by_hand(z: np.ndarray, labels: list[int], margin: float) -> float:
    unit = z / np.linalg.norm(z, axis=1, keepdims=True)
    costs = []
    for i in range(len(z)):
        for j in range(i + 1, len(z)):
            d = 1 - unit[i] @ unit[j]
            costs.append(d ** 2 if labels[i] == labels[j] else max(0.0, margin - d) ** 2)
    return sum(costs) / len(costs)


@pytest.mark.parametrize("margin", [0.7, 1.0, 1.5])
def test_contrastive_loss_is_the_mean_over_the_six_unordered_pairs(margin: float) -> None:
    """Four samples at 0°, 30°, 100°, 180°, labels 0, 0, 1, 0: same-class pairs cost d²
    (d = 0.13, 2, 1.87), the others max(0, m − d)² (d = 1.17, 0.66, 0.83: at m = 0.7 and
    1.0 some inside the margin and some beyond it); the loss is the mean over the 6 pairs
    i < j (not over 16 or 12 ordered ones, nor their sum)."""
    angles = np.radians([0, 30, 100, 180])
    z = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    labels = [0, 0, 1, 0]
    got = contrastive_loss(torch.tensor(z, dtype=torch.float32), torch.tensor(labels), margin)
    assert got.item() == pytest.approx(_by_hand(z, labels, margin), rel=1e-5, abs=1e-7)


def test_the_default_margin_and_the_gradient() -> None:
    """Margin 0.5 by default; the gradient is the mean's (a pair beyond the margin adds 0)."""
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]], requires_grad=True)
    labels = torch.tensor([0, 1, 1])
    loss = contrastive_loss(z, labels)
    d = 1 - R2
    assert loss.item() == pytest.approx(((0.5 - d) ** 2 + 0 + d ** 2) / 3, rel=1e-5)
    loss.backward()
    assert z.grad is not None
    ref = z.detach().clone().requires_grad_(True)
    unit = ref / ref.norm(dim=1, keepdim=True)
    d01, d12 = 1 - unit[0] @ unit[1], 1 - unit[1] @ unit[2]
    ((torch.clamp(0.5 - d01, min=0) ** 2 + d12 ** 2) / 3).backward()
    torch.testing.assert_close(z.grad, ref.grad, rtol=1e-5, atol=1e-7)


def test_batches_without_pairs_cost_zero_and_stay_attached() -> None:
    for n in (0, 1):
        z = torch.ones(n, 3, requires_grad=True)
        loss = contrastive_loss(z, torch.zeros(n, dtype=torch.long))
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(z.grad, torch.zeros(n, 3))
    two = contrastive_loss(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([2, 2]))
    assert two.item() == pytest.approx(1.0)  # two samples: one pair, same class, d = 1
