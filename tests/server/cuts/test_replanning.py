"""Live re-planning decisions (server/cuts/replanning.py) on the planner's own numbers: a Nano and
an Orin NX training AlexNet on MNIST with SCALA, planned as a trial plans them (compute
emulated 3× slower than the profiles: both at c* = 5); rows built as the fleet books write
them, with each device's measured compute exactly what the planner predicts times a chosen
slowdown."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from jetsplit.export.cost_model import client_block, get_costs
from jetsplit.export.planner import device_rows
from jetsplit.server.cuts.planning import plan_cuts, replanner_for
from jetsplit.server.cuts.replanning import BUNDLE_HEADER_BYTES, Replanner

MODEL, SHAPE, CLASSES = "alexnet", (1, 28, 28), 10
PROFILES = {"a0": "jetson-nano-4gb", "a1": "orin-nx-16gb"}
RUN: dict[str, Any] = {"batch": 32, "local_steps": 10, "rounds": 20, "dataset_size": 2000,
                       "codec": "fp32", "compute_dilation": 3.0}
BATCHES = {"a0": 32, "a1": 32}
GFLOPS_PER_ROUND = 40.0  # what each device computed in a round (any positive number)


def planned(threshold: float = 0.2) -> tuple[int, dict[str, int], Replanner]:
    server_cut, cuts, _ = plan_cuts("scala", MODEL, SHAPE, CLASSES, PROFILES,
                                    server_profile="x86-cpu", **RUN)
    replanner = replanner_for("scala", MODEL, SHAPE, CLASSES, PROFILES,
                              server_profile="x86-cpu", server_cut=server_cut,
                              threshold=threshold, **RUN)
    assert replanner is not None
    return server_cut, cuts, replanner


def row(round_: int, cuts: dict[str, int], replanner: Replanner, *,
        slow: dict[str, float] | None = None,
        links: dict[str, tuple[float, float]] | None = None) -> dict[str, Any]:
    """One metrics row: each device computed GFLOPS_PER_ROUND in `slow[a]` (default 1) times
    the planner's time for it at its cut; its link estimates are `links[a]` (up, down), else
    its profile's."""
    settings = dataclasses.replace(replanner.settings, batch=BATCHES["a0"])
    agents = {}
    for agent in PROFILES:
        profile = replanner.profiles[agent]  # as planned: compute dilated
        rows, _ = device_rows(replanner.costs, profile, replanner.server, settings)
        at = next(r for r in rows if r.k == cuts[agent])
        seconds = at.compute_ms / 1e3 * GFLOPS_PER_ROUND / at.device_gflops
        up, down = (links or {}).get(agent, (profile.network.uplink_mbps,
                                             profile.network.downlink_mbps))
        agents[agent] = {"compute_s": seconds * (slow or {}).get(agent, 1.0),
                         "estimate": {"uplink_mbps": up, "downlink_mbps": down}}
    return {"round": round_, "cuts": dict(cuts),
            "device_gflops": dict.fromkeys(PROFILES, GFLOPS_PER_ROUND), "agents": agents}


def test_the_planned_cuts_stay_while_the_devices_match_their_profiles() -> None:
    _, cuts, replanner = planned()
    for r in range(4):
        replanner.observe(row(r, cuts, replanner), BATCHES)
        assert replanner.consider(r, cuts, BATCHES) is None
    assert replanner.factor("a0") == pytest.approx(1.0) == replanner.factor("a1")


def test_a_link_that_drops_moves_the_cut_and_its_return_moves_it_back_for_free() -> None:
    """The Nano's uplink falls 50 → 5 Mbit/s: at cut 5 SCALA exchanges a 3 MB client
    block every round, so it moves to a shallower cut, paying that cut's bundle; when the
    link comes back it returns to the cut it held, which costs nothing. Returning gains 9%
    (10.24 → 9.29 s predicted), so this fleet runs at a 5% threshold; at the default 20%
    it would stay (hysteresis, next test)."""
    server_cut, cuts, replanner = planned(threshold=0.05)
    assert cuts == {"a0": server_cut, "a1": server_cut} == {"a0": 5, "a1": 5}
    replanner.observe(row(0, cuts, replanner), BATCHES)
    assert replanner.consider(0, cuts, BATCHES) is None
    slow_link = {"a0": (5.0, 20.0)}
    replanner.observe(row(1, cuts, replanner, links=slow_link), BATCHES)
    switch = replanner.consider(1, cuts, BATCHES)
    assert switch is not None and switch.after["a0"] < cuts["a0"]
    assert switch.after["a1"] == cuts["a1"]
    assert switch.predicted_after_s < 0.8 * switch.predicted_before_s
    new = switch.after["a0"]
    costs = get_costs(MODEL, SHAPE, CLASSES)
    expected = 2 * client_block(costs, new).state_bytes + BUNDLE_HEADER_BYTES
    assert switch.switch_bytes == {"a0": expected}
    assert switch.switch_s == pytest.approx(expected * 8 / 20e6)
    assert switch.row()["moved"] == {"a0": [cuts["a0"], new]}

    moved = switch.after
    replanner.observe(row(2, moved, replanner, links=slow_link), BATCHES)
    assert replanner.consider(2, moved, BATCHES) is None  # no flapping at the new cut
    replanner.observe(row(3, moved, replanner), BATCHES)
    back = replanner.consider(3, moved, BATCHES)
    assert back is not None and back.after == cuts
    assert back.switch_bytes == {} and back.switch_s == 0.0


