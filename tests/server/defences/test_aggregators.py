"""The robust aggregation rules (server/defences/aggregators.py) by hand: unequal weights, ties,
integer buffers, mixed cuts. Imports no torch, so mutation testing of the rules runs it in
seconds per mutant (`--noconftest`)."""

from __future__ import annotations

import numpy as np
import pytest

from jetsplit.server.defences.aggregators import (
    AGGREGATORS,
    DEFAULT_OUTLIER_BOUND,
    Shares,
    aggregate,
    fedavg,
    krum_kept,
    trimmed_count,
    without_outliers,
)

pytestmark = pytest.mark.fast


def _states(values: dict[str, list[float]], ints: bool = True) -> dict:
    return {a: {"w": np.array(v, np.float32), **({"n": np.array([i])} if ints else {})}
            for i, (a, v) in enumerate(sorted(values.items()))}


def test_median_is_coordinate_wise_and_unweighted() -> None:
    states = _states({"a": [1, 50], "b": [5, 2], "c": [100, 3]})
    for weights in ({"a": 1, "b": 1, "c": 1}, {"a": 9, "b": 1, "c": 100}):
        out = aggregate(states, weights, "median")
        assert out["w"].tolist() == [5, 3] and out["w"].dtype == np.float32
        assert out["n"].tolist() == [1]  # integer buffers: their median under robust rules
    even = aggregate(_states({"a": [1], "b": [2], "c": [3], "d": [100]}),
                     dict.fromkeys("abcd", 1), "median")
    assert even["w"].tolist() == [2.5]


def test_trimmed_mean_drops_beta_n_at_each_end() -> None:
    five = _states({"a": [1, -100], "b": [2, 0], "c": [3, 1], "d": [4, 2], "e": [100, 3]})
    out = aggregate(five, dict.fromkeys("abcde", 1), "trimmed-mean", robust_fraction=0.2)
    assert out["w"].tolist() == [3, 1]  # (2+3+4)/3 and (0+1+2)/3
    assert aggregate(five, dict.fromkeys("abcde", 1), "trimmed-mean",
                     robust_fraction=0.4)["w"].tolist() == [3, 1]  # trims 2: the median
    assert trimmed_count(4, 0.2) == 0 and trimmed_count(5, 0.2) == 1
    assert trimmed_count(3, 0.5) == 1 and trimmed_count(2, 0.5) == 0  # one always kept
    four = _states({"a": [1], "b": [2], "c": [3], "d": [10]})
    assert aggregate(four, dict.fromkeys("abcd", 1), "trimmed-mean",
                     robust_fraction=0.2)["w"].tolist() == [4]  # nothing trimmed


def test_clipped_scales_updates_over_the_bound_and_weights_by_size() -> None:
    """Updates from g = (0, 0): norms 5, 1, 2, 50; median 3.5, bound 2 × 3.5 = 7; d's
    update scaled by 7/50 to (4.2, 5.6); weights 1, 1, 2, 4 out of 8."""
    states = _states({"a": [3, 4], "b": [0, 1], "c": [0, 2], "d": [30, 40]})
    notes: dict[str, str] = {}
    reference = {"w": np.zeros(2, np.float32), "n": np.array([0])}
    out = aggregate(states, {"a": 1, "b": 1, "c": 2, "d": 4}, "clipped",
                    reference=reference, notes=notes, clip_factor=2.0)
    assert out["w"].tolist() == pytest.approx([19.8 / 8, 31.4 / 8], rel=1e-6)
    assert list(notes) == ["d"] and notes["d"].startswith("clipped ×0.14 ")
    shifted = {"w": np.array([1, 1], np.float32), "n": np.array([0])}  # updates from g
    out = aggregate(_states({"a": [1, 1], "b": [4, 5]}), {"a": 1, "b": 1}, "clipped",
                    reference=shifted, clip_factor=1.0)
    # norms 0 and 5, median 2.5: b's (3, 4) scaled by 1/2
    assert out["w"].tolist() == pytest.approx([1 + 0.75, 1 + 1.0])


def test_clipped_without_a_reference_clips_around_the_median() -> None:
    states = _states({"a": [1], "b": [2], "c": [3], "d": [1000]})
    out = aggregate(states, dict.fromkeys("abcd", 1), "clipped", clip_factor=2.0)
    # median 2.5: deviations 1.5, 0.5, 0.5, 997.5; median 1.0, bound 2: d's becomes 2
    assert out["w"].tolist() == pytest.approx([2.5 + (-1.5 - 0.5 + 0.5 + 2) / 4])


