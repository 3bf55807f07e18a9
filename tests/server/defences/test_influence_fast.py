"""Bounded influence on the server block (server/defences/step_bounds.py) by hand: a device whose
median
activation norm is over factor × the fleet's reference (the median of the devices' median
norms, this step's and recent steps', per activation shape) is scaled back to the reference;
any sample still over the bound is cut to it; a clean step passes untouched."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from jetsplit.server.defences.step_bounds import (
    ActivationBound,
    gradient_norm,
    gradient_norms,
    gradient_shares,
)
from jetsplit.server.methods.scala_math import slice_losses, weighted_loss

pytestmark = pytest.mark.fast


def _acts(norms: list[float], width: int = 4) -> torch.Tensor:
    """Samples whose L2 norms are `norms` (all mass on the first feature, signs alternate)."""
    out = torch.zeros(len(norms), width)
    for i, n in enumerate(norms):
        out[i, 0] = n if i % 2 == 0 else -n
    return out.view(len(norms), 2, width // 2)


def test_a_device_far_above_the_fleet_is_scaled_down_to_the_bound() -> None:
    bound = ActivationBound(factor=3.0)
    acts = [_acts([1, 2, 3]), _acts([2, 2, 2]), _acts([4, 5, 6e6])]
    notes: dict[str, str] = {}
    out = bound.apply(["a0", "a1", "a2"], acts, notes)
    # device medians 2, 2, 5: reference 2, bound 6; only a2's third sample is over it
    assert out[0] is acts[0] and out[1] is acts[1]
    assert out[2].flatten(1).norm(dim=1).tolist() == pytest.approx([4, 5, 6])
    assert out[2][2].flatten()[0].item() == pytest.approx(6.0)  # direction kept
    assert notes == {"a2": "activations bounded: median norm 5 (fleet 2, bound 6), 1 of 3 "
                           "samples cut"}
    # history: the medians as allowed (2, 2, 5); a step of only the attacker is judged
    # against them: median(2, 2, 5, 1e6) = 3.5, bound 10.5; its median is over the bound,
    # so the whole batch is brought back to the reference, 3.5 (× 3.5e-6)
    notes.clear()
    out = bound.apply(["a2"], [_acts([1e6, 2e6, 3e6])], notes)
    assert out[0].flatten(1).norm(dim=1).tolist() == pytest.approx([1.75, 3.5, 5.25])
    assert notes["a2"] == ("activations bounded: median norm 2e+06 (fleet 3.5, bound 10.5), "
                           "all scaled ×1.75e-06")


def test_clean_steps_are_untouched_and_shapes_have_their_own_reference() -> None:
    bound = ActivationBound(factor=5.0)
    notes: dict[str, str] = {}
    small, large = _acts([1, 1.5, 2], width=4), _acts([100, 120, 90], width=8)
    out = bound.apply(["a0", "a1"], [small, large], notes)  # two cuts: two references
    assert out[0] is small and out[1] is large and notes == {}
    off = ActivationBound(factor=0.0)
    huge = [_acts([1]), _acts([1e9])]
    assert off.apply(["a0", "a1"], huge, notes) is huge
    empty = [torch.zeros(0, 2, 2), _acts([3])]
    assert bound.apply(["a0", "a1"], empty, notes)[0].shape == (0, 2, 2)


def _edge_batches() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Three edges' embeddings (2, 1 and 3 samples: unequal sizes) and labels."""
    g = np.random.default_rng(0)
    sizes = {"e0": 2, "e1": 1, "e2": 3}
    embeddings = {e: g.normal(size=(n, 4)).astype(np.float32) for e, n in sizes.items()}
    labels = {"e0": np.array([0, 2]), "e1": np.array([1]), "e2": np.array([2, 2, 0])}
    return embeddings, labels


def test_weighted_loss_is_the_size_weighted_sum_of_the_slices_losses() -> None:
    """Σ_k w_k·B_k·L_k / B over slices of sizes (2, 1, 3) with weights (1, 0.25, 1); the
    bound is shown each slice's own mean loss; no weights give None (the caller's plain
    loss)."""
    embeddings, labels = _edge_batches()
    scores = torch.from_numpy(np.concatenate(list(embeddings.values()))[:, :3])
    targets = torch.from_numpy(np.concatenate(list(labels.values())))
    ce = torch.nn.functional.cross_entropy
    per = [ce(scores[:2], targets[:2]), ce(scores[2:3], targets[2:3]), ce(scores[3:], targets[3:])]
    seen: list[list[float]] = [slice_losses(ce, scores, targets, [2, 1, 3])]
    got = weighted_loss(ce, scores, targets, [2, 1, 3], [1.0, 0.25, 1.0])
    assert seen == [pytest.approx([float(x) for x in per], abs=1e-7)]
    assert got is not None
    want = (2 * per[0] + 0.25 * 1 * per[1] + 3 * per[2]) / 6
    assert float(got) == pytest.approx(float(want), abs=1e-7)
    assert float(got) != pytest.approx(float(ce(scores, targets)), abs=1e-3)
    assert weighted_loss(ce, scores, targets, [2, 1, 3], None) is None