def test_a_small_gain_is_inside_the_hysteresis() -> None:
    """A 15% slower link, or a return to the planned cut that gains 9%, stays below the 20%
    threshold: no switch."""
    _, cuts, replanner = planned()
    replanner.observe(row(0, cuts, replanner, links={"a0": (50 * 0.85, 50 * 0.85)}), BATCHES)
    assert replanner.consider(0, cuts, BATCHES) is None
    moved = {**cuts, "a0": 2}
    replanner.observe(row(1, moved, replanner), BATCHES)
    assert replanner.consider(1, moved, BATCHES) is None


def test_a_device_that_slows_down_is_predicted_from_its_measured_factor() -> None:
    """The Nano computes 4× slower than its profile (a power-mode drop): the factor is the
    median of the last three rounds, so one slow round does not move it."""
    _, cuts, replanner = planned()
    replanner.observe(row(0, cuts, replanner), BATCHES)
    replanner.observe(row(1, cuts, replanner, slow={"a0": 4.0}), BATCHES)
    assert replanner.factor("a0") == pytest.approx(2.5)  # median of 1 and 4
    replanner.observe(row(2, cuts, replanner, slow={"a0": 4.0}), BATCHES)
    assert replanner.factor("a0") == pytest.approx(4.0)
    slow = replanner.predicted_s(cuts, BATCHES)
    fresh = planned()[2]
    fresh.observe(row(0, cuts, fresh), BATCHES)
    normal = fresh.predicted_s(cuts, BATCHES)
    assert slow is not None and normal is not None and slow > normal


@pytest.mark.parametrize("bad", [math.nan, -1.0, 0.0, math.inf, "fast", 1e400])
def test_untrusted_compute_numbers_are_not_measurements(bad: Any) -> None:
    _, cuts, replanner = planned()
    sample = row(0, cuts, replanner)
    sample["agents"]["a1"]["compute_s"] = bad
    replanner.observe(sample, BATCHES)
    assert replanner.factor("a1") is None and replanner.factor("a0") == pytest.approx(1.0)


def test_methods_with_one_cut_keep_it() -> None:
    for method in ("fedavg", "sherl"):
        assert replanner_for(method, MODEL, SHAPE, CLASSES, PROFILES, server_profile="x86-cpu",
                             server_cut=2, threshold=0.2, **RUN) is None
    for method in ("ampere", "ampere-noconsolidation"):  # in their device phase
        assert replanner_for(method, MODEL, SHAPE, CLASSES, PROFILES, server_profile="x86-cpu",
                             server_cut=2, threshold=0.2, **RUN) is not None


def test_threshold_out_of_range_is_refused() -> None:
    _, _, replanner = planned()
    with pytest.raises(ValueError, match="threshold"):
        Replanner(replanner.costs, replanner.profiles, replanner.server, replanner.settings,
                  replanner.server_cut, threshold=1.5)


def test_the_factor_is_relative_to_the_device_at_its_start_and_survives_a_move() -> None:
    """A device 10× slower than the planner says at cut 5 (fixed per-step costs) is the
    device the plan was made for: factor 1. Moved to cut 2, where it runs 3× the planner,
    it is still factor 1 (the new cut's base takes the factor in force); halving its speed
    there makes it 2."""
    _, cuts, replanner = planned()
    replanner.observe(row(0, cuts, replanner, slow={"a0": 10.0}), BATCHES)
    replanner.observe(row(1, cuts, replanner, slow={"a0": 10.0}), BATCHES)
    assert replanner.factor("a0") == pytest.approx(1.0)
    moved = {**cuts, "a0": 2}
    for r in (2, 3, 4):
        replanner.observe(row(r, moved, replanner, slow={"a0": 3.0}), BATCHES)
    assert replanner.factor("a0") == pytest.approx(1.0)
    for r in (5, 6):
        replanner.observe(row(r, moved, replanner, slow={"a0": 6.0}), BATCHES)
    assert replanner.factor("a0") == pytest.approx(2.0)


