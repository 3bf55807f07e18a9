"""A device's registered |D_k| is a claim: every weight it sets is capped at a multiple of
the fleet's median claim (server/claims.py), and its own work still uses the raw claim.
Hand-computed on unequal sizes with one liar among honest devices and an edge that does
not count towards the median."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from jetsplit.server.aggregation import fedavg
from jetsplit.server.claims import ClaimBooks, capped, registered_size, size_cap
from jetsplit.server.cut_planning import mean_dataset_size
from jetsplit.server.registry import FleetRegistry
from jetsplit.server.settings import Settings
from jetsplit.server.trainer import Trainer

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


def _trainer(size_cap_factor: float, batch: int = 60) -> Trainer:
    """The trainer's size and batch books over a registry (no bundle needed for them)."""
    registry = FleetRegistry()
    for agent, size in {**HONEST, "a3": LIAR}.items():
        registry.register(agent, _registration(agent, size))
    registry.register("e0", _registration("e0", 50_000, role="edge"))  # not a client claim
    trainer = object.__new__(Trainer)
    trainer.engine = SimpleNamespace(registry=registry)  # type: ignore[assignment]
    trainer.settings = Settings(size_cap=size_cap_factor, batch=batch)
    trainer.claims = ClaimBooks()
    return trainer


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
    assert trainer.claims.capped == {"a3": {"claimed": LIAR, "weight": 1000}}
    assert [r.getMessage() for r in caplog.records].count(
        "agent a3 claims 1000000000 samples, over 1000 (the size cap × the fleet's median "
        "claim): it weighs as 1000") == 1
    # B_k = B·|D_k|/Σ|D_j| over the capped weights: 60·(100, 200, 300, 1000)/1600
    assert trainer.batches(agents) == {"a0": 4, "a1": 8, "a2": 11, "a3": 38}
    # FedAvg with those weights: the liar holds 1000/1600 of the average, not ~1
    states = {a: {"w": np.full(2, float(i), np.float32)} for i, a in enumerate(agents)}
    merged = fedavg(states, sizes)["w"]
    assert merged == pytest.approx(np.full(2, (0 * 100 + 1 * 200 + 2 * 300 + 3 * 1000) / 1600))


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
