"""Fast tier: the P_k that SCALA and LLA-SFL read from a device's registration
(server/methods/scala.py `registered_prior`): its histogram when usable, else a uniform
prior and a warning (the histogram is untrusted), never a crash of the round. Written for
survivors of `make mutation MUTATION=methods_scala` (docs/testing.md)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from jetsplit.server.methods.scala import registered_prior

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
