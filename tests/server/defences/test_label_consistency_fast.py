"""Whose labels do not fit their activations (server/defences/label_check.py), on hand-built
fleets: three classes whose activations sit at distinct points, four devices of unequal
sizes, one that shifts its labels by one. The shifter and only the shifter is inconsistent,
from its second judgement in a row; one judgement over half (an honest device on an untrained
block) changes nothing; a class held by fewer than three devices is not judged; evidence
halves each round; the trainer leaves the shifter out of the server step and of the
averages, and says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jetsplit.server.defences.defences import Defences
from jetsplit.server.defences.label_check import CONFIRM, MIN_SAMPLES, LabelConsistency
from jetsplit.server.training.round_books import RoundBooks
from jetsplit.server.training.settings import Settings

pytestmark = pytest.mark.fast

CENTRES = torch.tensor([[4.0, 0, 0, 0, 0, 0], [0, 4.0, 0, 0, 0, 0], [0, 0, 4.0, 0, 0, 0]])


def _batch(counts: list[int], shift: int = 0, seed: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`counts[c]` samples of class c near CENTRES[c], labelled (c + shift) mod 3, as
    activations of shape (n, 2, 3)."""
    generator = torch.Generator().manual_seed(seed)
    truth = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    x = CENTRES[truth] + 0.3 * torch.randn(len(truth), 6, generator=generator)
    return x.view(-1, 2, 3), (truth + shift) % 3


def _observe(check: LabelConsistency, fleet: dict[str, tuple[list[int], int]],
             times: int = 1) -> None:
    """`times` steps of the same batches (each device's seed is its position)."""
    agents = sorted(fleet)
    batches = [_batch(fleet[a][0], fleet[a][1], seed=i) for i, a in enumerate(agents)]
    for _ in range(times):
        check.observe(agents, [x for x, _ in batches], [y for _, y in batches])


def test_the_shifter_and_only_the_shifter_is_inconsistent() -> None:
    check = LabelConsistency(3, seed=0)
    # unequal sizes; a3 holds the most and shifts c → c + 1
    fleet = {"a0": ([10, 12, 9], 0), "a1": ([20, 8, 8], 0), "a2": ([8, 30, 10], 0),
             "a3": ([40, 40, 40], 1)}
    _observe(check, fleet)
    assert check.inconsistent == {}  # one judgement is not a verdict
    assert check.against == {"a0": 0, "a1": 0, "a2": 0, "a3": 1}
    _observe(check, fleet)
    assert CONFIRM == 2 and sorted(check.inconsistent) == ["a3"]
    assert check.inconsistent["a3"] == (
        "labels inconsistent with its activations: 240 of 240 samples sit nearest another "
        "class's (0→2, 1→0, 2→1)")
    assert check.excluded(["a0", "a1", "a2", "a3"]) == {"a3"}
    assert check.excluded(["a3"]) == set()  # everyone inconsistent: nobody trusted less
    assert check.counts[(2, 3)]["a1"].tolist() == [40, 16, 16]


def test_one_judgement_over_half_then_under_changes_nothing_either_way() -> None:
    """The measured false verdict: an honest device over half at one step, under at the
    next; and a shifter under at one step (after a new round), over at the next. a3 shifts
    c → c + 1 or labels truly; its per-label tallies (wrong W, right R) are cumulative."""
    honest = {"a0": ([10, 10, 10], 0), "a1": ([10, 10, 10], 0), "a2": ([10, 10, 10], 0)}
    check = LabelConsistency(3, seed=3)

    def step(n: int, shift: int) -> None:
        _observe(check, {**honest, "a3": ([n, n, n], shift)})

    step(8, 1)  # W 8, R 0: over half once
    assert check.inconsistent == {} and check.against["a3"] == 1
    step(40, 0)  # W 8, R 40: under; the count restarts, no verdict was given
    assert check.inconsistent == {} and check.against["a3"] == 0
    step(100, 1)  # W 108, R 40
    assert check.inconsistent == {}
    step(100, 1)  # W 208, R 40: the second in a row
    assert sorted(check.inconsistent) == ["a3"] and check.against["a3"] == 0
    step(200, 0)  # W 208, R 240: under once, still left out
    assert sorted(check.inconsistent) == ["a3"] and check.against["a3"] == 1
    step(100, 1)  # W 308, R 240: over again, the count restarts
    assert sorted(check.inconsistent) == ["a3"] and check.against["a3"] == 0
    step(200, 0)  # W 308, R 440: under once
    _observe(check, honest)  # a3 sent nothing: not judged, its count stands
    assert sorted(check.inconsistent) == ["a3"] and check.against["a3"] == 1
    step(200, 0)  # W 308, R 640: the second under in a row, back in
    assert check.inconsistent == {} and check.against["a3"] == 0


