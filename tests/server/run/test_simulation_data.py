"""What a simulation trains on, scores on and saves: with `validation` the score comes from a
held-out part of the training data, and the test split is neither trained on nor scored
(the GAPSL vs PSL sweep picks its learning rates this way); PSL saves only blocks that exist."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from jetsplit.data import load_dataset_split
from jetsplit.server.run.simulate import simulate, simulation_data
from jetsplit.server.training.settings import Settings

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


def test_psl_saves_the_blocks_of_clients_that_hold_one_and_asks_no_one_else(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """PSL never averages client blocks, so its save pulls each client's own; a client
    never selected holds no bundle and is not asked (it used to answer 'no bundle installed
    yet' at every run's end, counted as a miss)."""
    settings = Settings(algorithm="psl", rounds=1, local_steps=1, fraction=0.25, batch=16,
                        seed=0, threads=1)
    with caplog.at_level(logging.WARNING):
        summary = simulate(settings, model="mobilenetv3-small", split=2, dataset="digits",
                           clients=4, partition_scheme="iid", out_dir=tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    trained = rows[0]["selected"]
    assert len(trained) == 1 and summary["final_accuracy"] is not None
    saved = sorted(p.stem for p in (tmp_path / "run" / "clients").glob("*.safetensors"))
    assert saved == trained
    assert "no bundle installed" not in caplog.text
