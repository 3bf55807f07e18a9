"""The `Defences` object's seams (server/defences/defences.py), by hand: the weights it gives
a step where one device is over the loss bound, SCALA's step under those weights against
the hand-computed weighted loss's update, a step's screening, and its memory round-tripping
through a checkpoint's meta and arrays."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from jetsplit.server.defences import memory
from jetsplit.server.defences.defences import Defences
from jetsplit.server.methods import scala_math
from jetsplit.server.methods.scala import SCALA
from jetsplit.server.training.round_books import RoundBooks
from jetsplit.server.training.settings import Settings

pytestmark = pytest.mark.fast

AGENTS = ["a0", "a1", "a2", "a3"]
HISTOGRAMS = {"a0": [5, 3, 2], "a1": [2, 6, 2], "a2": [3, 3, 4], "a3": [4, 4, 2]}


def _defences(**settings: object) -> Defences:
    registry = SimpleNamespace(
        registration=lambda a: {"dataset": {"label_histogram": HISTOGRAMS[a], "size": 10}},
        client_claims=lambda: dict.fromkeys(AGENTS, 10))
    return Defences(Settings(**settings), 3, registry, RoundBooks())  # type: ignore[arg-type]


def test_a_device_over_the_loss_bound_is_weighed_as_if_at_the_bound() -> None:
    """Losses (0.5, 0.6, 0.4, 6.0), factor 3: the reference is their median 0.55, the bound
    3 × 0.55 = 1.65 (over the floor ln 3), so a3 weighs 1.65 / 6 and the books say so; a
    step under the bound gets None (the unweighted step), and with the bound off nothing
    is weighed at all."""
    d = _defences(loss_bound=3.0)
    assert d.weighs_losses
    assert d.loss_weights(AGENTS, [0.5, 0.6, 0.4, 6.0]) == pytest.approx(
        [1.0, 1.0, 1.0, 1.65 / 6.0])
    assert d.books.down_weighted_steps == {"a3": 1}
    assert "weight 0.275" in d.books.down_weighted["a3"]
    assert d.loss_weights(AGENTS, [0.5, 0.5, 0.6, 0.7]) is None
    off = _defences(loss_bound=0.0)
    assert not off.weighs_losses and off.loss_weights(AGENTS, [0.5, 0.6, 0.4, 60.0]) is None


def test_scalas_step_under_the_defences_weights_is_the_hand_weighted_update() -> None:
    """SCALA's server update over a real `Defences`: a3's activations × 8 against labels its
    logits disagree with put its slice loss far over the others'. The weights are worked
    out by hand from the slices' logit-adjusted losses (median reference, 3× bound, floor
    ln 3); the server block ends where one SGD step on Σ_k w_k·B_k·L^s_k / B takes it, and
    the clients' gradients are the unweighted step's."""
    gen = torch.Generator().manual_seed(3)
    server = nn.Linear(4, 3)
    with torch.no_grad():
        server.weight.copy_(torch.randn(3, 4, generator=gen))
        server.bias.zero_()
    acts = [torch.randn(n, 4, generator=gen) for n in (3, 4, 2, 3)]
    labels = [torch.randint(0, 3, (len(a),), generator=gen) for a in acts]
    acts[3] = acts[3] * 8
    with torch.no_grad():
        labels[3] = (server(acts[3]).argmax(dim=1) + 1) % 3  # never the logits' choice
    y, sizes = torch.cat(labels), [len(a) for a in acts]
    prior = scala_math.label_prior(y, 3)
    with torch.no_grad():
        slices = [float(scala_math.logit_adjusted_ce(server(x), t, prior, 1.0))
                  for x, t in zip(acts, labels, strict=True)]
    ordered = sorted(slices)
    bound = max(3.0 * (ordered[1] + ordered[2]) / 2, math.log(3))
    weights = [bound / v if v > bound else 1.0 for v in slices]
    assert weights[3] < 1.0 and weights[:3] == [1.0, 1.0, 1.0]

    ref = copy.deepcopy(server)
    loss = sum(w * n * scala_math.logit_adjusted_ce(ref(x), t, prior, 1.0) for w, n, x, t in
               zip(weights, sizes, acts, labels, strict=True)) / sum(sizes)
    steps = torch.autograd.grad(loss, list(ref.parameters()))
    plain = copy.deepcopy(server)
    priors = [scala_math.prior_from_counts(HISTOGRAMS[a], 3) for a in AGENTS]
    _, want_grads = scala_math.scala_server_step(
        plain, acts, labels, 3, torch.optim.SGD(plain.parameters(), lr=0.1), client_priors=priors)

    method = SCALA.__new__(SCALA)
    method.num_classes = 3
    method.trainer = SimpleNamespace(  # type: ignore[assignment]
        server=server, optimizer=torch.optim.SGD(server.parameters(), lr=0.1),
        defences=_defences(loss_bound=3.0), device=torch.device("cpu"))
    _, grads = method.server_update(AGENTS, acts, labels)
    for p, q, g in zip(server.parameters(), ref.parameters(), steps, strict=True):
        torch.testing.assert_close(p.detach(), q.detach() - 0.1 * g, rtol=0, atol=1e-6)
    for agent, want in zip(AGENTS, want_grads, strict=True):
        torch.testing.assert_close(grads[agent], want, rtol=0, atol=1e-6)
    assert method.trainer.defences.books.down_weighted_steps == {"a3": 1}


def test_screening_bounds_activations_and_drops_an_inconsistent_device() -> None:
    """One call per step: a device whose activations are 10^6 × the fleet's is scaled back
    (noted as bounded), and a device the label check has found inconsistent is dropped from
    the step's inputs (noted as left out)."""
    d = _defences(activation_bound=3.0)
    acts = [torch.ones(2, 4), torch.ones(2, 4) * 2, torch.ones(2, 4) * 1.5, torch.ones(2, 4) * 1e6]
    labels = [torch.tensor([0, 1])] * 4
    d.consistency.inconsistent["a1"] = "labels inconsistent"
    agents, kept, _ = d.screen(AGENTS, acts, labels)
    assert agents == ["a0", "a2", "a3"]
    assert float(kept[2].flatten(1).norm(dim=1).max()) <= 3.0 * 3.0 + 1e-3
    assert set(d.books.bounded) == {"a3"} and d.books.excluded_steps == {"a1": 1}


def test_the_defences_memory_round_trips_and_judges_as_before() -> None:
    """What one `Defences` learnt (a loss window, a bench strike, an outlier verdict) comes
    back into a fresh one through the checkpoint's JSON meta and arrays, and the two then
    weigh the next step alike."""
    d = _defences(loss_bound=3.0)
    d.loss_weights(AGENTS, [0.5, 0.6, 0.4, 6.0])
    d.bench.strikes, d.outliers = {"a2": 1}, {"client": frozenset({"a3"})}
    meta, arrays = memory.snapshot(d)
    back = _defences(loss_bound=3.0)
    memory.restore(back, json.loads(json.dumps(meta)), arrays)
    assert list(back.loss_bound.history) == list(d.loss_bound.history)
    assert back.bench.strikes == {"a2": 1} and back.left_out("client", AGENTS) == {"a3"}
    step = [0.5, 0.5, 0.6, 2.0]
    assert back.loss_weights(AGENTS, step) == d.loss_weights(AGENTS, step)
