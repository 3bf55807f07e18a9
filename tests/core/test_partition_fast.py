"""Fast tier (`-m fast`): the partitioners' exact shapes on 30 labels (5 classes × 6) with
fixed seeds: each client's size and per-class counts, pinned, and where the scheme is a few
documented draws from `default_rng(seed)` (iid, Dirichlet) replayed here step by step; the
edge paths (top-up, an empty quantity client, the Dirichlet floor, bad input) by hand.
Torch-free: `mutation/partition.toml` runs this file against every mutant."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from jetsplit.data.partition import (
    AMPERE_EPSILON,
    client_shards,
    label_histogram,
    parse_scheme,
    partition,
)
from jetsplit.errors import ConfigError

pytestmark = pytest.mark.fast

LABELS = np.repeat(np.arange(5), 6)  # 5 classes × 6 samples, indices 6c..6c+5 are class c


def _histograms(parts: list[np.ndarray]) -> list[list[int]]:
    return [np.bincount(LABELS[p], minlength=5).tolist() for p in parts]


def _well_formed(parts: list[np.ndarray], covers: bool = True) -> None:
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)  # sorted, no repeats
    every = np.concatenate(parts)
    assert len(set(every.tolist())) == every.size  # disjoint
    if covers:
        assert sorted(every.tolist()) == list(range(30))


# ------------------------------------------------------------------------ replayed draws


def test_iid_is_one_seeded_permutation_dealt_by_array_split() -> None:
    """iid, 4 clients: default_rng(1).permutation(30) cut 8, 8, 7, 7, each part sorted."""
    parts = partition(LABELS, 4, "iid", seed=1)
    order = np.random.default_rng(1).permutation(30)
    want = [np.sort(order[a:b]) for a, b in ((0, 8), (8, 16), (16, 23), (23, 30))]
    assert [p.tolist() for p in parts] == [w.tolist() for w in want]
    assert _histograms(parts) == [[2, 2, 2, 1, 1], [1, 0, 1, 2, 4], [3, 3, 1, 0, 0],
                                  [0, 1, 2, 3, 1]]
    _well_formed(parts)


def test_dirichlet_deals_each_class_by_its_cumulative_shares() -> None:
    """dirichlet:0.5, 4 clients, seed 0 (every client gets >= 2 on the first draw): per
    class c in order, shares s ~ Dir(0.5, 0.5, 0.5, 0.5), cut points ⌊6·cumsum(s)⌋ (the
    last dropped), then that class's 6 indices permuted and split at the cut points."""
    parts = partition(LABELS, 4, "dirichlet:0.5", seed=0)
    rng = np.random.default_rng(0)
    want: list[list[int]] = [[], [], [], []]
    for c in range(5):
        shares = rng.dirichlet([0.5] * 4)
        cuts = [int(v) for v in np.floor(np.cumsum(shares) * 6)[:3]]
        chunks = np.split(rng.permutation(np.arange(6 * c, 6 * c + 6)), cuts)
        for client, chunk in enumerate(chunks):
            want[client] += chunk.tolist()
    assert [p.tolist() for p in parts] == [sorted(w) for w in want]
    assert _histograms(parts) == [[1, 2, 2, 1, 0], [0, 1, 0, 2, 2], [3, 2, 3, 2, 3],
                                  [2, 1, 1, 1, 1]]
    _well_formed(parts)


# ------------------------------------------------------------------------ pinned shapes