def test_a_class_held_by_fewer_than_three_devices_is_not_judged() -> None:
    check = LabelConsistency(3, seed=1)
    # class 2 is held (≥ 8) by a0 and a3 only: no fleet centroid for it; a3 labels its 1s as
    # 2 (judged by nothing) and its 0s as 1 (judged wrong: 30 of its 30 judged samples)
    _observe(check, {"a0": ([10, 10, 10], 0), "a1": ([10, 10, 2], 0), "a2": ([10, 10, 0], 0),
                     "a3": ([30, 30, 0], 1)}, times=2)
    assert check.inconsistent["a3"].startswith(
        "labels inconsistent with its activations: 60 of 60 samples")
    assert sorted(check.inconsistent) == ["a3"]
    # a device with fewer than MIN_SAMPLES judged is left alone however wrong (one step of
    # MIN_SAMPLES - 1 samples, judged at the next once it has twice that: over then)
    small = LabelConsistency(3, seed=1)
    few = {"a0": ([10, 10, 10], 0), "a1": ([10, 10, 10], 0), "a2": ([10, 10, 10], 0),
           "a3": ([int(MIN_SAMPLES) - 1, 0, 0], 1)}
    _observe(small, few)
    assert small.inconsistent == {} and small.against["a3"] == 0
    _observe(small, few)
    assert small.inconsistent == {} and small.against["a3"] == 1


def test_evidence_halves_each_round_and_a_mended_device_comes_back() -> None:
    check = LabelConsistency(3, seed=2)
    honest = {"a0": ([10, 10, 10], 0), "a1": ([10, 10, 10], 0), "a2": ([10, 10, 10], 0)}
    _observe(check, {**honest, "a3": ([8, 8, 8], 1)}, times=2)
    assert sorted(check.inconsistent) == ["a3"]
    check.new_round()
    assert check.counts[(2, 3)]["a3"].tolist() == [8, 8, 8]
    assert check.counts[(2, 3)]["a0"].tolist() == [10, 10, 10]
    # it now labels 20 of each truly: 8 (halved) wrong against 20 right per label; back
    # after two such steps
    _observe(check, {**honest, "a3": ([20, 20, 20], 0)})
    assert "a3" in check.inconsistent
    _observe(check, {**honest, "a3": ([20, 20, 20], 0)})
    assert "a3" not in check.inconsistent


def test_off_judges_nothing_and_the_projection_is_seeded() -> None:
    off = LabelConsistency(3, enabled=False)
    _observe(off, {"a0": ([10, 10, 10], 0), "a1": ([10, 10, 10], 0), "a2": ([10, 10, 10], 0),
                   "a3": ([40, 40, 40], 1)})
    assert off.inconsistent == {} and off.sums == {}
    x = torch.zeros(1, 2, 3)
    assert torch.equal(LabelConsistency(3, seed=5)._projection((2, 3), x),
                       LabelConsistency(3, seed=5)._projection((2, 3), x))
    assert not torch.equal(LabelConsistency(3, seed=5)._projection((2, 3), x),
                           LabelConsistency(3, seed=6)._projection((2, 3), x))


