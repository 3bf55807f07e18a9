"""Fast tier: a forward reply with NaN or infinity is dropped the same way whether the check
runs on the host (CPU coordinators) or where the activations land (`finite_on_device`, the
CUDA path): same agents kept, in order, same tensors, same miss and reason in the books."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jetsplit.server.defences.size_claims import LabelTally
from jetsplit.server.defences.step_deadlines import StepDeadlines
from jetsplit.server.engines.seam import Outcome, Reply
from jetsplit.server.training.placement import all_finite
from jetsplit.server.training.round_books import RoundBooks
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import NON_FINITE, Trainer

pytestmark = pytest.mark.fast

SHAPE = (2, 3)


def _activations() -> dict[str, np.ndarray]:
    """Unequal batches; a1 carries one NaN, a3 one infinity, a0 and a2 are clean."""
    rng = np.random.default_rng(5)
    acts = {a: rng.standard_normal((n, *SHAPE)).astype(np.float32)
            for a, n in (("a0", 3), ("a1", 2), ("a2", 4), ("a3", 1))}
    acts["a1"][1, 0, 2] = np.nan
    acts["a3"][0, 1, 1] = -np.inf
    return acts


def _trainer(on_device: bool, device: str = "cpu") -> Trainer:
    trainer = object.__new__(Trainer)
    trainer.defences = SimpleNamespace(labels=LabelTally(3))  # type: ignore[assignment]
    trainer.books = RoundBooks()
    trainer.deadlines = StepDeadlines(60.0)
    trainer.settings = Settings(codec="fp32")
    trainer.round, trainer.device, trainer.finite_on_device = 0, torch.device(device), on_device
    trainer.bundle = SimpleNamespace(spec=SimpleNamespace(num_classes=3))  # type: ignore[assignment]
    trainer.cut = lambda agent: 1  # type: ignore[method-assign]
    trainer.activation_shape_at = lambda cut: SHAPE  # type: ignore[method-assign]
    acts = _activations()
    trainer.engine = SimpleNamespace(  # type: ignore[assignment]
        send_and_receive=lambda commands, **kw: Outcome(
            {a: Reply(a, "forward", {}, {"activations": acts[a],
                                         "labels": np.arange(len(acts[a])) % 3})
             for a in commands}, kind="forward"))
    return trainer


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch sees no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_check_drops_what_the_host_check_drops(device: str) -> None:
    """On CUDA: the pinned transfer and the check on the card, against the host check."""
    batches = {"a0": 3, "a1": 2, "a2": 4, "a3": 1}
    results = {}
    for on_device in (False, True):
        trainer = _trainer(on_device, device)
        agents, acts, labels = trainer.forward(batches, step=0)
        results[on_device] = (agents, acts, labels, dict(trainer.books.missed),
                              dict(trainer.defences.labels.counts))
    host, card = results[False], results[True]
    assert host[0] == card[0] == ["a0", "a2"]
    for h, d in zip(host[1] + host[2], card[1] + card[2], strict=True):
        assert h.device.type == d.device.type == device
        assert torch.equal(h, d)
    assert [a.shape[0] for a in card[1]] == [3, 4]
    assert host[3] == card[3] == {"a1": f"error: bad reply: {NON_FINITE}",
                                    "a3": f"error: bad reply: {NON_FINITE}"}
    assert host[4] == card[4] == {"a0": [1, 1, 1], "a2": [2, 1, 1]}  # only kept replies


@pytest.mark.parametrize("device", DEVICES)
def test_all_finite_reads_each_tensor(device: str) -> None:
    clean = torch.ones(2, 2, device=device)
    assert all_finite([]) == []
    assert all_finite([clean, torch.tensor([1.0, float("nan")], device=device), clean,
                       torch.tensor([[float("inf")]], device=device)]) == [True, False, True,
                                                                            False]