def test_quantity_shapes_first_label_i_mod_c_then_random_and_even_splits() -> None:
    """quantity:2, 7 clients, seed 2: client i holds class i mod 5 and one more; a class's 6
    samples are array_split among its holders (class 0: 6 holders → 1 each; class 1: 2
    holders → 3 + 3; class 4: 2 → 3 + 3), so sizes differ."""
    parts = partition(LABELS, 7, "quantity:2", seed=2)
    assert _histograms(parts) == [
        [1, 0, 0, 0, 3], [1, 3, 0, 0, 0], [1, 0, 3, 0, 0], [1, 0, 0, 3, 0],
        [0, 0, 3, 0, 3], [1, 0, 0, 3, 0], [1, 3, 0, 0, 0]]
    _well_formed(parts)
    five = partition(LABELS, 5, "quantity:2", seed=2)  # class 0 over 4 holders: 2, 2, 1, 1
    assert _histograms(five) == [[2, 0, 0, 0, 3], [2, 6, 0, 0, 0], [1, 0, 3, 0, 0],
                                 [1, 0, 0, 6, 0], [0, 0, 3, 0, 3]]
    three = partition(LABELS, 4, "quantity:3", seed=0)
    assert _histograms(three) == [[3, 2, 0, 2, 0], [0, 2, 0, 2, 3], [0, 2, 3, 0, 3],
                                  [3, 0, 3, 2, 0]]


def test_quantity_leaves_classes_nobody_drew_out_and_caps_alpha_at_c() -> None:
    """quantity:1 with 3 clients over 5 classes: client i holds class i alone (6 each),
    classes 3 and 4 are nobody's. quantity:5 over 3 classes: every client holds all three
    (α capped at C), class 2's single sample goes to the first holder."""
    parts = partition(LABELS, 3, "quantity:1", seed=4)
    assert [p.tolist() for p in parts] == [list(range(6 * i, 6 * i + 6)) for i in range(3)]
    labels = np.array([0, 0, 0, 1, 1, 1, 2])
    held = [sorted(set(labels[p].tolist())) for p in partition(labels, 3, "quantity:5", 0)]
    assert held == [[0, 1, 2], [0, 1], [0, 1]]


def test_quantity_with_an_empty_client_is_one_line() -> None:
    """Class 1 has one sample and two holders (clients 1 and 3): client 3 gets nothing."""
    with pytest.raises(ConfigError) as exc:
        partition(np.array([0, 0, 0, 1]), 4, "quantity:1", seed=0)
    assert str(exc.value) == ("partition 'quantity:1' leaves client 3 with no samples "
                              "(1 empty of 4); use fewer clients or a larger α")


def test_ampere_quotas_and_class_vectors() -> None:
    """ampere:α, 4 devices, seed 1: quotas N/K = 8, 8, 7, 7 whatever α; at α = 0.33 (the
    paper's default) each device is dominated by one or two classes, at α = 1 it is
    mixed. A class that runs out is dropped: class 4 ends with all 6 samples dealt."""
    skewed = partition(LABELS, 4, "ampere:0.33", seed=1)
    assert _histograms(skewed) == [[1, 0, 0, 6, 1], [5, 1, 0, 0, 2], [0, 0, 6, 0, 1],
                                   [0, 5, 0, 0, 2]]
    mixed = partition(LABELS, 4, "ampere:1", seed=1)
    assert _histograms(mixed) == [[1, 0, 4, 2, 1], [3, 1, 1, 3, 0], [2, 3, 1, 1, 0],
                                  [0, 2, 0, 0, 5]]
    for parts in (skewed, mixed):
        _well_formed(parts)
    assert AMPERE_EPSILON == 1e-8