def test_sherl_cloud_head_steps_on_the_down_weighted_edge_loss() -> None:
    """SHeRL-FL's cloud step (`SHeRL._cloud_step`): the head takes its SGD step on
    Σ_e w_e·B_e·CE_e / B with the loss bound's weights per EDGE (here e1 at 0.25), the
    bound sees the edges in sorted order, and the step reports the unweighted loss."""
    from jetsplit.server.methods.sherl import SHeRL

    embeddings, labels = _edge_batches()
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 3)
    start = copy.deepcopy(head)
    asked: list[list[str]] = []
    weights = {"e0": 1.0, "e1": 0.25, "e2": 1.0}

    def loss_weights(order: list[str], losses: list[float]) -> Any:
        asked.append(order)
        return [weights[e] for e in order]

    trainer = SimpleNamespace(
        device=torch.device("cpu"), settings=SimpleNamespace(autocast="off"),
        optimizer=torch.optim.SGD(head.parameters(), lr=0.5),
        defences=SimpleNamespace(weighs_losses=True, loss_weights=loss_weights),
        books=SimpleNamespace(bounded={}, activation_scale={}))
    method = SimpleNamespace(trainer=trainer, head=head, embedding_bound=ActivationBound(0.0))
    reported = SHeRL._cloud_step(method, embeddings, labels)  # type: ignore[arg-type]
    assert asked == [["e0", "e1", "e2"]]

    ce = torch.nn.functional.cross_entropy
    x = {e: torch.from_numpy(v) for e, v in embeddings.items()}
    y = {e: torch.from_numpy(v) for e, v in labels.items()}
    by_hand = sum(weights[e] * len(y[e]) * ce(start(x[e]), y[e]) for e in x) / 6
    by_hand.backward()
    with torch.no_grad():
        for p, q in zip(head.parameters(), start.parameters(), strict=True):
            torch.testing.assert_close(p, q - 0.5 * q.grad, rtol=0, atol=1e-6)
        plain = ce(start(torch.cat(list(x.values()))), torch.cat(list(y.values())))
    assert reported == pytest.approx(float(plain), abs=1e-6)


def test_the_gradient_bound_clips_a_share_far_over_the_median() -> None:
    """Norms 1, 2, 3, 40 at factor 5: median 2.5, bound 12.5, the fourth device weighs
    12.5/40 = 0.3125 (its term's gradient then has norm 12.5), the others 1; a share at the
    bound exactly is untouched; fewer than three devices, factor 0, or nobody over: None."""
    notes: dict[str, str] = {}
    steps: dict[str, int] = {}
    agents = ["a0", "a1", "a2", "a3"]
    assert gradient_shares(agents, [1.0, 2.0, 3.0, 40.0], 5.0, notes, steps) == [
        1.0, 1.0, 1.0, 0.3125]
    assert gradient_shares(agents, [1.0, 2.0, 3.0, 40.0], 5.0, notes, steps) is not None
    assert steps == {"a3": 2}
    assert notes == {"a3": "2 steps with its server-gradient share clipped, last: 40 over "
                           "5× the median 2.5"}
    assert gradient_shares(agents, [1.0, 2.0, 3.0, 12.5], 5.0, {}, {}) is None  # at the bound
    assert gradient_shares(agents[:3], [1.0, 2.0, 12.5], 2.0, {}, {}) == [1.0, 1.0, 0.32]
    assert gradient_shares(agents[:2], [1.0, 400.0], 5.0, {}, {}) is None
    assert gradient_shares(agents, [1.0, 2.0, 3.0, 40.0], 0.0, {}, {}) is None
    nan = gradient_shares(agents, [1.0, 2.0, 3.0, math.nan], 1.0, {}, {})
    assert nan == [1.0, 1.0, pytest.approx(2 / 3), 1.0]  # median of the finite three


def test_gradient_norms_read_each_whole_gradient_and_retry_only_an_overflow() -> None:
    """‖(3, 4), (12)‖ = 13; an empty gradient is 0; two float32 tensors at 3e38 overflow the
    float32 norm (4.2e38 > 3.4e38) and read as √2·3e38 from the float64 retry, never inf,
    while the others keep their float32 values."""
    normal = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    huge = [torch.full((1,), 3e38), torch.full((1,), 3e38)]
    norms = gradient_norms([normal, [], huge])
    assert norms[:2] == [13.0, 0.0]
    assert norms[2] == pytest.approx(math.sqrt(2) * 3e38, rel=1e-6)
    assert gradient_norm(normal) == 13.0 and gradient_norms([]) == []