def test_a_cut_whose_block_cannot_be_pulled_within_the_deadline_is_no_candidate() -> None:
    """The Nano's uplink collapses to 0.05 Mbit/s: without a deadline the planner sends it
    to the cut whose activations are smallest; with a 60 s step deadline only cuts whose
    client block uploads in 30 s remain (the coordinator pulls the block every round)."""
    costs = get_costs(MODEL, SHAPE, CLASSES)
    _, cuts, free = planned(threshold=0.05)
    bounded = replanner_for("scala", MODEL, SHAPE, CLASSES, PROFILES, server_profile="x86-cpu",
                            server_cut=5, threshold=0.05, deadline_s=60.0, **RUN)
    assert bounded is not None
    links = {"a0": (0.05, 20.0)}
    for replanner in (free, bounded):
        replanner.observe(row(0, cuts, replanner, links=links), BATCHES)
    best_free = free.predict(cuts, BATCHES)
    best_bounded = bounded.predict(cuts, BATCHES)
    assert best_free is not None and best_bounded is not None
    pull_s = {k: client_block(costs, k).state_bytes * 8 / 0.05e6 for k in range(1, 6)}
    assert pull_s[best_free[1]["a0"]] > 30  # unbounded: a block it could never upload
    assert pull_s[best_bounded[1]["a0"]] <= 30


def modeled(replanner: Replanner, speed: dict[str, float],
            links: dict[str, tuple[float, float]] | None = None) -> None:
    """One round as the fleet books write it for emulated agents: measured times that mean
    nothing (a busy emulating machine: 7× and 0.3× the planner) and the conditions each
    agent states (`emulated`)."""
    sample = row(0, CUTS_AT_START, replanner, slow={"a0": 7.0, "a1": 0.3},
                 links={"a0": (1e-3, 1e-3), "a1": (1e-3, 1e-3)})
    for agent, info in sample["agents"].items():
        up, down = (links or {}).get(agent, (50.0, 50.0))
        info["emulated"] = {"compute": speed.get(agent, 1.0), "uplink_mbps": up,
                            "downlink_mbps": down}
    replanner.observe(sample, BATCHES)


CUTS_AT_START = {"a0": 5, "a1": 5}


def test_the_model_clock_reads_the_stated_conditions_not_the_measured_times() -> None:
    """`clock = "model"`: the factor is 1 ÷ the speed an emulated agent states (the Nano
    at a quarter of its profile's speed → 4 once the median turns), its links are the ones
    it states; the measured times (7× the planner, a 1 kbit/s link) are not read. An agent
    stating no conditions, or nonsense, gives no measurement."""
    _, cuts, measured = planned(threshold=0.05)
    model = replanner_for("scala", MODEL, SHAPE, CLASSES, PROFILES, server_profile="x86-cpu",
                          server_cut=5, threshold=0.05, clock="model", **RUN)
    assert model is not None and cuts == CUTS_AT_START
    modeled(model, {})
    assert model.factor("a0") == model.factor("a1") == pytest.approx(1.0)
    assert model.predict(cuts, BATCHES) is not None
    assert model.consider(0, cuts, BATCHES) is None  # the devices the plan was made for
    for _ in range(2):
        modeled(model, {"a0": 0.25}, links={"a0": (5.0, 20.0)})
    assert model.factor("a0") == pytest.approx(4.0) and model.factor("a1") == pytest.approx(1.0)
    assert model._links["a0"] == {"uplink_mbps": 5.0, "downlink_mbps": 20.0}
    switch = model.consider(2, cuts, BATCHES)
    assert switch is not None and switch.after["a0"] < cuts["a0"]

    modeled(measured, {})  # the same row on the measured clock reads the noise
    assert measured.factor("a0") == pytest.approx(1.0)  # base: the first ratio
    assert measured._links["a0"] == {"uplink_mbps": 1e-3, "downlink_mbps": 1e-3}

    for bad in (None, {"compute": 0.0}, {"compute": math.nan}, {"compute": "half"}, "fast"):
        fresh = replanner_for("scala", MODEL, SHAPE, CLASSES, PROFILES,
                              server_profile="x86-cpu", server_cut=5, threshold=0.05,
                              clock="model", **RUN)
        sample = row(0, cuts, fresh)
        sample["agents"]["a0"]["emulated"] = bad
        fresh.observe(sample, BATCHES)
        assert fresh.factor("a0") is None, bad
    with pytest.raises(ValueError, match="clock"):
        Replanner(model.costs, model.profiles, model.server, model.settings, 5, clock="wall")
