"""Whose uploads pull against the fleet's (server/defences/update_direction.py), on a hand-built
fleet
of five devices that start from a zero block: four honest updates and a4's reversed one,
a tensor only three devices hold (mixed cuts: not judged on), an integer buffer. The
cosines with the coordinate-wise median update are computed by hand; the reverser and only
the reverser is opposed; evidence halves each round and a mended device comes back; the
trainer leaves the reverser's upload out of the average and says so."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jetsplit.server.defences.defences import Defences
from jetsplit.server.defences.update_direction import UpdateDirection, update_cosines
from jetsplit.server.training.round_books import RoundBooks
from jetsplit.server.training.settings import Settings

pytestmark = pytest.mark.fast

# updates (the reference is zero): w's median is [1, 0, 0], b's is [1]: m = [1, 0, 0, 1]
W = {"a0": [1, 0, 0], "a1": [2, 1, 0], "a2": [1, 1, 1], "a3": [3, 0, 1], "a4": [-2, -1, 0]}
B = {"a0": [1], "a1": [1], "a2": [2], "a3": [0], "a4": [-1]}
# by hand: u·m / (|u| |m|), |m|² = 2
COSINES = {"a0": 2 / math.sqrt(2 * 2), "a1": 3 / math.sqrt(6 * 2), "a2": 3 / math.sqrt(7 * 2),
           "a3": 3 / math.sqrt(10 * 2), "a4": -3 / math.sqrt(6 * 2)}
REFERENCE = {"w": np.zeros(3, np.float32), "b": np.zeros(1, np.float32),
             "c": np.zeros(2, np.float32), "n": np.zeros(1, np.int64)}


def _states(mended: bool = False) -> dict[str, dict[str, np.ndarray]]:
    states = {}
    for i, agent in enumerate(sorted(W)):
        w, b = W[agent], B[agent]
        if mended and agent == "a4":  # a4 now sends a1's update
            w, b = W["a1"], B["a1"]
        state = {"w": np.array(w, np.float32), "b": np.array(b, np.float32),
                 "n": np.array([7 * i], np.int64)}  # an integer buffer: never compared
        if i < 3:  # held by three devices only: too few for a fleet median
            state["c"] = np.array([-50.0, 9.0], np.float32) * (1 if i else -1)
        states[agent] = state
    return states


def test_cosines_with_the_median_update_by_hand() -> None:
    cosines = update_cosines(_states(), REFERENCE)
    assert cosines == pytest.approx(COSINES, abs=1e-6)
    shifted = {a: {n: v + 5 if n != "n" else v for n, v in s.items()}
               for a, s in _states().items()}  # the same updates from another start
    start = {n: v + 5 if n != "n" else v for n, v in REFERENCE.items()}
    assert update_cosines(shifted, start) == pytest.approx(COSINES, abs=1e-6)


def test_zero_updates_get_no_cosine_and_too_few_holders_judge_nothing() -> None:
    states = _states()
    states["a2"] = {n: REFERENCE[n].copy() for n in ("w", "b", "n")}  # did not move
    assert "a2" not in update_cosines(states, REFERENCE)
    states["a2"] = {"w": np.full(3, -3e38, np.float32), "b": np.full(1, -3e38, np.float32)}
    huge = update_cosines(states, REFERENCE)  # its squared norm overflows float32, not 64
    # the medians move: w [1, 0, 0], b [0]; u ∝ (-1, -1, -1, -1): cos = -1 / 2
    assert huge["a2"] == pytest.approx(-0.5, abs=1e-6)
    check = UpdateDirection()
    check.observe("client", {a: _states()[a] for a in ("a0", "a1", "a4")},
                  REFERENCE)  # 3 devices < 4
    assert check.opposed == {} and check.counts == {}
    check.observe("client", _states(), None)  # no reference: no updates
    assert check.counts == {}


def test_the_reverser_and_only_the_reverser_is_opposed() -> None:
    check = UpdateDirection()
    check.observe("client", _states(), REFERENCE)
    assert sorted(check.opposed) == [("client", "a4")]
    assert check.opposed["client", "a4"] == (
        "update opposed to the fleet's: mean cosine with the median update -0.87 (this time "
        "-0.87; back in over +0.25)")
    assert check.excluded("client", ["a0", "a1", "a2", "a3", "a4"]) == {"a4"}
    assert check.excluded("model", ["a0", "a1", "a2", "a3", "a4"]) == set()
    assert check.excluded("client", ["a0", "a4"]) == set()  # half of them: nobody
    # evidence is per block: an honest upload of another block (SplitFed V1's server copy,
    # trained by the coordinator) does not clear its reversed client block
    check.observe("server copy", _states(mended=True), REFERENCE)
    assert sorted(check.opposed) == [("client", "a4")]


def test_evidence_decays_each_round_and_a_mended_device_comes_back() -> None:
    """DECAY = 0.9: two reversed rounds, then a4 sends honest updates. One honest round
    does not outweigh them, (0.9 · 1.9 · −0.866 + 1) / 2.71 < 0; after two its running mean
    is 0.165, not yet over RETURN_ABOVE (0.25); after three, 0.369: it is back."""
    check = UpdateDirection()
    check.observe("client", _states(), REFERENCE)
    check.new_round()
    check.observe("client", _states(), REFERENCE)
    assert check.counts["client", "a4"] == pytest.approx(1.9)
    assert check.sums["client", "a4"] == pytest.approx(1.9 * COSINES["a4"], abs=1e-6)
    check.new_round()
    check.observe("client", _states(mended=True), REFERENCE)  # a4 = a1: the median moves
    # w columns [1,2,1,3,2], [0,1,1,0,1], [0,0,1,1,0] → [2, 1, 0]; b [1,1,2,0,1] → 1: m = u
    assert check.last["client", "a4"] == pytest.approx(1.0)
    assert check.counts["client", "a4"] == pytest.approx(2.71)
    assert check.sums["client", "a4"] == pytest.approx(1.71 * COSINES["a4"] + 1, abs=1e-6)
    assert sorted(check.opposed) == [("client", "a4")]
    check.new_round()
    check.observe("client", _states(mended=True), REFERENCE)
    assert check.sums["client", "a4"] / check.counts["client", "a4"] == pytest.approx(
        0.165, abs=1e-3)
    assert sorted(check.opposed) == [("client", "a4")]
    check.new_round()
    check.observe("client", _states(mended=True), REFERENCE)
    assert check.sums["client", "a4"] / check.counts["client", "a4"] == pytest.approx(
        0.369, abs=1e-3)
    assert check.opposed == {}


def test_off_judges_nothing() -> None:
    check = UpdateDirection(enabled=False)
    check.observe("client", _states(), REFERENCE)
    assert check.opposed == {} and check.counts == {}


def _trainer(direction: str = "on") -> Defences:
    """The defences that combine uploads (no registry needed for that)."""
    settings = Settings(aggregator="mean", outlier_bound=0.0, direction_check=direction)
    return Defences(settings, 3, None, RoundBooks())  # type: ignore[arg-type]


def test_the_reversers_upload_is_left_out_of_the_average() -> None:
    """Weights 1, 2, 3, 4 and the reverser's 100 (it would own the mean): the average is
    over a0..a3, and the books say why."""
    weights = {"a0": 1, "a1": 2, "a2": 3, "a3": 4, "a4": 100}
    trainer = _trainer()
    merged = trainer.aggregate(_states(), weights, reference=REFERENCE, block="model")
    honest = (1 * np.array(W["a0"]) + 2 * np.array(W["a1"]) + 3 * np.array(W["a2"])
              + 4 * np.array(W["a3"])) / 10
    np.testing.assert_allclose(merged["w"], honest, rtol=1e-6)
    assert trainer.books.aggregation == {
        "a4": "model: left out: " + trainer.direction.opposed["model", "a4"]}
    assert trainer.books.influence.result()["a4"] == 0.0
    off = _trainer("off").aggregate(_states(), weights, reference=REFERENCE)
    everyone = sum(weights[a] * np.array(W[a], float) for a in W) / sum(weights.values())
    np.testing.assert_allclose(off["w"], everyone, rtol=1e-6)


def test_left_out_names_the_opposed_and_the_outliers_of_the_latest_average() -> None:
    """The devices whose next upload is not expected to count (FedAvg's probes): a4
    reversed (direction check) and a3 scaled ×1000 (over the outlier bound, 10× the median
    norm), for the block they uploaded and only among those asked about. Once a3 sends an
    honest update again the bound's verdict is gone; a4's evidence keeps it out."""
    weights = {"a0": 1, "a1": 2, "a2": 3, "a3": 4, "a4": 5}
    trainer = _trainer()
    trainer.settings = Settings(aggregator="mean", outlier_bound=10.0)
    agents = sorted(W)
    states = _states()
    states["a3"] = {**states["a3"], "w": states["a3"]["w"] * 1000}
    trainer.aggregate(states, weights, reference=REFERENCE, block="model")
    assert trainer.outliers == {"model": frozenset({"a3"})}
    assert trainer.left_out("model", agents) == {"a3", "a4"}
    assert trainer.left_out("model", ["a0", "a3"]) == {"a3"}
    assert trainer.left_out("client", agents) == set()
    trainer.direction.new_round()
    trainer.aggregate(_states(), weights, reference=REFERENCE, block="model")
    assert trainer.outliers == {"model": frozenset()}
    assert trainer.left_out("model", agents) == {"a4"}


def test_a_sampled_cosine_is_near_the_whole_one() -> None:
    """Six devices, 300,000 coordinates: a shared direction plus each device's own noise,
    a5's reversed. Over 4,096 sampled coordinates each cosine is within 0.05 of the exact
    one (its spread is about 1/64), the reverser stays negative, and the sample is the same
    from call to call."""
    rng = np.random.default_rng(1)
    shared = rng.normal(size=300_000).astype(np.float32)
    start = {"w": rng.normal(size=(600, 500)).astype(np.float32)}
    states = {}
    for i in range(6):
        update = (shared * (0.5 + 0.3 * i) + rng.normal(size=300_000) * (0.5 + 0.2 * i)
                  ).astype(np.float32) * (-1 if i == 5 else 1)
        states[f"a{i}"] = {"w": start["w"] + update.reshape(600, 500)}
    exact = update_cosines(states, start, sample=10**9)
    sampled = update_cosines(states, start, sample=4096)
    assert sampled == pytest.approx(exact, abs=0.05)
    assert exact["a5"] < -0.2 and sampled["a5"] < -0.2
    assert update_cosines(states, start, sample=4096) == sampled


def test_blocks_the_coordinator_trained_are_not_judged() -> None:
    """SplitFed V1's and Ampere's server copies (`uploaded=False`): nobody is left out for
    their direction, and no evidence is kept."""
    weights = {"a0": 1, "a1": 2, "a2": 3, "a3": 4, "a4": 100}
    trainer = _trainer()
    merged = trainer.aggregate(_states(), weights, reference=REFERENCE, block="server copy",
                               uploaded=False)
    everyone = sum(weights[a] * np.array(W[a], float) for a in W) / sum(weights.values())
    np.testing.assert_allclose(merged["w"], everyone, rtol=1e-6)
    assert trainer.direction.counts == {} and trainer.books.aggregation == {}


def test_a_left_out_device_weighs_0_over_every_parameter_it_uploaded() -> None:
    """A round with two averages: a4's reversed client block (4 float parameters, left out)
    and a server copy of 6 parameters where it weighs 100 of 110. Its share of the round is
    0 over the first 4 and 100/110 over the other 6, not the copy's share alone."""
    weights = {"a0": 1, "a1": 2, "a2": 3, "a3": 4, "a4": 100}
    trainer = _trainer()
    trainer.aggregate(_states(), weights, reference=REFERENCE)
    copies = {a: {"s": np.full(6, float(i), np.float32)} for i, a in enumerate(sorted(W))}
    trainer.aggregate(copies, weights, reference={"s": np.zeros(6, np.float32)},
                      block="server copy", uploaded=False)
    assert trainer.books.influence.result()["a4"] == pytest.approx(100 / 110 * 6 / 10,
                                                                   abs=1e-6)


@pytest.mark.parametrize(("mean", "was_opposed", "opposed"), [
    (0.01, True, True), (0.01, False, False),  # under the return bound: only who was out
    (-0.05, True, True), (-0.05, False, True),  # under OPPOSED_BELOW (0): out
    (0.26, True, False), (0.26, False, False)])
def test_the_entry_and_return_bounds(mean: float, was_opposed: bool, opposed: bool) -> None:
    """Evidence set by hand (sum S over 10), then a round in which a4 sends a1's update
    (cosine 1): (0.9 S + 1) / 10 = `mean`. Under 0 a device is out; out, it is back only
    over +0.25; in between, it stays as it was."""
    check = UpdateDirection()
    check.sums["client", "a4"] = (10 * mean - 1) / 0.9
    check.counts["client", "a4"] = 10.0
    if was_opposed:
        check.opposed["client", "a4"] = "earlier"
    check.new_round()
    check.observe("client", _states(mended=True), REFERENCE)
    assert check.sums["client", "a4"] / check.counts["client", "a4"] == pytest.approx(mean)
    assert (("client", "a4") in check.opposed) is opposed
