"""The step deadline follows the fleet (server/defences/step_deadlines.py): k × the
nearest-rank 95th percentile of each exchange kind's last `window` step times, clamped to
[floor, deadline_s], each value counted by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from jetsplit.server.defences.step_deadlines import (
    FLOOR_MARGIN,
    OWN_FLOOR_LEAST_S,
    OWN_MIN_SAMPLES,
    StepDeadlines,
    percentile95,
    predicted_floor,
)

pytestmark = pytest.mark.fast


def _exchange(kind: str, *elapsed: float | None) -> Any:
    """An outcome of `kind` whose replies took `elapsed` seconds (None: untimed)."""
    return SimpleNamespace(kind=kind, replies={f"a{i}": SimpleNamespace(elapsed_s=e)
                                               for i, e in enumerate(elapsed)})


def test_percentile95_is_the_nearest_rank() -> None:
    assert percentile95([5.0]) == 5.0
    assert percentile95(range(1, 11)) == 10  # ⌈9.5⌉ = 10th of 10
    assert percentile95(range(1, 21)) == 19  # ⌈19⌉ = 19th of 20
    assert percentile95(range(1, 22)) == 20  # ⌈19.95⌉ = 20th of 21
    # 38th of 40, unsorted: 37 ones, then 2, 3, 100
    assert percentile95([3.0, 1.0, 2.0, 100.0] + [1.0] * 36) == 2.0
    with pytest.raises(ValueError):
        percentile95([])


def test_each_kind_follows_its_own_window() -> None:
    deadlines = StepDeadlines(60.0, k=2.0, window=4, floor_s=1.0)
    assert deadlines.deadline("forward") == 60.0  # no step time yet: the configured one
    # a step time is the slowest answer of one exchange; silence and untimed replies add none
    deadlines.observe(_exchange("forward", 0.5, 2.0, None))
    deadlines.observe(_exchange("forward"))  # nobody answered: no sample
    deadlines.observe(_exchange("backward", 1.5, float("nan"), -1.0))
    assert list(deadlines.samples["forward"]) == [2.0]
    assert list(deadlines.samples["backward"]) == [1.5]
    assert deadlines.deadline("forward") == 4.0  # 2 × 2.0
    assert deadlines.deadline("backward") == 3.0  # 2 × 1.5: kinds apart
    for t in (1.0, 3.0, 2.5):
        deadlines.observe(_exchange("forward", t))
    assert deadlines.deadline("forward") == 6.0  # window 2, 1, 3, 2.5 → p95 3 → 6
    deadlines.observe(_exchange("forward", 1.0))  # window 1, 3, 2.5, 1: the 2 fell out
    deadlines.observe(_exchange("forward", 1.0))  # 3, 2.5, 1, 1
    deadlines.observe(_exchange("forward", 1.0))  # 2.5, 1, 1, 1
    assert deadlines.deadline("forward") == 5.0
    deadlines.observe(_exchange("forward", 1.0))  # 1, 1, 1, 1
    assert deadlines.deadline("forward") == 2.0
    assert deadlines.deadline("set_weights") == 60.0  # a kind never seen


def test_a_larger_window_keeps_the_slow_device_in_the_percentile() -> None:
    """20 fast steps and one slow device's step: a window of 21 keeps it at the 95th
    percentile (⌈19.95⌉ = 20th of 21 is still fast); 10 more slow ones lift it."""
    wide = StepDeadlines(600.0, k=3.0, window=40, floor_s=0.1)
    for _ in range(20):
        wide.observe(_exchange("forward", 0.5))
    wide.observe(_exchange("forward", 8.0))
    assert wide.deadline("forward") == 1.5  # 3 × 0.5: one slow step of 21 is in the top 5 %
    wide.observe(_exchange("forward", 8.0))  # 22: ⌈20.9⌉ = 21st → 8.0
    assert wide.deadline("forward") == 24.0
    narrow = StepDeadlines(600.0, k=3.0, window=2, floor_s=0.1)
    for t in (8.0, 0.5, 0.5):
        narrow.observe(_exchange("forward", t))
    assert narrow.deadline("forward") == 1.5  # the slow one left the window


def test_floor_and_ceiling_clamp() -> None:
    deadlines = StepDeadlines(60.0, k=4.0, window=10, floor_s=5.0)
    deadlines.observe(_exchange("forward", 0.2))
    assert deadlines.deadline("forward") == 5.0  # 0.8 under the floor
    deadlines.observe(_exchange("backward", 40.0))
    assert deadlines.deadline("backward") == 60.0  # 160 over the configured deadline
    high_floor = StepDeadlines(30.0, k=4.0, floor_s=45.0)
    high_floor.observe(_exchange("forward", 0.1))
    assert high_floor.deadline("forward") == 30.0  # a floor over deadline_s: deadline_s
    off = StepDeadlines(60.0, k=0.0, floor_s=1.0)
    off.observe(_exchange("forward", 0.1))
    assert off.deadline("forward") == 60.0  # k = 0: always the configured deadline


def test_the_floor_covers_the_slowest_predicted_device() -> None:
    assert predicted_floor({}, 10.0) == 10.0
    assert predicted_floor({"a0": 0.4, "a1": 1.0}, 10.0) == 10.0  # 3 × 1.0 under 10
    assert predicted_floor({"a0": 0.4, "a3": 6.5}, 10.0) == FLOOR_MARGIN * 6.5
    assert predicted_floor({"a0": math.inf, "a1": math.nan, "a2": -3.0, "a3": 5.0},
                           2.0) == 15.0  # non-finite and negative predictions ignored


def test_the_round_books_the_largest_deadline_and_the_full_waits() -> None:
    deadlines = StepDeadlines(60.0, k=2.0, window=5, floor_s=1.0)
    assert deadlines.deadline("forward") == 60.0
    deadlines.observe(_exchange("forward", 3.0, 1.0))
    assert deadlines.deadline("forward") == 6.0
    deadlines.observe(_exchange("forward", 0.5))
    assert deadlines.deadline("forward") == 6.0  # p95 of 3, 0.5 is 3
    assert deadlines.deadline("get_weights") == 60.0
    assert deadlines.new_round() == ({"forward": 60.0, "get_weights": 60.0},
                                     {"forward": 1, "get_weights": 1})
    assert deadlines.deadline("forward") == 6.0
    assert deadlines.new_round() == ({"forward": 6.0}, {"forward": 0})
    assert deadlines.new_round() == ({}, {})


def test_a_device_with_a_record_of_answers_gets_its_own_floor() -> None:
    """The cutoff's floor per device: k × the lower median of its own answered times of a
    kind, within [max(2 s, the predicted floor), the fleet floor], once it answered one."""
    assert (OWN_MIN_SAMPLES, OWN_FLOOR_LEAST_S) == (1, 2.0)
    deadlines = StepDeadlines(60.0, k=4.0, window=4, floor_s=10.0)
    assert deadlines.floor_of("a0", "forward") == 10.0  # no record: the fleet floor
    deadlines.observe(_exchange("forward", 1.5, 3.0, 0.5))  # cold first answers
    assert deadlines.floor_of("a0", "forward") == 4.0 * 1.5  # one answer is a record
    deadlines.observe(_exchange("forward", None, 2.5, 0.9))  # a0 missed: no sample
    assert deadlines.floor_of("a0", "forward") == 4.0 * 1.5
    assert deadlines.floor_of("a2", "forward") == 2.0  # lower median of 0.5, 0.9 → 2.0
    assert deadlines.floor_of("a1", "forward") == 10.0  # 4 × 2.5 = 10: the fleet floor
    deadlines.observe(_exchange("forward", 0.2, 0.6, 0.7))
    assert deadlines.floor_of("a0", "forward") == 2.0  # 1.5, 0.2 → 0.8: the least
    assert deadlines.floor_of("a1", "forward") == 10.0  # 3.0, 2.5, 0.6 → 2.5 → 10
    assert deadlines.floor_of("a2", "forward") == 4.0 * 0.7  # 0.5, 0.9, 0.7 → 0.7
    deadlines.observe(_exchange("forward", 0.2, 0.6, 0.7))
    assert deadlines.floor_of("a1", "forward") == 4.0 * 0.6  # 3.0, 2.5, 0.6, 0.6: lower
    assert deadlines.floor_of("a0", "backward") == 10.0  # kinds apart
    assert deadlines.floor_of("a9", "forward") == 10.0  # a device never heard
    # the record is its last `window` answers: the cold 3.0 and 2.5 leave it
    deadlines.observe(_exchange("forward", 0.2, 0.55, 0.7))
    deadlines.observe(_exchange("forward", 0.2, 0.65, 0.7))
    assert list(deadlines.own[("forward", "a1")]) == [0.6, 0.6, 0.55, 0.65]
    assert deadlines.floor_of("a1", "forward") == 4.0 * 0.6
    # the fleet's window is still each exchange's slowest answer
    assert list(deadlines.samples["forward"]) == [0.7, 0.7, 0.7, 0.7]


def test_a_devices_own_floor_never_goes_under_the_predictions_nor_over_the_fleet() -> None:
    predicted = StepDeadlines(60.0, k=4.0, floor_s=10.0, predicted_floor_s=6.0)
    low = StepDeadlines(60.0, k=4.0, floor_s=1.0)  # a fleet floor under the least: kept
    off = StepDeadlines(60.0, k=0.0, floor_s=10.0)  # k 0: no adapting at all
    for d in (predicted, low, off):
        d.observe(_exchange("train", 0.05))
    assert predicted.floor_of("a0", "train") == 6.0  # 3 × the slowest predicted step
    assert low.floor_of("a0", "train") == 1.0
    assert off.floor_of("a0", "train") == 10.0
    # a prediction over the fleet floor is no more than it (the trainer passes both)
    assert StepDeadlines(60.0, floor_s=10.0, predicted_floor_s=15.0).predicted_floor_s == 10.0
