"""A field agent on its own image folder: `[data] own`, the run's classes by name, lazy
batches through every command, skipped files in the status reply, class names at
registration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jetsplit.edge_agent.config import AgentConfig
from jetsplit.edge_agent.worker_factory import build_worker, local_dataset
from jetsplit.errors import ConfigError
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.protocol import Kind, parse_registration
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.engines.seam import Command, InProcessEngine

Image = pytest.importorskip("PIL.Image")

RUN_CLASSES = ["bird", "cat", "dog"]


def _camera_folder(root: Path) -> Path:
    """A device's own pictures: two of the run's three classes, mixed sizes and formats,
    one zero-byte file."""
    rng = np.random.default_rng(7)
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(10):
            arr = rng.integers(0, 256, size=(int(rng.integers(24, 70)),
                                             int(rng.integers(24, 70)), 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / c / f"{i}{'.jpg' if i % 2 else '.png'}")
    (root / "dog" / "broken.png").write_bytes(b"")
    return root


def _config(tmp_path: Path, **data: object) -> AgentConfig:
    folder = _camera_folder(tmp_path / "camera")
    return AgentConfig.model_validate({
        "agent": "jetson1", "state_dir": str(tmp_path / "state"), "device": "cpu",
        "data": {"dataset": f"folder:{folder}", "own": True, "image_size": 16,
                 "classes": RUN_CLASSES, "workers": 0, **data}})


def test_own_folder_trains_evaluates_and_reports_skips(tmp_path: Path) -> None:
    worker = build_worker(_config(tmp_path))
    data = worker.data
    assert len(data) == 21 and data.classes == tuple(RUN_CLASSES)  # all of it, no split
    registration = parse_registration(worker.registration())
    assert registration.dataset.classes == RUN_CLASSES
    assert registration.dataset.label_histogram == [0, 10, 11]
    assert registration.dataset.input_shape == [3, 16, 16]

    archive = write_bundle(ModelSpec("mobilenetv3-small", (3, 16, 16), 3), 2,
                           tmp_path / "bundle", seed=1, tar=True).tar_path
    assert archive is not None
    engine = InProcessEngine({"jetson1": worker})
    ready = BundleShipper(engine, archive, lr=0.01, deadline_s=60,
                          content="aux").ensure(engine.online())
    assert ready == ["jetson1"]
    for kind, meta in ((Kind.TRAIN, {"steps": 6, "batch": 8}), (Kind.EVAL, {}),
                       (Kind.GENERATE, {"allow_torch": True, "batch": 8})):
        out = engine.send_and_receive({"jetson1": Command(kind.value, meta)})
        assert not out.missed, out.missed
    reply = out["jetson1"]
    assert reply.tensors["activations"].shape[0] == 21
    status = engine.send_and_receive({"jetson1": Command(Kind.STATUS.value)})["jetson1"]
    assert status.meta["data"]["skipped"] == 1
    assert "broken.png" in status.meta["data"]["skipped_examples"][0]


def test_a_class_the_run_does_not_know_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        local_dataset(_config(tmp_path, classes=["bird", "cat"]))
    assert "class 'dog' is not one of the run's 2 classes" in str(exc.value)


def test_own_data_is_not_partitioned(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="clients must be 1"):
        _config(tmp_path, clients=4)


def test_classes_need_named_classes(tmp_path: Path) -> None:
    config = AgentConfig.model_validate({"agent": "a", "data": {"dataset": "digits",
                                                                "classes": ["0", "1"]}})
    with pytest.raises(ConfigError, match="folder: or csv:"):
        local_dataset(config)


def test_an_agent_maps_its_own_classes_to_the_bundles_by_name(tmp_path: Path) -> None:
    """No `[data] classes` on the device: its folder's own order (cat, dog) is mapped to the
    run's list the bundle names (bird, cat, dog) when the bundle installs."""
    config = _config(tmp_path)
    config = config.model_copy(update={"data": config.data.model_copy(update={"classes": None})})
    worker = build_worker(config)
    assert worker.data.classes == ("cat", "dog")
    assert parse_registration(worker.registration()).dataset.label_histogram == [10, 11]
    own_labels = np.asarray(worker.data.y).copy()

    archive = write_bundle(ModelSpec("mobilenetv3-small", (3, 16, 16), 3), 2,
                           tmp_path / "bundle", seed=1, tar=True,
                           classes=RUN_CLASSES).tar_path
    assert archive is not None
    engine = InProcessEngine({"jetson1": worker})
    assert BundleShipper(engine, archive, lr=0.01, deadline_s=60,
                         content="aux").ensure(engine.online()) == ["jetson1"]
    assert worker.data.classes == tuple(RUN_CLASSES)
    np.testing.assert_array_equal(worker.data.y, own_labels + 1)  # cat 0→1, dog 1→2
    assert parse_registration(worker.registration()).dataset.label_histogram == [0, 10, 11]
    out = engine.send_and_receive({"jetson1": Command(Kind.TRAIN.value,
                                                      {"steps": 2, "batch": 8})})
    assert not out.missed, out.missed


def test_a_bundle_whose_classes_lack_the_devices_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path)
    config = config.model_copy(update={"data": config.data.model_copy(update={"classes": None})})
    worker = build_worker(config)
    archive = write_bundle(ModelSpec("mobilenetv3-small", (3, 16, 16), 2), 2,
                           tmp_path / "bundle", seed=1, tar=True,
                           classes=["bird", "cat"]).tar_path
    assert archive is not None
    engine = InProcessEngine({"jetson1": worker})
    ready = BundleShipper(engine, archive, lr=0.01, deadline_s=60,
                          content="aux").ensure(engine.online())
    assert ready == []
    assert worker.data.classes == ("cat", "dog") and worker.bundle is None
