"""Defaults that learn: PSL's and GAPSL's server step does not grow with the number of
clients (the mean of their losses), and the papers' own settings stay one preset away."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from jetsplit.server.methods.gapsl import GAPSL
from jetsplit.server.methods.gapsl_math import NuTracker
from jetsplit.server.methods.psl import PSL
from jetsplit.server.training.optimisers import client_batch, reduction, tier_optimizer
from jetsplit.server.training.settings import Settings


class _Defences:
    """The defences a PSL or GAPSL server update asks, every bound off."""

    weighs_losses = False  # the loss bound off: the reduction's step alone
    measures_shares = False  # gradient_shares = "free", the default

    def share_weights(self, agents: list[str], norms: torch.Tensor) -> None:
        return None  # GAPSL's gradient bound off too


class _Trainer:
    """What PSL's and GAPSL's server update reads from the trainer."""

    def __init__(self, settings: Settings, server: nn.Module) -> None:
        self.settings, self.server, self.round = settings, server, 0
        self.optimizer = tier_optimizer(settings, "server").for_module(server)
        self.defences = _Defences()


def _server_step(method: type[PSL], clients: int, **settings: object) -> torch.Tensor:
    """How far one server update moves the server block when `clients` clients send the
    same activations and labels (so any growth is the reduction's alone)."""
    torch.manual_seed(0)
    server = nn.Sequential(nn.Linear(12, 10))
    before = copy.deepcopy(server)
    s = Settings(algorithm=method.name, rounds=1, local_steps=1, k_min=1.0, k_max=1.0,
                 **settings)  # type: ignore[arg-type]
    m = method.__new__(method)
    m.trainer = _Trainer(s, server)  # type: ignore[assignment]
    m.tracker, m.step = NuTracker(), 0
    x, y = torch.randn(8, 12), torch.randint(0, 10, (8,))
    m.server_update([f"a{i}" for i in range(clients)], [x] * clients, [y] * clients)
    return torch.cat([(p - q).reshape(-1) for p, q in
                      zip(server.parameters(), before.parameters(), strict=True)])


@pytest.mark.parametrize("method", [PSL, GAPSL])
def test_default_server_step_is_independent_of_the_number_of_clients(method: type[PSL]
                                                                     ) -> None:
    one, ten = _server_step(method, 1), _server_step(method, 10)
    assert one.abs().max() > 0
    torch.testing.assert_close(ten, one)


@pytest.mark.parametrize("method", [PSL, GAPSL])
def test_paper_preset_sums_so_its_step_grows_with_the_clients(method: type[PSL]) -> None:
    one = _server_step(method, 1, preset="paper", momentum=0.0)
    ten = _server_step(method, 10, preset="paper", momentum=0.0)
    torch.testing.assert_close(ten, 10 * one)


def test_presets_resolve_own_then_preset_then_general() -> None:
    gapsl = Settings(algorithm="gapsl")
    assert reduction(gapsl) == "mean" and client_batch(gapsl) is None
    assert tier_optimizer(gapsl, "server") == tier_optimizer(Settings(algorithm="psl"),
                                                             "server")
    paper = Settings(algorithm="gapsl", preset="paper")
    assert (tier_optimizer(paper, "client").lr, tier_optimizer(paper, "server").lr,
            tier_optimizer(paper, "server").momentum) == (0.005, 0.01, 0.9)
    assert reduction(paper) == "sum" and client_batch(paper) == 128
    assert reduction(Settings(algorithm="psl", preset="paper", psl_reduction="mean")) == "mean"
    assert {tier_optimizer(Settings(algorithm="sherl"), t).name
            for t in ("client", "edge", "cloud")} == {"adam"}
    with pytest.raises(ValueError, match="unknown preset"):
        # Settings refuses it first; the optimisers keep their own guard for a built one
        reduction(Settings.model_construct(algorithm="psl", preset="tuned"))
