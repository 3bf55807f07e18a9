"""A device's own pictures and a user's network, as they run on the device floor (Python
3.8/3.9, torch 1.13): `make device-check` runs this file in the arm64 userland (marker
`device_torch`), `make test` on the host's torch. Only device-side code runs here: the
cut finder's GraphModule blocks rebuilt from a bundle, the folder decoded lazily per batch,
the run's classes taken from the bundle by name, a truncated picture skipped and counted.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from jetsplit.data import ImageOptions, load_image_folder
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.models import ModelSpec

pytestmark = pytest.mark.device_torch
pytest.importorskip("PIL.Image")

from camera_folders import write_folder  # noqa: E402  (testing/, on the path in tests)
from device_bundles import offer  # noqa: E402

RUN = ["blue", "green", "red"]
SPEC = ModelSpec("usernets:tiny_resnet", (3, 16, 16), 3)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from jetsplit.export.bundle_writer import write_bundle

    out = tmp_path_factory.mktemp("bundle") / "bundle"
    write_bundle(SPEC, 4, out, seed=0, classes=RUN)  # cut after block1's add
    return out


def test_own_pictures_train_a_user_network_in_the_runs_classes(bundle_dir: Path,
                                                               tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "camera", per_class=8, seed=4, classes=("green", "red"))
    data = load_image_folder(folder, ImageOptions(image_size=16, seed=1))
    assert data.classes == ("green", "red")
    own = np.asarray(data.y).copy()
    worker = AgentWorker("cam0", data, seed=1, state_dir=tmp_path / "state")
    assert offer(worker, bundle_dir, 0.05)["installed"] is True
    assert worker.data.classes == tuple(RUN)
    assert np.array_equal(worker.data.y, own + 1)  # green → 1, red → 2 by name

    out = worker.handle("forward", 0, 0, {"batch": 6}, {})
    assert out.tensors["activations"].shape == (6, 8, 16, 16)
    assert set(out.tensors["labels"].tolist()) <= {1, 2}
    worker.handle("backward", 0, 0, {}, {"grad": np.zeros((6, 8, 16, 16), np.float32)})
    losses = [worker.handle("train", 0, step, {"target": "aux", "steps": 1, "batch": 8},
                            {}).meta["loss"] for step in range(4)]
    assert all(math.isfinite(v) for v in losses)
    status = worker.handle("status", 0, 0, {}, {}).meta
    assert status["data"]["skipped"] == 1  # the truncated green/0.png, skipped not fatal
    assert "0.png" in status["data"]["skipped_examples"][0]