def test_multi_krum_keeps_the_n_minus_f_closest_and_weights_them() -> None:
    """1-D states 0, 1, 2, 3, 100; f = 1, so 2 neighbours each: scores a 1+4, b 1+1,
    c 1+1, d 1+4, e 9409+9604; a-d kept, weighted 1, 2, 3, 4 (e's 10 plays no part)."""
    states = _states({"a": [0], "b": [1], "c": [2], "d": [3], "e": [100]})
    notes: dict[str, str] = {}
    out = aggregate(states, {"a": 1, "b": 2, "c": 3, "d": 4, "e": 10}, "multi-krum",
                    notes=notes, robust_fraction=0.2)
    assert out["w"].tolist() == [2.0] and out["n"].tolist() == [2]  # median of 0..4
    assert list(notes) == ["e"] and "19013" in notes["e"]
    assert krum_kept(5, 0.2) == (1, 4) and krum_kept(10, 0.4) == (3, 7)  # n > 2f + 2
    assert krum_kept(4, 0.2) == (0, 4) and krum_kept(3, 0.5) == (0, 3)
    four = _states({"a": [0], "b": [1], "c": [2], "d": [30]})
    out = aggregate(four, dict.fromkeys("abcd", 1), "multi-krum")  # f = 0: all kept
    assert out["w"].tolist() == [8.25] and out["n"].tolist() == [1]  # ints: median of 0..3


def test_every_rule_works_layer_wise_over_mixed_cuts() -> None:
    """l1 held by a, b, c; l2 only by a and c (a shallower b): each layer over its
    holders. Median of l2 over two holders is their mean."""
    states = {"a": {"l1": np.array([2.0]), "l2": np.array([10.0])},
              "b": {"l1": np.array([4.0])},
              "c": {"l1": np.array([9.0]), "l2": np.array([40.0])}}
    weights = {"a": 1, "b": 2, "c": 3}
    med = aggregate(states, weights, "median")
    assert list(med) == ["l1", "l2"] and med["l1"].tolist() == [4] and med["l2"].tolist() == [25]
    avg = aggregate(states, weights, "mean")
    assert avg["l1"].tolist() == pytest.approx([(2 + 8 + 27) / 6])
    assert avg["l2"].tolist() == pytest.approx([(10 + 120) / 4])
    for rule in AGGREGATORS:
        assert list(aggregate(states, weights, rule)) == ["l1", "l2"], rule


def test_fedavg_rule_is_fedavg_bit_for_bit_and_a_scaled_upload_is_contained() -> None:
    rng = np.random.default_rng(0)
    honest = {f"a{i}": {"w": rng.normal(size=50).astype(np.float32)} for i in range(5)}
    weights = {a: 10 + i for i, a in enumerate(honest)}
    assert aggregate(honest, weights, "mean")["w"].tobytes() == fedavg(
        honest, weights)["w"].tobytes()
    attacked = {**honest, "x": {"w": honest["a0"]["w"] * 1000}}
    weights = {**weights, "x": 10}
    low = np.min([s["w"] for s in honest.values()], axis=0)
    high = np.max([s["w"] for s in honest.values()], axis=0)
    assert np.abs(aggregate(attacked, weights, "mean")["w"]).max() > 50
    for rule in ("median", "trimmed-mean", "multi-krum"):
        out = aggregate(attacked, weights, rule, robust_fraction=0.2)["w"]
        assert np.all(out >= low - 1e-6) and np.all(out <= high + 1e-6), rule
    out = aggregate(attacked, weights, "clipped", reference={"w": np.zeros(50, np.float32)})
    assert np.abs(out["w"]).max() < 5


def test_the_defaults_are_clip_factor_2_and_beta_0_2() -> None:
    """Rules called without their knobs use the documented defaults."""
    states = _states({"a": [3, 4], "b": [0, 1], "c": [0, 2], "d": [30, 40]})
    reference = {"w": np.zeros(2, np.float32), "n": np.array([0])}
    weights = {"a": 1, "b": 1, "c": 2, "d": 4}
    assert aggregate(states, weights, "clipped", reference=reference)["w"].tolist() == \
        aggregate(states, weights, "clipped", reference=reference, clip_factor=2.0)["w"].tolist()
    values = [0, 1, 2, 3, 4, 5, 9, 10, 20, 1000]
    ten = _states({f"a{i}": [float(v)] for i, v in enumerate(values)})
    # β = 0.2 of 10: 2 dropped at each end, (2 + 3 + 4 + 5 + 9 + 10) / 6
    assert aggregate(ten, dict.fromkeys(ten, 1), "trimmed-mean")["w"].tolist() == [5.5]
    assert krum_kept(20, 0.2) == (4, 16) and krum_kept(4, 0.5) == (0, 4)
    assert krum_kept(2, 0.2) == (0, 2)


