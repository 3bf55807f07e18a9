"""What a simulation trains on and scores on: with `validation` the score comes from a
held-out part of the training data, and the test split is neither trained on nor scored
(the GAPSL vs PSL sweep picks its learning rates this way)."""

from __future__ import annotations

from collections import Counter

import pytest

from jetsplit.data import load_dataset_split
from jetsplit.server.simulate import simulation_data

pytestmark = pytest.mark.fast


def rows(ds) -> Counter[bytes]:  # type: ignore[no-untyped-def]
    return Counter(x.tobytes() + bytes([int(y)]) for x, y in zip(ds.x, ds.y, strict=True))


def test_without_validation_the_test_split_is_scored() -> None:
    train, scored = simulation_data("digits", 0.2, 0.0, seed=3)
    ref_train, ref_test = load_dataset_split("digits", 0.2, 3)
    assert rows(train) == rows(ref_train) and rows(scored) == rows(ref_test)


def test_validation_is_carved_from_training_data_and_never_touches_the_test() -> None:
    train, scored = simulation_data("digits", 0.2, 0.25, seed=3)
    ref_train, _ = load_dataset_split("digits", 0.2, 3)
    assert rows(train) + rows(scored) == rows(ref_train)  # all of it training data, none test
    # stratified: each class gives round(n_c / 4) of its training samples
    per_class = Counter(int(y) for y in ref_train.y)
    assert Counter(int(y) for y in scored.y) == {c: round(n * 0.25) for c, n in per_class.items()}
    other_seed = simulation_data("digits", 0.2, 0.25, seed=4)[1]
    assert rows(other_seed) != rows(scored)  # the seed picks the held-out part
