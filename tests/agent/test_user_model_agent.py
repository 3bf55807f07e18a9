"""An agent takes a bundle of a user's network only when the model code installed here is
the code the bundle was built with; nothing executable arrives with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from device_bundles import offer  # testing/, on the path in tests

from jetsplit.data import ArrayDataset
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.errors import BundleError
from jetsplit.models import ModelSpec

TINY = ModelSpec("usernets:tiny_resnet", (3, 16, 16), 10)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from jetsplit.export.bundle_writer import write_bundle

    out = tmp_path_factory.mktemp("bundle") / "bundle"
    write_bundle(TINY, 8, out, seed=0)
    return out


def _offer(worker: AgentWorker, bundle_dir: Path, **changes: object) -> dict:
    return offer(worker, bundle_dir, 0.01, **changes)


def _data() -> ArrayDataset:
    rng = np.random.default_rng(0)
    return ArrayDataset(rng.standard_normal((16, 3, 16, 16)).astype(np.float32),
                        rng.integers(0, 10, 16).astype(np.int64), "noise", 10)


def test_an_agent_installs_and_runs_a_user_network(bundle_dir: Path, tmp_path: Path) -> None:
    worker = AgentWorker("u0", _data(), seed=1, state_dir=tmp_path / "state")
    assert _offer(worker, bundle_dir)["installed"] is True
    out = worker.handle("forward", 0, 0, {"batch": 4}, {})
    assert out.tensors["activations"].shape == (4, 16, 1, 1)


def test_an_agent_refuses_a_bundle_built_with_other_code(bundle_dir: Path,
                                                         tmp_path: Path) -> None:
    worker = AgentWorker("u1", _data(), seed=1, state_dir=tmp_path / "state")
    other = {"module": "usernets", "sha256": "ab" * 32}
    with pytest.raises(BundleError) as info:
        _offer(worker, bundle_dir, code=other)
    text = str(info.value)
    assert "refused" in text and "abababababababab" in text and "\n" not in text
    assert worker.bundle is None