def _trainer() -> Defences:
    """The defences, their label check having seen a3's labels shifted."""
    trainer = Defences(Settings(), 3, None, RoundBooks())  # type: ignore[arg-type]
    _observe(trainer.consistency, {"a0": ([10, 12, 9], 0), "a1": ([20, 8, 8], 0),
                                   "a2": ([8, 30, 10], 0), "a3": ([40, 40, 40], 1)}, times=2)
    return trainer


def test_the_trainer_leaves_the_shifter_out_of_the_step_and_counts_it() -> None:
    trainer = _trainer()
    agents = ["a0", "a1", "a2", "a3"]
    acts = [torch.full((2, 2, 3), float(i)) for i in range(4)]
    labels = [torch.tensor([i % 3, 0]) for i in range(4)]
    for _ in range(2):
        kept, kept_acts, kept_labels = trainer.trusted(agents, acts, labels)
    assert kept == ["a0", "a1", "a2"]
    assert [float(a[0, 0, 0]) for a in kept_acts] == [0.0, 1.0, 2.0]
    assert [y.tolist() for y in kept_labels] == [[0, 0], [1, 0], [2, 0]]
    assert trainer.books.excluded_steps == {"a3": 2}
    assert trainer.books.excluded["a3"].startswith(
        "2 steps left out of the server update, last: labels inconsistent")
    assert trainer.trusted(agents[:3], acts[:3], labels[:3])[0] == agents[:3]


def test_the_shifters_upload_is_left_out_of_every_average() -> None:
    """Weights 1, 2, 3, 100 (the shifter would own the mean): the average is over a0..a2."""
    trainer = _trainer()
    trainer.settings = Settings(aggregator="mean", outlier_bound=0.0)
    states = {a: {"w": np.full(2, float(i + 1), np.float32)}
              for i, a in enumerate(["a0", "a1", "a2", "a3"])}
    merged = trainer.aggregate(states, {"a0": 1, "a1": 2, "a2": 3, "a3": 100})
    np.testing.assert_allclose(merged["w"], np.full(2, (1 * 1 + 2 * 2 + 3 * 3) / 6))
    assert trainer.books.aggregation == {
        "a3": "client: left out: " + trainer.consistency.inconsistent["a3"]}
    assert trainer.books.influence.result()["a3"] == 0.0


def test_an_inconsistent_device_only_probes_and_the_others_share_the_batch() -> None:
    """B = 60 over sizes 100, 200, 300 and the shifter's 1000: the shifter sends a probe of
    PROBE_BATCH samples, the others split all of B by their sizes (10, 20, 30), not
    60·n/1600."""
    from jetsplit.server.defences.label_check import PROBE_BATCH
    from jetsplit.server.defences.size_claims import ClaimBooks
    from jetsplit.server.engines.registry import FleetRegistry

    trainer = _trainer()
    registry = FleetRegistry()
    for agent, size in {"a0": 100, "a1": 200, "a2": 300, "a3": 1000}.items():
        registry.register(agent, {"agent": agent, "role": "client", "dataset": {"size": size}})
    trainer.registry = registry
    trainer.settings = Settings(batch=60)
    trainer.claims = ClaimBooks()
    assert trainer.batches(["a0", "a1", "a2", "a3"]) == {"a0": 10, "a1": 20, "a2": 30,
                                                         "a3": PROBE_BATCH}
    # a device whose work cannot count this round (FedAvg: uploads left out) probes too
    assert trainer.batches(["a0", "a1", "a2", "a3"], {"a0", "e9"}) == {
        "a0": PROBE_BATCH, "a1": 24, "a2": 36, "a3": PROBE_BATCH}
    assert trainer.batches(["a0"], {"a0"}) == {"a0": 60}  # never all of them
    assert trainer.batches(["a3"]) == {"a3": 60}  # alone: nobody is trusted less
    trainer.consistency.inconsistent.clear()
    assert trainer.batches(["a0", "a1", "a2", "a3"]) == {"a0": 4, "a1": 8, "a2": 11, "a3": 38}
