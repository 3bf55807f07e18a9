"""Fast tier: what FedAvg's round reports from its devices' replies (server/methods/fedavg.py),
beside the averages pinned in test_round_wiring.py: the round's loss is the mean of the
usable reported losses, and each device's whole-model samples are booked only with a usable
loss. Written for a survivor of `make mutation MUTATION=methods_splitfed` (docs/testing.md)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from torch import nn

from jetsplit.models.weights import to_arrays
from jetsplit.server.engines.seam import Command, Outcome, Reply
from jetsplit.server.methods.fedavg import FedAvg
from jetsplit.server.training.round_books import RoundBooks

pytestmark = pytest.mark.fast


def test_fedavg_reports_the_mean_of_the_usable_losses_and_books_their_samples() -> None:
    """Four replies: a0 (24 samples, loss 0.5) and a1 (48, 1.5) are usable; a2's loss is
    NaN and a3's sample count is not an integer, so neither counts. The round's loss is
    (0.5 + 1.5) / 2 = 1.0 and only a0 and a1 have whole-model samples booked; all four
    devices are still pulled and averaged."""
    server = nn.Linear(2, 2)
    metas: dict[str, dict[str, Any]] = {
        "a0": {"samples": 24, "loss": 0.5}, "a1": {"samples": 48, "loss": 1.5},
        "a2": {"samples": 24, "loss": float("nan")}, "a3": {"samples": "24", "loss": 0.7}}
    sent: dict[str, Command] = {}

    def send_and_receive(commands: dict[str, Command], **_: Any) -> Outcome:
        sent.update(commands)
        return Outcome({a: Reply(a, "train", metas[a], {}) for a in sorted(commands)})

    state = to_arrays(server, "server")
    pulled: list[tuple[list[str], bool]] = []
    books = RoundBooks()
    trainer = SimpleNamespace(
        live=lambda agents: list(agents), global_client={}, server=server, round=0,
        settings=SimpleNamespace(local_steps=2), client_optimizer=SimpleNamespace(lr=0.1),
        books=books, engine=SimpleNamespace(send_and_receive=send_and_receive),
        step_deadline=lambda kind: 60.0,
        pull=lambda agents, parts, release: pulled.append((list(agents), release)) or {
            a: dict(state) for a in agents},
        require_update=lambda selected, states: None,
        defences=SimpleNamespace(
            left_out=lambda block, live: set(), batches=lambda live, *_: dict.fromkeys(live, 8),
            sizes=lambda agents: dict.fromkeys(agents, 1),
            aggregate=lambda states, sizes, **_: next(iter(states.values()))))
    method = FedAvg.__new__(FedAvg)
    method.trainer = trainer  # type: ignore[assignment]
    assert method.run_round(["a0", "a1", "a2", "a3"]) == pytest.approx(1.0)
    assert dict(books.full_samples) == {"a0": 24, "a1": 48}
    # the devices drop their models as they upload them: no release exchange of its own
    assert pulled == [(["a0", "a1", "a2", "a3"], True)]
    assert sorted(sent) == ["a0", "a1", "a2", "a3"]
    assert {c.meta["steps"] for c in sent.values()} == {2}
    np.testing.assert_array_equal(to_arrays(server, "server")["server/weight"],
                                  state["server/weight"])


@pytest.mark.parametrize("round_", [0, 1, 2])
def test_fedavg_pushes_the_global_model_from_round_1_on(round_: int) -> None:
    """Round 0's devices train from the bundle they were given; from round 1 on each round
    starts with the global client block and server part pushed to them."""
    server = nn.Linear(2, 2)
    pushed: list[tuple[list[str], list[str]]] = []
    trainer = SimpleNamespace(
        live=lambda agents: list(agents), global_client={"client/w": np.zeros(2)},
        server=server, round=round_, settings=SimpleNamespace(local_steps=1),
        client_optimizer=SimpleNamespace(lr=0.1), books=RoundBooks(),
        push=lambda live, state: pushed.append((list(live), sorted(state))) or list(live),
        engine=SimpleNamespace(send_and_receive=lambda commands, **_: Outcome({})),
        step_deadline=lambda kind: 60.0, pull=lambda agents, parts, release: {},
        require_update=lambda selected, states: None,
        defences=SimpleNamespace(left_out=lambda block, live: set(),
                                 batches=lambda live, *_: dict.fromkeys(live, 8)))
    method = FedAvg.__new__(FedAvg)
    method.trainer = trainer  # type: ignore[assignment]
    assert method.run_round(["a0", "a1"]) is None  # nobody replied
    assert pushed == ([] if round_ == 0 else [
        (["a0", "a1"], ["client/w", "server/bias", "server/weight"])])
