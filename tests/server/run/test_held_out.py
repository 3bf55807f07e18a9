"""The coordinator's evaluation set: a trial's held-out split or a field run's own folder
(whole), relabelled to `[data] classes`, checked against the model's input shape and class
count in one line each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jetsplit.data import ImageDataset
from jetsplit.errors import ConfigError
from jetsplit.server.run.config import DataSection
from jetsplit.server.run.held_out import held_out_set, run_classes

pytest.importorskip("PIL.Image")

from camera_folders import write_folder  # noqa: E402  (testing/)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_folder(tmp_path_factory.mktemp("held") / "held", per_class=5, seed=2,
                        classes=("green", "red"), truncated=0)


def _data(folder: Path, **keys: object) -> DataSection:
    return DataSection.model_validate({"dataset": f"folder:{folder}", "image_size": 12,
                                       **keys})


def test_a_field_run_evaluates_its_own_folder_whole(folder: Path) -> None:
    test = held_out_set(_data(folder, own=True), (3, 12, 12), 2)
    assert isinstance(test, ImageDataset) and len(test) == 10
    assert run_classes(test) == ("green", "red")
    assert test.x[:4].shape == (4, 3, 12, 12)


def test_a_trial_holds_out_a_stratified_part(folder: Path) -> None:
    test = held_out_set(_data(folder, test_fraction=0.2), (3, 12, 12), 2)
    assert len(test) == 2 and np.bincount(test.y).tolist() == [1, 1]


def test_the_runs_classes_relabel_the_folder_by_name(folder: Path) -> None:
    test = held_out_set(_data(folder, own=True, classes=["blue", "green", "red"]),
                        (3, 12, 12), 3)
    assert run_classes(test) == ("blue", "green", "red")
    assert sorted(set(test.y.tolist())) == [1, 2]  # green 0→1, red 1→2; no blue here


def test_a_folder_class_the_list_lacks_is_one_line(folder: Path) -> None:
    with pytest.raises(ConfigError, match="class 'red' is not one of the run's 2 classes"):
        held_out_set(_data(folder, own=True, classes=["blue", "green"]), (3, 12, 12), 2)


@pytest.mark.parametrize(("shape", "classes", "message"), [
    ((3, 16, 16), 2, "samples come out 3×12×12 but \\[model\\] input_shape is 3×16×16"),
    ((1, 12, 12), 2, "samples come out 3×12×12 but \\[model\\] input_shape is 1×12×12"),
    ((3, 12, 12), 5, "2 classes but \\[model\\] classes is 5"),
])
def test_shape_and_class_count_must_match_the_model(folder: Path, shape: tuple[int, ...],
                                                    classes: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        held_out_set(_data(folder, own=True), shape, classes)


def test_classes_name_folder_classes_only() -> None:
    data = DataSection.model_validate({"dataset": "digits", "classes": ["a", "b"]})
    with pytest.raises(ConfigError, match="folder: or csv:"):
        held_out_set(data, (1, 8, 8), 10)
    assert run_classes(held_out_set(DataSection.model_validate({"dataset": "digits"}),
                                    (1, 8, 8), 10)) is None


def test_repeated_class_names_are_refused() -> None:
    with pytest.raises(ValueError, match="must not repeat a name"):
        DataSection.model_validate({"dataset": "digits", "classes": ["a", "a"]})
