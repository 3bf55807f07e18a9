"""An agent takes a bundle of a user's network only when the model code installed here is
the code the bundle was built with; nothing executable arrives with it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from jetsplit.bundle import MANIFEST_NAME, role_files
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
    manifest = json.loads((bundle_dir / MANIFEST_NAME).read_bytes())
    keep = role_files("client", aux=True)
    manifest.update(role="client", files={k: v for k, v in manifest["files"].items()
                                          if k in keep}, **changes)
    raw = json.dumps(manifest, sort_keys=True).encode()
    for name, entry in manifest["files"].items():
        blob = (bundle_dir / name).read_bytes()
        worker.files.write(entry["sha256"], len(blob), 0, blob)
    meta = {"sha256": hashlib.sha256(raw).hexdigest(), "role": "client",
            "optimizer": {"name": "sgd", "lr": 0.01}}
    return worker.handle("bundle", 0, 0, meta, {"manifest": np.frombuffer(raw, np.uint8)}).meta


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
