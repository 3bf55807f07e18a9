"""The in-exchange cutoff (server/engines/cutoff.py): once some devices of an exchange have
answered, the rest are waited for at most max(floor, k × the answering ones' time, scaled
by the predicted pace), never past the exchange's deadline. Elapsed times are given by
hand: no clock is read."""

from __future__ import annotations

import math

import pytest

from jetsplit.server.engines.cutoff import DEFAULT_CUTOFF_K, STEP_KINDS, Cutoff
from jetsplit.server.engines.seam import Command, InProcessEngine

pytestmark = pytest.mark.fast


def test_nobody_answered_waits_the_deadline() -> None:
    assert Cutoff(floor_s=2.0).limit("a3", {}, 60.0) == 60.0
    # the agent's own time (it answered) does not count for it
    assert Cutoff(floor_s=2.0).limit("a3", {"a3": 1.0}, 60.0) == 60.0


def test_k_times_the_slowest_answer_within_floor_and_deadline() -> None:
    cut = Cutoff(floor_s=2.0, k=2.0)
    assert cut.limit("a3", {"a0": 1.5, "a1": 3.0, "a2": 2.5}, 60.0) == 6.0  # 2 × 3.0
    assert cut.limit("a3", {"a0": 0.3}, 60.0) == 2.0  # 2 × 0.3 = 0.6: the floor
    assert cut.limit("a3", {"a0": 40.0}, 60.0) == 60.0  # 2 × 40 = 80: the deadline
    assert Cutoff(floor_s=10.0).limit("a3", {"a0": 4.0}, 60.0) == 10.0  # default k: 8 s
    assert DEFAULT_CUTOFF_K == 2.0
    # bad times (untrusted clocks never reach here, but a NaN must not poison the max)
    assert cut.limit("a3", {"a0": math.nan, "a1": -1.0, "a2": 1.5}, 60.0) == 3.0


def test_a_device_predicted_slower_gets_its_predicted_share_more() -> None:
    # a Nano (predicted 2.0 s) among Orins (0.5 s): 4 × slower, so 2 × 1.5 × 4 = 12 s
    cut = Cutoff(floor_s=2.0, k=2.0, predicted_s={"a0": 0.5, "a1": 0.25, "a3": 2.0})
    assert cut.pace("a3", "a0") == 4.0 and cut.pace("a3", "a1") == 8.0
    assert cut.limit("a3", {"a0": 1.5}, 60.0) == 12.0
    assert cut.limit("a3", {"a0": 1.5, "a1": 1.0}, 60.0) == 16.0  # max(1.5×4, 1.0×8) × 2
    # a faster device waits no less than its peers' time (pace at least 1)
    assert cut.pace("a0", "a3") == 1.0
    assert cut.limit("a0", {"a3": 1.5}, 60.0) == 3.0
    # no prediction, or an unusable one: pace 1
    odd = Cutoff(floor_s=1.0, k=2.0, predicted_s={"a0": 0.0, "a1": math.inf, "a3": 2.0})
    assert odd.pace("a3", "a0") == 1.0 and odd.pace("a3", "a1") == 1.0
    assert odd.pace("a3", "a9") == 1.0 and odd.limit("a3", {"a0": 1.5}, 60.0) == 3.0


def test_only_step_exchanges_are_cut_off() -> None:
    cut = Cutoff(floor_s=2.0)
    assert all(cut.applies(kind) for kind in STEP_KINDS)
    assert {"forward", "backward", "set_weights", "get_weights", "release", "train",
            "generate", "edge_load", "edge_step"} == STEP_KINDS
    assert not cut.applies("bundle") and not cut.applies("status")
    assert not Cutoff(floor_s=2.0, k=0.0).applies("forward")  # k 0: always the deadline


