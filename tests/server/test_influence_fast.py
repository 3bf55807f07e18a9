"""Bounded influence on the server block (server/influence.py) by hand: a device whose median
activation norm is over factor × the fleet's reference (the median of the devices' median
norms, this step's and recent steps', per activation shape) is scaled back to the reference;
any sample still over the bound is cut to it; a clean step passes untouched."""

from __future__ import annotations

import pytest
import torch

from jetsplit.server.influence import ActivationBound

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
