"""Fast tier: SplitFed V2's own pass and step (server/methods/splitfed.py) beyond the rounds
pinned in test_round_wiring.py: the order it serves devices in, that a device which drops
out of its pass (or whose step fails) is not served again in that round, and that the loss
bound scales the server's step and never the device's gradient; and that V1 averages its
server copies as blocks it trained itself (no direction check). Written for the survivors
of `make mutation MUTATION=methods_splitfed` (docs/testing.md)."""

from __future__ import annotations

import contextlib
import copy
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from toy_server import toy_step  # testing/, on the path in tests

from jetsplit.server.defences.defences import Defences
from jetsplit.server.defences.step_bounds import LOSS_FLOOR, LossBound
from jetsplit.server.methods.splitfed import SplitFedV2
from jetsplit.server.training.settings import Settings

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread each (conftest): the 2 shared cores only contend with more."""


def _v2_pass(live_at: Any, losses: dict[tuple[str, int], float | None], steps: int = 3
             ) -> tuple[list[tuple[str, int]], list[float], set[str]]:
    """SplitFed V2's `local_pass` over a0, a1, a2 with a stub trainer: all three are live
    when the round asks; `live_at(agent, n)` says whether `agent` is live at the n-th check
    of its own pass (1: before its step 0); `_serve` records (agent, step) and returns
    `losses`' value for it (1.0 if not named)."""
    served: list[tuple[str, int]] = []
    checks: dict[str, int] = {}

    def live(agents: list[str]) -> list[str]:
        if len(agents) > 1:  # the round's own check, before any pass
            return list(agents)
        out = []
        for a in agents:
            checks[a] = checks.get(a, 0) + 1
            if live_at(a, checks[a]):
                out.append(a)
        return out

    method = SplitFedV2.__new__(SplitFedV2)
    method.trainer = SimpleNamespace(  # type: ignore[assignment]
        live=live, rng=np.random.default_rng(0),
        defences=SimpleNamespace(batches=lambda agents: {a: 8 for a in agents}),
        settings=SimpleNamespace(local_steps=steps))

    def serve(agent: str, batch: int, step: int) -> float | None:
        assert batch == 8
        served.append((agent, step))
        return losses.get((agent, step), 1.0)

    method._serve = serve  # type: ignore[method-assign]
    participants: set[str] = set()
    got = method.local_pass(["a0", "a1", "a2"], participants)
    return served, got, participants


def _order() -> list[str]:
    """The order V2 serves a0..a2 in: the trainer's rng permutes them once per round."""
    return [str(a) for a in np.random.default_rng(0).permutation(["a0", "a1", "a2"])]


def test_splitfed_v2_serves_each_device_its_whole_pass_before_the_next() -> None:
    served, losses, participants = _v2_pass(lambda a, n: True, {})
    assert served == [(a, s) for a in _order() for s in range(3)]
    assert losses == [1.0] * 9 and participants == {"a0", "a1", "a2"}


def test_splitfed_v2_never_serves_a_device_again_in_the_round_once_it_dropped_out() -> None:
    """The second device in the order is live for its first step, gone at the second check
    and back at the third: its pass ended when it dropped (its state on the device may be
    gone), so it is served once, the others all three steps, and it still took part."""
    second = _order()[1]
    served, losses, participants = _v2_pass(lambda a, n: a != second or n != 2, {})
    assert served == [(a, s) for a in _order() for s in (range(1) if a == second else range(3))]
    assert len(losses) == 7 and participants == {"a0", "a1", "a2"}


def test_splitfed_v2_ends_a_devices_pass_at_its_first_failed_step() -> None:
    """A step that returns no loss (the device's reply missing or refused) ends that
    device's pass: its later steps are not tried, and a device whose first step failed
    did not take part."""
    first, second = _order()[:2]
    served, losses, participants = _v2_pass(
        lambda a, n: True, {(first, 0): None, (second, 1): None, (second, 2): 5.0})
    assert served == [(first, 0), (second, 0), (second, 1)] + [(_order()[2], s)
                                                                 for s in range(3)]
    assert losses == [1.0] * 4 and participants == {second, _order()[2]}