def test_a_device_given_more_work_gets_its_share_more() -> None:
    # a3 trains 36 samples where a0 trains 12: 3 × a0's 1.5 s, then k = 2: 9 s
    cut = Cutoff(floor_s=2.0, k=2.0)
    work = {"a0": 12.0, "a1": 24.0, "a3": 36.0}
    assert cut.pace("a3", "a0", work) == 3.0 and cut.pace("a3", "a1", work) == 1.5
    assert cut.limit("a3", {"a0": 1.5}, 60.0, work) == 9.0
    assert cut.limit("a3", {"a0": 1.5, "a1": 4.0}, 60.0, work) == 12.0  # 2 × max(4.5, 6.0)
    assert cut.limit("a0", {"a3": 1.5}, 60.0, work) == 3.0  # less work: still its peer's time
    # the prediction and the work multiply: a Nano (4 × slower) with 3 × the work: 12 × 1.5
    both = Cutoff(floor_s=2.0, k=2.0, predicted_s={"a0": 0.5, "a3": 2.0})
    assert both.pace("a3", "a0", work) == 12.0 and both.limit("a3", {"a0": 1.5}, 60.0,
                                                                 work) == 36.0
    # a work unknown or unusable on either side: ratio 1
    assert cut.pace("a3", "a9", work) == 1.0
    assert cut.pace("a3", "a0", {"a0": 0.0, "a3": 36.0}) == 1.0
    assert cut.pace("a3", "a0", {"a0": math.nan, "a3": 36.0}) == 1.0


def test_the_engine_decides_every_exchanges_waits_in_one_place() -> None:
    engine = InProcessEngine({})
    commands = {"a0": Command("train", work=12.0), "a3": Command("train", work=36.0)}
    assert engine.wait_limits(commands, ["a3"], {"a0": 1.5}, 60.0) == {"a3": 60.0}  # no cutoff
    engine.cutoff = Cutoff(floor_s=2.0)
    assert engine.wait_limits(commands, ["a3"], {"a0": 1.5}, 60.0) == {"a3": 9.0}
    probes = {"a0": Command("status"), "a3": Command("status")}
    assert engine.wait_limits(probes, ["a3"], {"a0": 1.5}, 5.0) == {"a3": 5.0}
    bundles = {"a0": Command("bundle"), "a3": Command("bundle")}
    assert engine.wait_limits(bundles, ["a3"], {"a0": 1.5}, 60.0) == {"a3": 60.0}


def test_each_device_is_waited_for_above_its_own_floor() -> None:
    """A device with a record of quick answers (the step deadlines' `floor_of`) is cut off at
    its own floor; a device without one at the fleet floor; the deadline still caps both."""
    own = {("a3", "forward"): 2.0, ("a2", "forward"): 3.5}
    cut = Cutoff(floor_s=10.0, k=2.0, floor_of=lambda a, kind: own.get((a, kind), 10.0))
    assert cut.floor("a3", "forward") == 2.0 and cut.floor("a3", "backward") == 10.0
    assert cut.limit("a3", {"a0": 0.3}, 60.0, floor_s=2.0) == 2.0
    assert cut.limit("a3", {"a0": 1.5}, 60.0, floor_s=2.0) == 3.0  # 2 × 1.5 over it
    assert cut.limit("a3", {"a0": 0.3}, 60.0) == 10.0  # no floor given: the cutoff's
    assert cut.limit("a3", {"a0": 0.3}, 1.5, floor_s=2.0) == 1.5  # the deadline caps
    engine = InProcessEngine({})
    engine.cutoff = cut
    forwards = {a: Command("forward") for a in ("a0", "a1", "a2", "a3")}
    assert engine.wait_limits(forwards, ["a1", "a2", "a3"], {"a0": 0.3}, 60.0) == {
        "a1": 10.0, "a2": 3.5, "a3": 2.0}
    backwards = {a: Command("backward") for a in ("a0", "a3")}
    assert engine.wait_limits(backwards, ["a3"], {"a0": 0.3}, 60.0) == {"a3": 10.0}
    assert Cutoff(floor_s=10.0).floor("a3", "forward") == 10.0  # no record kept at all
