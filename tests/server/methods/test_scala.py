"""Fast tier: the P_k that SCALA and LLA-SFL read from a device's registration
(server/methods/scala.py `registered_prior`): its histogram when usable, else a uniform
prior and a warning (the histogram is untrusted), never a crash of the round; and that
the family's step measures and clips each device's share of the server gradient only
under `gradient_shares = "all"`. Written for survivors of `make mutation
MUTATION=methods_scala` (docs/testing.md)."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from toy_server import toy_step  # testing/, on the path in tests

from jetsplit.server.defences.defences import Defences
from jetsplit.server.defences.step_bounds import gradient_shares, share_norms
from jetsplit.server.methods import scala_math
from jetsplit.server.methods.scala import CASFL, registered_prior
from jetsplit.server.training.round_books import RoundBooks
from jetsplit.server.training.settings import Settings

pytestmark = pytest.mark.fast


def _defences(counts: Any) -> Any:
    return SimpleNamespace(prior_counts=lambda agent: counts)


def test_scala_prior_is_the_registered_histograms_shares() -> None:
    """Counts (1, 0, 3): shares 1/4, 0, 3/4 (the 1e-12 floor is below float32's ulp here,
    and the empty class keeps 1e-12, not 0: its log stays finite)."""
    got = registered_prior(_defences([1, 0, 3]), "a0", 3)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([0.25, 0.0, 0.75], abs=1e-9)
    assert 0.0 < float(got[1]) < 1e-11


@pytest.mark.parametrize("counts", [None, [], [1, 2], [2, -1, 3], [0, 0, 0],
                                    [1.0, float("nan"), 2.0]])
def test_scala_prior_of_an_unusable_histogram_is_uniform_with_a_warning(
        counts: Any, caplog: pytest.LogCaptureFixture) -> None:
    """None registered, the wrong number of classes, a negative, all zero or NaN counts:
    each of 4 classes gets 1/4 = 0.25 exactly, and the log names the device."""
    with caplog.at_level(logging.WARNING, logger="jetsplit.coordinator"):
        got = registered_prior(_defences(counts), "a7", 4)
    assert got.tolist() == [0.25] * 4 and got.dtype == torch.float32
    assert "agent a7: unusable label histogram" in caplog.text
    assert "uniform prior" in caplog.text


@pytest.mark.parametrize("shares", ["all", "free"])
def test_ca_sfl_clips_a_devices_share_of_the_server_gradient_only_under_all_shares(
        shares: str) -> None:
    """CA-SFL (SCALA's family, plain CE) over four devices, the last one's activations × 50,
    `gradient_bound = 3`. Under "all" its share of ∇w_s is over 3× the median share, so the
    server steps with that term weighted down (the weights gradient_shares gives for the
    norms share_norms measures, both pinned by hand in test_methods_fast) and the books
    name it; under the default "free" nothing is measured and the step is the plain one.
    The devices' own gradients are the unweighted step's either way."""
    server, acts, labels = toy_step((4, 4, 4, 4))
    acts[3] = acts[3] * 50
    agents = ["a0", "a1", "a2", "a3"]
    ref = copy.deepcopy(server)
    step = scala_math.concatenated_forward(ref, acts, labels, 3, adjust=False, tau=0.0)
    terms = step.terms(None)
    clip = gradient_shares(agents, share_norms(terms, list(ref.parameters())), 3.0, {}, {})
    assert clip is not None and clip[:3] == [1.0] * 3 and clip[3] < 0.5
    if shares == "free":
        clip = terms = None
    want_loss, want_grads = scala_math.concatenated_update(
        ref, torch.optim.SGD(ref.parameters(), lr=0.1), step, None, clip, terms)

    books = RoundBooks()
    settings = Settings(loss_bound=0.0, gradient_bound=3.0, gradient_shares=shares)
    method = CASFL.__new__(CASFL)
    method.num_classes = 3
    method.trainer = SimpleNamespace(  # type: ignore[assignment]
        server=server, optimizer=torch.optim.SGD(server.parameters(), lr=0.1),
        defences=Defences(settings, 3, None, books))  # type: ignore[arg-type]
    loss, grads = method.server_update(agents, acts, labels)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)  # 0-dim tensors
    for p, q in zip(server.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-6)
    for a, g in zip(agents, want_grads, strict=True):
        torch.testing.assert_close(grads[a], g, rtol=0, atol=1e-6)
    assert list(books.gradient_clipped) == (["a3"] if shares == "all" else [])