def test_clipped_keeps_each_tensor_in_its_place() -> None:
    """Two float tensors: the merged update is split back at the right offsets."""
    states = {"a": {"w": np.array([1.0, 0.0, 4.0], np.float32),
                    "b": np.array([0.0], np.float32)},
              "b": {"w": np.array([0.0, 1.0, 2.0], np.float32),
                    "b": np.array([2.0], np.float32)}}
    reference = {"w": np.zeros(3, np.float32), "b": np.array([10.0], np.float32)}
    out = aggregate(states, {"a": 1, "b": 1}, "clipped", reference=reference, clip_factor=100)
    assert out["w"].tolist() == [0.5, 0.5, 3.0] and out["b"].tolist() == [1.0]


def test_integer_only_blocks_take_the_median_under_robust_rules() -> None:
    """FedAvg keeps its element-wise max; no robust rule lets one device set a counter."""
    states = {a: {"n": np.array([i, 5 - i])} for i, a in enumerate("abcd")}
    states["e"] = {"n": np.array([10**12, 10**12])}
    for rule in AGGREGATORS:
        out = aggregate(states, dict.fromkeys(states, 1), rule, reference={"n": np.array([0, 0])})
        assert out["n"].tolist() == ([10**12, 10**12] if rule == "mean" else [2, 4]), rule
        assert out["n"].dtype == states["a"]["n"].dtype


