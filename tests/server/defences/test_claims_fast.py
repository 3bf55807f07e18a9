"""A device's registered |D_k| is a claim: every weight it sets is capped at a multiple of
the fleet's median claim, and at the size provisioned for it where one was
(server/defences/size_claims.py);
its own work still uses the raw claim. Hand-computed on unequal sizes with one liar among
honest devices and an edge that does not count towards the median."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest

from jetsplit.server.cuts.planning import mean_dataset_size
from jetsplit.server.defences.aggregators import fedavg
from jetsplit.server.defences.defences import Defences
from jetsplit.server.defences.size_claims import (
    LabelTally,
    capped,
    registered_size,
    size_cap,
)
from jetsplit.server.defences.step_deadlines import StepDeadlines
from jetsplit.server.engines.registry import FleetRegistry
from jetsplit.server.engines.seam import Outcome, Reply
from jetsplit.server.training.round_books import RoundBooks
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

pytestmark = pytest.mark.fast

HONEST = {"a0": 100, "a1": 200, "a2": 300}
LIAR = 10**9


def _registration(agent: str, size: int, role: str = "client") -> dict:
    return {"agent": agent, "role": role, "dataset": {"size": size}}


def test_the_cap_is_a_multiple_of_the_median_claim() -> None:
    assert size_cap([100, 200, 300, LIAR], 4.0) == 1000  # median of 4: (200 + 300) / 2
    assert size_cap([100, 200, 300], 4.0) == 800
    assert size_cap([100, 200, 300], 2.5) == 500
    assert size_cap([3], 0.1) == 1  # never below one sample
    assert size_cap([0, 0, 7], 2.0) == 14  # zero claims do not pull the median down
    assert size_cap([100, 200], 0.0) is None  # factor 0: no cap
    assert size_cap([], 4.0) is None and size_cap([0], 4.0) is None
    assert capped({"a": 5, "b": 50}, 10) == {"a": 5, "b": 10}
    assert capped({"a": 5}, None) == {"a": 5}


def test_registered_size_takes_positive_ints_only() -> None:
    assert registered_size(_registration("a", 12)) == 12
    for bad in (0, -3, True, 1.5, "12", None):
        assert registered_size({"dataset": {"size": bad}}) is None
    assert registered_size({"dataset": "x"}) is None and registered_size({}) is None


def _trainer(size_cap_factor: float, batch: int = 60, claims: dict[str, int] | None = None,
             provisioned: dict[str, int] | None = None) -> Defences:
    """The defences' size and batch books over a registry (no bundle needed for them)."""
    registry = FleetRegistry()
    for agent, size in (claims or {**HONEST, "a3": LIAR}).items():
        registry.register(agent, _registration(agent, size))
    registry.register("e0", _registration("e0", 50_000, role="edge"))  # not a client claim
    settings = Settings(size_cap=size_cap_factor, batch=batch,
                        provisioned_sizes=provisioned or {})
    return Defences(settings, 2, registry, RoundBooks())


def test_a_lying_claim_weighs_as_the_cap_everywhere_the_trainer_reads_sizes(
        caplog: pytest.LogCaptureFixture) -> None:
    trainer = _trainer(4.0)
    agents = ["a0", "a1", "a2", "a3"]
    with caplog.at_level(logging.WARNING, "jetsplit.coordinator"):
        sizes = trainer.sizes(agents)
        trainer.sizes(agents)  # logged once per device and claim
    # median of the clients' claims (100, 200, 300, 10^9) is 250 → cap 1000; the edge's
    # 50,000 is not a client claim
    assert sizes == {"a0": 100, "a1": 200, "a2": 300, "a3": 1000}
    assert trainer.claimed_sizes(agents)["a3"] == LIAR  # its own work: the raw claim
    assert trainer.claims.capped == {"a3": {"claimed": LIAR, "weight": 1000, "by": "size cap"}}
    assert [r.getMessage() for r in caplog.records].count(
        "agent a3 claims 1000000000 samples, over 1000 (the size cap × the fleet's median "
        "claim): it weighs as 1000") == 1
    # B_k = B·|D_k|/Σ|D_j| over the capped weights: 60·(100, 200, 300, 1000)/1600
    assert trainer.batches(agents) == {"a0": 4, "a1": 8, "a2": 11, "a3": 38}
    # FedAvg with those weights: the liar holds 1000/1600 of the average, not ~1
    states = {a: {"w": np.full(2, float(i), np.float32)} for i, a in enumerate(agents)}
    merged = fedavg(states, sizes)["w"]
    assert merged == pytest.approx(np.full(2, (0 * 100 + 1 * 200 + 2 * 300 + 3 * 1000) / 1600))
    # a registration changes the fleet: the cap is taken again (median of 100, 200, 300,
    # 10^9, 10^9 is 300 → 1200), not kept from the fleet before
    trainer.registry.register("a4", _registration("a4", LIAR))
    assert trainer.sizes(agents)["a3"] == 1200