def test_splitfed_v2_weighs_the_servers_step_by_the_loss_bound_not_the_devices_gradient(
        ) -> None:
    """`loss_bound = 3` on 3 classes (floor ln 3): four steps, one device each; a3's
    activations × 50 make its loss far over 3× the median of the four. The server steps
    on a3's gradient × the bound's weight (the same LossBound fed the same losses, whose
    numbers test_methods_fast pins by hand), a3 is noted, and a3's own ∂L/∂A is unweighted;
    the honest steps are plain SGD."""
    server, acts, labels = toy_step((4, 4, 4, 4))
    acts[3] = acts[3] * 50
    books = SimpleNamespace(down_weighted={}, down_weighted_steps={}, gradient_clipped={},
                            gradient_clipped_steps={})
    defences = Defences(Settings(loss_bound=3.0), 3, None, books)  # type: ignore[arg-type]
    method = SplitFedV2.__new__(SplitFedV2)
    method.trainer = SimpleNamespace(  # type: ignore[assignment]
        server=server, optimizer=torch.optim.SGD(server.parameters(), lr=0.1),
        defences=defences)
    oracle = LossBound(3.0, floor=LOSS_FLOOR * math.log(3))
    ref = copy.deepcopy(server)
    ce = nn.functional.cross_entropy
    for k in range(4):
        leaf = acts[k].clone().requires_grad_(True)
        loss = ce(ref(leaf), labels[k])
        *grads, act_grad = torch.autograd.grad(loss, [*ref.parameters(), leaf])
        weights = oracle.weights([f"a{k}"], [float(loss.detach())], {}, {})
        weight = 1.0 if weights is None else weights[0]
        assert (weight < 0.5) == (k == 3) and (weight < 1.0) == (k == 3)
        value, got = method.server_update([f"a{k}"], [acts[k]], [labels[k]])
        assert value == pytest.approx(float(loss.detach()), rel=1e-6)
        with torch.no_grad():
            for p, g in zip(ref.parameters(), grads, strict=True):
                p.sub_(0.1 * weight * g)
        for p, q in zip(server.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-5)
        torch.testing.assert_close(got[f"a{k}"], act_grad, rtol=0, atol=1e-6)
    assert list(books.down_weighted) == ["a3"]


def test_splitfed_v1_averages_its_server_copies_as_blocks_it_trained_itself() -> None:
    """V1's copies are the coordinator's own work: combined under the run's aggregator by
    the participants' sizes against the global block they started from, but not shown to
    the direction check (`uploaded=False`: a label-skewed device's copy honestly points
    away from the others); the global block loads the result and the copies are dropped."""
    from jetsplit.server.methods.splitfed import SplitFedV1

    server = nn.Linear(2, 2)
    copies = {a: nn.Linear(2, 2) for a in ("a0", "a1")}
    calls: list[dict[str, Any]] = []

    def aggregate(states: dict[str, Any], weights: dict[str, float], **kw: Any) -> Any:
        calls.append({"states": sorted(states), "weights": weights, **kw,
                      "reference": {k: v.copy() for k, v in kw["reference"].items()}})
        return {k: v * 0 + 0.5 for k, v in states["a1"].items()}

    books = SimpleNamespace(timed=lambda phase: contextlib.nullcontext())
    method = SplitFedV1.__new__(SplitFedV1)
    method.trainer = SimpleNamespace(  # type: ignore[assignment]
        server=server, books=books,
        defences=SimpleNamespace(aggregate=aggregate,
                                 sizes=lambda agents: {a: 10.0 * (i + 1)
                                                       for i, a in enumerate(agents)}))
    method.copies, method.optimizers = copies, {}  # type: ignore[assignment]
    before = server.weight.detach().clone()
    method.end_round(["a0", "a1"])
    (call,) = calls
    assert call["states"] == ["a0", "a1"] and call["weights"] == {"a0": 10.0, "a1": 20.0}
    assert call["uploaded"] is False and call["block"] == "server copy"
    np.testing.assert_array_equal(call["reference"]["server/weight"], before.numpy())
    assert torch.equal(server.weight.detach(), torch.full((2, 2), 0.5))
    assert method.copies == {} and method.optimizers == {}