def test_multi_krum_with_two_assumed_attackers_scores_three_neighbours() -> None:
    """n = 7, β = 0.3: f = 2, so n − f − 2 = 3 nearest others per score and 5 kept."""
    points = {"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0, "e": 4.0, "f": 50.0, "g": 60.0}
    states = {k: {"w": np.array([v])} for k, v in points.items()}
    notes: dict[str, str] = {}
    out = aggregate(states, dict.fromkeys(states, 1), "multi-krum", notes=notes,
                    robust_fraction=0.3)
    assert out["w"].tolist() == [2.0] and sorted(notes) == ["f", "g"]
    # g's three nearest: f (10²), e (56²), d (57²)
    assert float(notes["g"].split("score ")[1].rstrip(")")) == 100 + 56**2 + 57**2


def test_multi_krum_scores_small_distances_and_any_outlier_name() -> None:
    """Distances under 1 count as they are, and the outlier is found wherever it sorts:
    0, 0.01, 0.02, 0.03 and 'a' at 0.5 (every distance under 1, so clamping them, or
    scoring no neighbours, would tie everyone and keep 'a' by name)."""
    states = {"a": {"w": np.array([0.5])}, "b": {"w": np.array([0.0])},
              "c": {"w": np.array([0.01])}, "d": {"w": np.array([0.02])},
              "e": {"w": np.array([0.03])}}
    notes: dict[str, str] = {}
    out = aggregate(states, dict.fromkeys(states, 1), "multi-krum", notes=notes)
    assert out["w"].tolist() == pytest.approx([0.015]) and list(notes) == ["a"]
    # a's two nearest: e at 0.47 and d at 0.48
    assert float(notes["a"].split("score ")[1].rstrip(")")) == pytest.approx(
        0.47**2 + 0.48**2, rel=1e-5)


def _shares(states: dict, weights: dict, rule: str, **kw: object) -> dict[str, float]:
    shares = Shares()
    aggregate(states, weights, rule, shares=shares, **kw)  # type: ignore[arg-type]
    return shares.result()


def test_each_rule_reports_each_devices_share_by_hand() -> None:
    """Shares are the weight each upload carried in the result (the influence plot)."""
    weights = {"a": 1, "b": 1, "c": 2, "d": 4}
    four = _states({"a": [3, 4], "b": [0, 1], "c": [0, 2], "d": [30, 40]})
    assert _shares(four, weights, "mean") == {"a": 0.125, "b": 0.125, "c": 0.25, "d": 0.5}
    # clipped as above: d's update scaled by 7/50, so its weight 4/8 becomes 0.07
    reference = {"w": np.zeros(2, np.float32), "n": np.array([0])}
    assert _shares(four, weights, "clipped", reference=reference) == pytest.approx(
        {"a": 0.125, "b": 0.125, "c": 0.25, "d": 0.5 * 7 / 50})
    # median of 3 per coordinate: w0 = [3, 0, 0, 30] (ties in id order: b, c, a, d) -> the
    # middle two of 4 are c and a; w1 = [4, 1, 2, 40] -> c and a; each counts 1/2
    assert _shares(four, weights, "median") == {"a": 0.5, "b": 0.0, "c": 0.5, "d": 0.0}
    five = _states({"a": [1, -100], "b": [2, 0], "c": [3, 1], "d": [4, 2], "e": [100, 3]})
    # trimmed 1 at each end: w0 keeps b, c, d; w1 keeps b, c, d too (a lowest, e highest)
    assert _shares(five, dict.fromkeys("abcde", 1), "trimmed-mean") == pytest.approx(
        {"a": 0.0, "b": 1 / 3, "c": 1 / 3, "d": 1 / 3, "e": 0.0})
    spread = _states({"a": [0, 9], "b": [1, 1], "c": [2, 2], "d": [3, 3], "e": [100, 0]})
    # w1 = [9, 1, 2, 3, 0]: e lowest, a highest, so b, c, d kept; w0: a and e trimmed
    assert _shares(spread, dict.fromkeys("abcde", 1), "trimmed-mean") == pytest.approx(
        {"a": 0.0, "b": 1 / 3, "c": 1 / 3, "d": 1 / 3, "e": 0.0})
    krum = _states({"a": [0], "b": [1], "c": [2], "d": [3], "e": [100]})
    assert _shares(krum, {"a": 1, "b": 2, "c": 3, "d": 4, "e": 10}, "multi-krum") == \
        pytest.approx({"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4, "e": 0.0})


def test_shares_average_over_the_parameters_of_each_devices_layers() -> None:
    """Mixed cuts: l1 (3 parameters) held by a, b, c; l2 (1 parameter) by a and c. a's share
    is (3 × 1/6 + 1 × 1/4) / 4; b holds l1 only, so its share is l1's, 2/6."""
    states = {"a": {"l1": np.zeros(3), "l2": np.zeros(1)}, "b": {"l1": np.zeros(3)},
              "c": {"l1": np.zeros(3), "l2": np.zeros(1)}}
    shares = _shares(states, {"a": 1, "b": 2, "c": 3}, "mean")
    assert shares == pytest.approx({"a": (3 / 6 + 1 / 4) / 4, "b": 2 / 6,
                                    "c": (3 * 3 / 6 + 3 / 4) / 4})
    twice = Shares()  # two aggregates in one round (Ampere's client and aux blocks)
    twice.add({"a": 1.0}, 10)
    twice.add({"a": 0.0, "b": 1.0}, 30)
    assert twice.result() == {"a": 0.25, "b": 1.0}
    twice.clear()
    assert twice.result() == {}


def test_an_update_over_the_outlier_bound_is_left_out_before_the_rule() -> None:
    """Updates from g = 0 with norms 1, 2, 3, 40 (a, b, c, x): median 2.5, bound ×10 = 25,
    so x is left out of the |D_k|-weighted mean (weights 1, 2, 3, 100: x would own it), with
    a share of 0 and a note; its integer buffer is out of the median too. At ×20 (bound 50)
    everybody stays and the result is the plain rule's, bit for bit."""
    reference = {"w": np.zeros(2, np.float32)}
    states = {"a": {"w": np.array([1, 0], np.float32), "n": np.array([1])},
              "b": {"w": np.array([0, 2], np.float32), "n": np.array([2])},
              "c": {"w": np.array([3, 0], np.float32), "n": np.array([3])},
              "x": {"w": np.array([0, -40], np.float32), "n": np.array([900])}}
    weights = {"a": 1, "b": 2, "c": 3, "x": 100}
    notes: dict[str, str] = {}
    shares = Shares()
    out = aggregate(states, weights, "mean", reference=reference, notes=notes, shares=shares,
                    outlier_bound=10.0)
    assert out["w"].tolist() == pytest.approx([(1 + 9) / 6, 4 / 6])
    assert out["n"].tolist() == [3]  # FedAvg's max over a, b, c: not x's 900
    assert list(notes) == ["x"]
    assert notes["x"] == "left out: update norm 40 over 10× the median 2.5"
    assert shares.result() == pytest.approx({"a": 1 / 6, "b": 2 / 6, "c": 3 / 6, "x": 0.0},
                                           abs=1e-6)
    plain = aggregate(states, weights, "mean", reference=reference)
    kept = aggregate(states, weights, "mean", reference=reference, outlier_bound=20.0)
    assert kept["w"].tobytes() == plain["w"].tobytes()
    assert kept["n"].tobytes() == plain["n"].tobytes()
    assert aggregate(states, weights, "mean", reference=reference,
                     outlier_bound=0.0)["w"].tobytes() == plain["w"].tobytes()
    # the bound sits exactly at 10 × 2.5 = 25: an update of norm 25 stays, 25.5 does not
    at = {**states, "x": {"w": np.array([0, -25], np.float32), "n": np.array([4])}}
    assert without_outliers(at, 10.0, reference) == ["a", "b", "c", "x"]
    over = {**states, "x": {"w": np.array([0, -25.5], np.float32), "n": np.array([4])}}
    assert without_outliers(over, 10.0, reference) == ["a", "b", "c"]
    assert DEFAULT_OUTLIER_BOUND == 10.0


def test_the_outlier_bound_per_layer_group_and_where_it_cannot_judge() -> None:
    """Mixed cuts: l1 held by a, b, c, x; l2 only by a, b, x. x's l1 update is an outlier
    (left out of l1), its l2 update is not (kept in l2). Two devices (no majority), an
    all-zero median, no float tensors: nobody is left out. Without a reference the
    updates are taken from the coordinate-wise median."""
    states = {"a": {"l1": np.array([1.0]), "l2": np.array([1.0])},
              "b": {"l1": np.array([2.0]), "l2": np.array([2.0])},
              "c": {"l1": np.array([3.0])},
              "x": {"l1": np.array([500.0]), "l2": np.array([4.0])}}
    weights = {"a": 1, "b": 1, "c": 1, "x": 1}
    reference = {"l1": np.array([0.0]), "l2": np.array([0.0])}
    notes: dict[str, str] = {}
    out = aggregate(states, weights, "mean", reference=reference, notes=notes,
                    outlier_bound=10.0)
    assert out["l1"].tolist() == pytest.approx([2.0])
    assert out["l2"].tolist() == pytest.approx([7 / 3])
    assert list(notes) == ["x"]
    two = {"a": {"w": np.array([1.0])}, "x": {"w": np.array([1e6])}}
    assert without_outliers(two, 10.0, {"w": np.array([0.0])}) == ["a", "x"]
    still = {a: {"w": np.array([0.0])} for a in "abc"} | {"x": {"w": np.array([9.0])}}
    assert without_outliers(still, 10.0, {"w": np.array([0.0])}) == ["a", "b", "c", "x"]
    ints = {a: {"n": np.array([i])} for i, a in enumerate(["a", "b", "c", "x"])}
    assert without_outliers(ints, 10.0) == ["a", "b", "c", "x"]
    # around the coordinate-wise median (2.5 for l1 over a, b, c, x): x is 497.5 away
    assert without_outliers({a: {"l1": s["l1"]} for a, s in states.items()}, 10.0) == [
        "a", "b", "c"]


def test_median_and_trimmed_shares_at_five_and_six_devices() -> None:
    """The positions each coordinate-wise rule keeps, at odd and even n: median of 5 keeps
    position 2, of 6 positions 2 and 3; trimming 1 of 6 at each end keeps positions 1..4.
    Values are in id order, so the kept positions are the kept devices."""
    five = _states({a: [float(i)] for i, a in enumerate("abcde")}, ints=False)
    assert _shares(five, dict.fromkeys("abcde", 1), "median") == {
        "a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0, "e": 0.0}
    six = _states({a: [float(i)] for i, a in enumerate("abcdef")}, ints=False)
    assert _shares(six, dict.fromkeys("abcdef", 1), "median") == {
        "a": 0.0, "b": 0.0, "c": 0.5, "d": 0.5, "e": 0.0, "f": 0.0}
    assert _shares(six, dict.fromkeys("abcdef", 1), "trimmed-mean") == {
        "a": 0.0, "b": 0.25, "c": 0.25, "d": 0.25, "e": 0.25, "f": 0.0}


def test_shares_are_rounded_to_six_decimals() -> None:
    shares = Shares()
    shares.add({"a": 1 / 3, "b": 2 / 3}, 1)
    assert shares.result() == {"a": 0.333333, "b": 0.666667}


def test_the_outlier_bound_at_the_edges_of_its_arguments() -> None:
    """Two devices are never judged, whatever the factor (there is no majority); three
    are; factor 1 leaves out whoever is over the median; a factor of 0 or less is off."""
    ref = {"w": np.array([0.0])}
    two = {"a": {"w": np.array([1.0])}, "x": {"w": np.array([1e6])}}
    assert without_outliers(two, 1.5, ref) == ["a", "x"]
    three = {"a": {"w": np.array([1.0])}, "b": {"w": np.array([2.0])},
             "x": {"w": np.array([100.0])}}
    assert without_outliers(three, 10.0, ref) == ["a", "b"]
    assert without_outliers(three, 1.0, ref) == ["a", "b"]
    assert without_outliers({**three, "x": {"w": np.array([3.0])}}, 1.0, ref) == ["a", "b"]
    for off in (0.0, -1.0):
        assert without_outliers(three, off, ref) == ["a", "b", "x"]


def test_the_outlier_bound_reads_a_float32_overflow_as_huge_not_infinite() -> None:
    """Update norms are summed in float32 (no float64 copy of the block); an upload at
    ±3e37 overflows that sum, so it is taken again in float64: x's norm is finite (its note
    says 1.2e+38, √16 · 3e37) and x is left out, while an honest float32 block's norm is the
    float64 one to 1e-6."""
    rng = np.random.default_rng(0)
    ref = {"w": rng.normal(0, 1, (4, 4)).astype(np.float32), "i": np.array([3], np.int64)}
    fleet = {a: {"w": (ref["w"] + rng.normal(0, 0.01, (4, 4))).astype(np.float32),
                 "i": np.array([3], np.int64)} for a in ("a", "b", "c")}
    huge = np.full((4, 4), 3e37, np.float32)
    huge[::2] *= -1
    notes: dict[str, str] = {}
    kept = without_outliers({**fleet, "x": {"w": huge, "i": np.array([3], np.int64)}}, 10.0,
                            ref, notes)
    assert kept == ["a", "b", "c"]
    assert "update norm 1.2e+38 over 10× the median" in notes["x"]
    from jetsplit.server.defences.aggregators import _update_norm

    want = float(np.linalg.norm(fleet["a"]["w"].astype(np.float64)
                                - ref["w"].astype(np.float64)))
    assert _update_norm(fleet["a"], ["w"], ref) == pytest.approx(want, rel=1e-6)
    assert np.isfinite(_update_norm({"w": huge}, ["w"], ref))


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_coordinate_wise_rules_give_the_same_bits_slice_by_slice(
        rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The median and the trimmed mean work CHUNK coordinates at a time (no copy of every
    upload). At CHUNK = 7, tensors of 50, 15 and 1 coordinates (slices that do not divide
    them) and five devices with ties and an outlier give the bits and the shares of the
    whole-tensor computation, written out here."""
    import jetsplit.server.defences.aggregators as aggregators

    rng = np.random.default_rng(4)
    shapes = {"w": (50,), "k": (3, 5), "b": (1,)}
    states = {a: {n: rng.normal(0, 1, s).astype(np.float32) for n, s in shapes.items()}
              for a in "abcde"}
    states["c"]["w"][:20] = states["a"]["w"][:20]  # ties: the stable order decides
    states["e"]["k"] *= 1000
    weights = dict.fromkeys("abcde", 1.0)
    whole, sliced = Shares(), Shares()
    expected = aggregate(states, weights, rule, shares=whole)
    monkeypatch.setattr(aggregators, "CHUNK", 7)
    out = aggregate(states, weights, rule, shares=sliced)
    assert whole.result() == sliced.result() and set(whole.result()) == set("abcde")
    for n, shape in shapes.items():
        stacked = np.stack([states[a][n].astype(np.float64) for a in "abcde"])
        if rule == "median":
            by_hand = np.median(stacked, axis=0)
        else:  # β = 0.2 of five: one dropped at each end
            by_hand = np.sort(stacked, axis=0)[1:4].mean(axis=0)
        assert out[n].dtype == np.float32 and out[n].shape == shape
        assert out[n].tobytes() == expected[n].tobytes() == by_hand.astype(np.float32).tobytes()