def test_an_honest_fleet_keeps_its_exact_sizes_and_the_cap_can_be_turned_off() -> None:
    trainer = _trainer(4.0)
    assert trainer.sizes(["a0", "a1", "a2"]) == HONEST  # within 4× the median
    assert trainer.claims.capped == {}
    off = _trainer(0.0)
    assert off.sizes(["a2", "a3"]) == {"a2": 300, "a3": LIAR}


def test_the_planner_mean_is_over_capped_claims() -> None:
    regs = {a: _registration(a, n) for a, n in {**HONEST, "a3": LIAR}.items()}
    assert mean_dataset_size(regs, 4.0) == round((100 + 200 + 300 + 1000) / 4)
    assert mean_dataset_size(regs, 0.0) == round((600 + LIAR) / 4)
    assert mean_dataset_size({"a": {"dataset": {"size": 0}}}) is None
    # provisioned a3 = 400, a1 = 150: (100 + 150 + 300 + 400) / 4, under the cap or not
    sizes = {"a3": 400, "a1": 150}
    assert mean_dataset_size(regs, 4.0, sizes) == mean_dataset_size(regs, 0.0, sizes) == 238


def test_a_provisioned_size_bounds_a_claim_at_the_truth_everywhere_the_trainer_reads_sizes(
        caplog: pytest.LogCaptureFixture) -> None:
    """a3 claims 10^9 and was provisioned 400; a1 claims 200 and was provisioned 150 (its
    data shrank, or it rounds up); a0 and a2 were not provisioned. The median is taken over
    the bounded claims (100, 150, 300, 400): 225, cap 4× = 900, which binds nobody."""
    trainer = _trainer(4.0, provisioned={"a3": 400, "a1": 150})
    agents = ["a0", "a1", "a2", "a3"]
    with caplog.at_level(logging.WARNING, "jetsplit.coordinator"):
        sizes = trainer.sizes(agents)
        trainer.sizes(agents)  # logged once per device and claim
    assert sizes == {"a0": 100, "a1": 150, "a2": 300, "a3": 400}
    assert trainer.claimed_sizes(agents) == {"a0": 100, "a1": 200, "a2": 300, "a3": LIAR}
    assert trainer.claims.capped == {
        "a1": {"claimed": 200, "weight": 150, "by": "provisioned size"},
        "a3": {"claimed": LIAR, "weight": 400, "by": "provisioned size"}}
    assert sorted(r.getMessage() for r in caplog.records) == [
        "agent a1 claims 200 samples, over the 150 provisioned for it: it weighs as 150",
        "agent a3 claims 1000000000 samples, over the 400 provisioned for it: it weighs as 400"]
    # B_k = 60·(100, 150, 300, 400)/950, rounded: a3's batch is its true share
    assert trainer.batches(agents) == {"a0": 6, "a1": 9, "a2": 19, "a3": 25}
    states = {a: {"w": np.full(2, float(i), np.float32)} for i, a in enumerate(agents)}
    merged = fedavg(states, sizes)["w"]
    assert merged == pytest.approx(np.full(2, (150 + 2 * 300 + 3 * 400) / 950))


def test_liars_cannot_raise_the_median_past_their_provisioned_sizes_and_the_cap_still_binds(
        ) -> None:
    """Three of four clients claim 10^9. Unprovisioned, the median is 10^9 and the cap binds
    nobody; provisioned (200, 300, 5000), the median of (100, 200, 300, 5000) is 250, so the
    size cap (4× = 1000) binds a3's provisioned 5000 too: the tighter bound wins, and is
    named."""
    liars = {"a0": 100, "a1": LIAR, "a2": LIAR, "a3": LIAR}
    assert _trainer(4.0, claims=liars).sizes(["a0", "a3"]) == {"a0": 100, "a3": LIAR}
    trainer = _trainer(4.0, claims=liars, provisioned={"a1": 200, "a2": 300, "a3": 5000})
    assert trainer.sizes(list(liars)) == {"a0": 100, "a1": 200, "a2": 300, "a3": 1000}
    assert trainer.claims.capped["a3"] == {"claimed": LIAR, "weight": 1000, "by": "size cap"}
    assert trainer.claims.capped["a2"] == {"claimed": LIAR, "weight": 300,
                                           "by": "provisioned size"}
    # cap off: the provisioned sizes alone
    off = _trainer(0.0, claims=liars, provisioned={"a1": 200, "a2": 300, "a3": 5000})
    assert off.sizes(list(liars)) == {"a0": 100, "a1": 200, "a2": 300, "a3": 5000}


def test_server_toml_takes_provisioned_sizes_as_a_table_and_refuses_bad_ones(
        tmp_path) -> None:  # noqa: ANN001
    from jetsplit.errors import ConfigError
    from jetsplit.server.run.config import load_server_config

    path = tmp_path / "server.toml"
    path.write_text('[train]\nalgorithm = "fedavg"\n[train.provisioned_sizes]\na0 = 1200\n'
                    "a1 = 800\n")
    assert load_server_config(path).settings().provisioned_sizes == {"a0": 1200, "a1": 800}
    for bad in ("a0 = 0", "a0 = -5", 'a0 = "12"', "a0 = 1.5", "a0 = 3000000000",
                '"../x" = 5'):
        path.write_text(f"[train.provisioned_sizes]\n{bad}\n")
        with pytest.raises(ConfigError) as err:
            load_server_config(path)
        assert "provisioned_sizes" in str(err.value) and "\n" not in str(err.value), bad