def test_ampere_uses_concentration_alpha_over_one_minus_alpha_plus_epsilon(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The class vectors come from Dir(α/(1−α+ε)): 0.25/(0.75+ε) at α = 0.25 and
    1/ε = 1e8 at α = 1."""
    module = sys.modules[parse_scheme.__module__]
    seen: list[float] = []
    real = module._ampere

    def spy(y: np.ndarray, k: int, concentration: float, rng: np.random.Generator
            ) -> list[np.ndarray]:
        seen.append(concentration)
        return real(y, k, concentration, rng)

    monkeypatch.setattr(module, "_ampere", spy)
    partition(LABELS, 4, "ampere:0.25", seed=1)
    partition(LABELS, 3, "ampere:1", seed=1)
    assert seen == [0.25 / (0.75 + 1e-8), 1 / 1e-8]


def test_ampere_runs_out_of_a_class_and_renormalises() -> None:
    """Class 0 holds 1 sample and class 1 holds 9: whatever the vectors, 2 devices of 5
    rows each end with the lone 0 somewhere and 9 ones, every sample dealt."""
    labels = np.array([0] + [1] * 9)
    parts = partition(labels, 2, "ampere:0.05", seed=3)
    assert [p.size for p in parts] == [5, 5]
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))


# ------------------------------------------------------------------------ Dirichlet floor


def test_dirichlet_tops_up_the_last_draw_from_the_largest_shard() -> None:
    """dirichlet:0.01, 10 clients, seed 3: no draw in 100 gives everyone 2, the last one is
    5, 5, 5, 5, 0, 7, 1, 0, 1, 1; the top-up walks clients in order, each time taking a
    sample from the first largest shard: client 4 from 5 (7→5), client 6 from 0, client 7
    from 1 and 2, client 8 from 3, client 9 from 5 again."""
    parts = partition(LABELS, 10, "dirichlet:0.01", seed=3)
    assert [p.size for p in parts] == [4, 4, 4, 4, 2, 4, 2, 2, 2, 2]
    _well_formed(parts)
    floor3 = partition(LABELS, 10, "dirichlet:0.01", seed=3, min_samples=3)
    assert [p.size for p in floor3] == [3] * 10  # floor min(3, 30 // 10) = 3
    floor1 = partition(LABELS, 10, "dirichlet:0.01", seed=3, min_samples=0)
    assert min(p.size for p in floor1) >= 1  # the floor is never below 1


def test_dirichlet_floor_is_capped_by_n_over_k() -> None:
    """min_samples=5 with 30 samples over 10 clients: the floor is 30 // 10 = 3."""
    parts = partition(LABELS, 10, "dirichlet:0.01", seed=3, min_samples=5)
    assert [p.size for p in parts] == [3] * 10


# ------------------------------------------------------------------------ input checks


@pytest.mark.parametrize(("args", "message"), [
    ((LABELS, True, "iid", 0), "num_clients must be an integer, got True"),
    ((LABELS, 2.0, "iid", 0), "num_clients must be an integer, got 2.0"),
    ((LABELS, 31, "iid", 0), "between 1 and the number of samples (30), got 31"),
    ((LABELS, 0, "iid", 0), "between 1 and the number of samples (30), got 0"),
    ((LABELS, 2, "iid", -1), "seed must be a non-negative integer, got -1"),
    ((LABELS, 2, "iid", True), "seed must be a non-negative integer, got True"),
    ((LABELS, 2, "iid", 1.0), "seed must be a non-negative integer, got 1.0"),
    ((LABELS.astype(float), 2, "iid", 0), "labels must be a 1-D integer array, got float64"),
    ((LABELS.reshape(5, 6), 2, "iid", 0), "labels must be a 1-D integer array, got int64"),
    ((np.array([], dtype=np.int64), 1, "iid", 0), "labels are empty"),
    ((LABELS - 1, 2, "iid", 0), "labels must be >= 0, found -1"),
])
def test_bad_input_is_one_line(args: tuple, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        partition(*args)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_labels_checked_against_num_classes_and_edges_accepted() -> None:
    with pytest.raises(ConfigError, match=r"^label 4 is out of range for 4 classes$"):
        partition(LABELS, 2, "iid", 0, num_classes=4)
    assert len(partition(LABELS, 2, "iid", 0, num_classes=5)) == 2
    assert [p.size for p in partition(LABELS, 30, "iid", 0)] == [1] * 30  # K = N
    assert [p.size for p in partition(LABELS, 1, "dirichlet:2", 0)] == [30]  # K = 1
    assert [p.size for p in partition(LABELS.astype(np.uint8), 2, "iid", np.int64(0))] == [15, 15]


@pytest.mark.parametrize(("scheme", "kind", "value"), [
    ("iid", "iid", None), ("quantity:1", "quantity", 1.0), ("quantity:12", "quantity", 12.0),
    ("dirichlet:1e-3", "dirichlet", 1e-3), ("dirichlet:.5", "dirichlet", 0.5),
    ("ampere:1", "ampere", 1.0), ("ampere:1.0", "ampere", 1.0), ("ampere:1e-9", "ampere", 1e-9),
])
def test_parse_scheme_accepts(scheme: str, kind: str, value: float | None) -> None:
    parsed = parse_scheme(scheme)
    assert (parsed.kind, parsed.value) == (kind, value)


@pytest.mark.parametrize(("scheme", "says"), [
    ("quantity:0", "quantity needs an integer α >= 1"),
    ("quantity:2.0", "quantity needs an integer α >= 1"),
    ("dirichlet:0", "dirichlet needs a finite β > 0"),
    ("dirichlet:1e999", "dirichlet needs a finite β > 0"),
    ("ampere:0", "ampere needs 0 < α <= 1"),
    ("ampere:1.01", "ampere needs 0 < α <= 1"),
    ("iid:", "unknown partition scheme 'iid:'"),
    ("Dirichlet:1", "unknown partition scheme"),
    ("xdirichlet:1", "unknown partition scheme"),
    ("dirichlet:1x", "unknown partition scheme"),
])
def test_parse_scheme_refuses(scheme: str, says: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_scheme(scheme)
    assert says in str(exc.value) and repr(scheme) in str(exc.value)


def test_label_histogram_counts_every_class() -> None:
    assert label_histogram(np.array([0, 2, 2, 3]), 5) == [1, 0, 2, 1, 0]
    assert label_histogram([], 2) == [0, 0]
    assert all(type(v) is int for v in label_histogram(LABELS, 5))
    for bad in ([0, 5], [-1, 0]):
        with pytest.raises(ValueError, match=r"^labels must lie in \[0, 5\)$"):
            label_histogram(np.array(bad), 5)


# ------------------------------------------------------------------------ fallbacks


def test_quantity_skips_a_class_nobody_holds_and_deals_the_later_ones() -> None:
    """quantity:2, 2 clients, seed 0: client 0 draws classes 0, 3, client 1 classes 1, 4;
    class 2 is nobody's, and classes 3 and 4 after it are still dealt (6 each)."""
    parts = partition(LABELS, 2, "quantity:2", seed=0)
    assert _histograms(parts) == [[6, 0, 0, 6, 0], [0, 6, 0, 0, 6]]


def test_dirichlet_shares_that_underflow_fall_back_to_even() -> None:
    """β = 1e308: the gammas overflow and every share comes back 0, so each class is split
    evenly, ⌊6·(1/3, 2/3)⌋ = 2, 4: two samples of each class per client."""
    with np.errstate(all="ignore"):
        parts = partition(LABELS, 3, "dirichlet:1e308", seed=0)
    assert _histograms(parts) == [[2] * 5] * 3


def test_ampere_falls_back_to_the_classes_left_when_its_vector_runs_dry() -> None:
    """ampere:1e-6, labels 0, 0, 1 × 8, seed 4: both class vectors are one-hot on class 0.
    Device 0 draws 5 zeros, gets the only 2, and with class 0 gone its vector has no mass
    left, so it draws its other 3 from what is left (class 1); device 1 finds class 0 empty
    from the start and takes 5 ones."""
    labels = np.array([0, 0] + [1] * 8)
    parts = partition(labels, 2, "ampere:1e-6", seed=4)
    assert [np.bincount(labels[p], minlength=2).tolist() for p in parts] == [[2, 3], [0, 5]]
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))


def test_a_parsed_scheme_is_frozen_and_histograms_start_anywhere() -> None:
    import dataclasses

    parsed = parse_scheme("dirichlet:0.5")
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.kind = "iid"  # type: ignore[misc]
    assert label_histogram(np.array([1, 2, 2]), 3) == [0, 1, 2]  # no label 0 is fine


def test_ampere_fallback_draws_among_all_classes_left() -> None:
    """Labels 0 × 2, 1 × 6, 2 × 6, ampere:1e-6, seed 3: device 0's vector is one-hot on
    class 0; after its 2 zeros its other 5 come from (0, 6/12, 6/12), a mix of 1s and
    2s (not all from the last class)."""
    labels = np.array([0] * 2 + [1] * 6 + [2] * 6)
    parts = partition(labels, 2, "ampere:1e-6", seed=3)
    assert [np.bincount(labels[p], minlength=3).tolist() for p in parts] == [[2, 3, 2],
                                                                            [0, 3, 4]]


def test_quantity_wraps_client_i_to_class_i_mod_c() -> None:
    """quantity:1, 11 clients over 5 classes: clients c, c+5, c+10 share class c, so class 0
    goes 2, 2, 2 to clients 0, 5, 10 and the others 3, 3."""
    parts = partition(LABELS, 11, "quantity:1", seed=0)
    assert [p.size for p in parts] == [2, 3, 3, 3, 3, 2, 3, 3, 3, 3, 2]
    assert [sorted(set(LABELS[p].tolist())) for p in parts] == [[i % 5] for i in range(11)]


def test_quantity_names_the_first_empty_client() -> None:
    """Class 1's one sample has holders 1, 3, 5: clients 3 and 5 are empty, 3 is named."""
    with pytest.raises(ConfigError, match=r"leaves client 3 with no samples \(2 empty of 6\)"):
        partition(np.array([0, 0, 0, 0, 0, 1]), 6, "quantity:1", seed=0)


def test_dirichlet_floor_edges() -> None:
    """The floor is max(1, min(min_samples, N // K)): min_samples=1 accepts a draw with
    1-sample clients; min_samples=8 over 4 clients is capped at 30 // 4 = 7 (not 7.5, which
    30 samples could never meet); a first draw whose smallest client equals the floor is
    kept (dirichlet:0.5, seed 0: sizes 6, 5, 13, 6 at floor 5)."""
    ones = partition(LABELS, 10, "dirichlet:0.01", seed=3, min_samples=1)
    assert [p.size for p in ones] == [5, 5, 5, 5, 1, 5, 1, 1, 1, 1]
    capped = partition(LABELS, 4, "dirichlet:0.01", seed=0, min_samples=8)
    assert [p.size for p in capped] == [8, 7, 7, 8]
    at_floor = partition(LABELS, 4, "dirichlet:0.5", seed=0, min_samples=5)
    first = partition(LABELS, 4, "dirichlet:0.5", seed=0)
    assert [p.tolist() for p in at_floor] == [p.tolist() for p in first]


def test_labels_must_be_1d_may_skip_0_and_stay_under_num_classes() -> None:
    with pytest.raises(ConfigError, match=r"^labels must be a 1-D integer array, got int64 \(\)$"):
        partition(np.array(3), 1, "iid", 0)
    assert [p.size for p in partition(np.array([1, 1, 2, 2]), 2, "iid", 0)] == [2, 2]
    with pytest.raises(ConfigError, match=r"^label 4 is out of range for 3 classes$"):
        partition(LABELS, 2, "iid", 0, num_classes=3)
    with pytest.raises(ValueError, match=r"^labels must lie in \[0, 5\)$"):
        label_histogram(np.array([0, 6]), 5)


def test_a_lone_client_holds_every_sample_under_any_scheme_more_are_partitions() -> None:
    """The agents' cut: `quantity:2` alone would give one client two of the five classes."""
    assert _histograms(partition(LABELS, 1, "quantity:2", 0, 5)) != [[6] * 5]
    for scheme in ("quantity:2", "dirichlet:0.1", "iid", "ampere:0.33"):
        (only,) = client_shards(LABELS, 1, scheme, 3, 5)
        assert only.dtype == np.int64 and only.tolist() == list(range(30))
    for clients in (2, 4):
        assert [p.tolist() for p in client_shards(LABELS, clients, "dirichlet:0.5", 1, 5)] == [
            p.tolist() for p in partition(LABELS, clients, "dirichlet:0.5", 1, 5)]