def test_a_histogram_the_labels_disprove_is_replaced_by_their_tally(
        caplog: pytest.LogCaptureFixture) -> None:
    """C = 4, so judging starts at 80 labels. An honest claim within the margin keeps its
    registered counts; a claim of everything on class 0 from a device that sends classes
    1 and 2 is replaced, once, and from then on its prior follows its tally."""
    tally = LabelTally(4)
    honest, liar = [10, 20, 30, 40], [100, 0, 0, 0]
    tally.add("a0", np.array([0] * 8 + [1] * 16 + [2] * 24 + [3] * 31))  # 79 labels
    tally.add("a1", np.array([1, 2] * 39 + [1]))  # 79 labels
    assert tally.prior_counts("a1", liar) == liar  # under 80 labels: not judged yet
    tally.add("a0", np.array([3]))
    tally.add("a1", np.array([2]))
    assert tally.counts["a1"] == [0, 40, 40, 0]
    # a0's tally (8, 16, 24, 32)/80 equals its claim: distance 0
    assert tally.prior_counts("a0", honest) == honest
    # a1: TV((1, 0, 0, 0), (0, .5, .5, 0)) = 1 > 0.1 + 1.5·√(4/80) = 0.4354
    with caplog.at_level(logging.WARNING, "jetsplit.coordinator"):
        assert tally.prior_counts("a1", liar) == [0, 40, 40, 0]
        tally.prior_counts("a1", liar)
    assert tally.replaced == {"a1": {"distance": 1.0, "bound": 0.4354, "labels": 80}}
    assert [r.getMessage() for r in caplog.records] == [
        "agent a1: its registered label histogram is 1.000 (total variation) from the 80 "
        "labels it sent, over 0.435: its prior now comes from those labels"]
    tally.add("a1", np.array([3, 3]))
    assert tally.prior_counts("a1", liar) == [0, 40, 40, 2]  # the running tally
    # off: every claim believed, nothing counted
    off = LabelTally(4, enabled=False)
    off.add("a1", np.array([1] * 100))
    assert off.prior_counts("a1", liar) == liar and off.counts == {}


def test_the_histogram_bound_edge_and_unusable_claims() -> None:
    """The bound at n = 160, C = 4: 0.1 + 1.5·√(1/40) = 0.33717; against a uniform tally a
    claim 0.34 away is replaced, one 0.33 away is not. Claims the distance cannot be taken
    on pass through (scala_math refuses them with its own message)."""
    tally = LabelTally(4)
    tally.add("a0", np.array([0] * 40 + [1] * 40 + [2] * 40 + [3] * 40))  # uniform, n = 160
    tally.add("a1", np.array([0] * 40 + [1] * 40 + [2] * 40 + [3] * 40))
    assert tally.prior_counts("a0", [42, 42, 42, 174]) == [42, 42, 42, 174]  # TV 0.33
    assert tally.prior_counts("a1", [41, 41, 41, 177]) == [40, 40, 40, 40]  # TV 0.34
    assert tally.replaced["a1"]["distance"] == 0.34
    for junk in (None, [1, 2, 3], [1, 2, 3, -4], [0, 0, 0, 0], [1, 2, 3, math.nan],
                 [1, 2, True, 4], "1234"):
        assert tally.prior_counts("a0", junk) == junk
    assert "a0" not in tally.replaced
    assert LabelTally(4).prior_counts("a9", [1, 2, 3, 4]) == [1, 2, 3, 4]  # sent nothing


def test_the_coordinator_counts_what_each_reply_carries() -> None:
    """The trainer's forward exchange feeds every accepted reply's labels to the tally
    (the labels it trains on, not the registration's)."""
    import torch

    trainer = object.__new__(Trainer)
    trainer.defences = _trainer(4.0)
    trainer.defences.labels = LabelTally(3)
    trainer.books = RoundBooks()
    trainer.deadlines = StepDeadlines(60.0)  # the step deadlines: nothing timed yet
    trainer.settings = Settings(codec="fp32")
    trainer.round, trainer.device, trainer.finite_on_device = 0, torch.device("cpu"), False
    trainer.activation_problem = lambda tensors, batch, agent="", **_: None  # type: ignore[method-assign]
    replies = {"a0": [0, 2, 2], "a1": [1, 1]}
    trainer.engine = SimpleNamespace(  # type: ignore[assignment]
        send_and_receive=lambda commands, **kw: Outcome(
            {a: Reply(a, "forward", {}, {"labels": np.array(replies[a]), "activations":
                                         np.zeros((len(replies[a]), 2), np.float32)})
             for a in commands}, kind="forward"))
    trainer.checked = lambda outcome, problem: outcome  # type: ignore[method-assign]
    trainer.forward({"a0": 3, "a1": 2}, step=0)
    trainer.forward({"a0": 3}, step=1)
    assert trainer.defences.labels.counts == {"a0": [2, 0, 4], "a1": [0, 2, 0]}  # a1: one step
