"""The agent's torch work, as it runs on the device (JetPack 5: Python 3.8, torch 1.13).

`make device-check` runs this file inside an arm64 userland on torch 1.13.1 (marker
`device_torch`); `make test` runs it here on the host's torch. Only device-side code is
exercised: a bundle installed from its manifest through the file cache, the client block's
forward, backward and local training, weights out, the emulation books and telemetry.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from device_bundles import client_manifest, offer  # testing/, on the path in tests

from jetsplit.data import ArrayDataset, load_dataset_split
from jetsplit.edge_agent.emulation import DeviceClock, EmulationSection
from jetsplit.edge_agent.telemetry import Telemetry
from jetsplit.edge_agent.worker import AgentWorker, BatchSampler
from jetsplit.errors import BundleError
from jetsplit.models import ModelSpec
from jetsplit.protocol import ProtocolError

pytestmark = pytest.mark.device_torch

LR = 0.05
BATCH = 8


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A client bundle of MobileNetV3-small at cut 2 with an aux head (what the coordinator
    would ship). Writing one is the export tool's job; the device only installs it."""
    from jetsplit.export.bundle_writer import write_bundle

    out = tmp_path_factory.mktemp("bundle") / "bundle"
    write_bundle(ModelSpec("mobilenetv3-small", (1, 8, 8), 10), 2, out, seed=0)
    return out


@pytest.fixture(scope="module")
def data() -> ArrayDataset:
    return load_dataset_split("digits", 0.2, 0)[0].subset(range(96))


def install(worker: AgentWorker, bundle_dir: Path) -> dict:
    """Offer the client bundle as the coordinator would (testing/device_bundles.py)."""
    return offer(worker, bundle_dir, LR)


@pytest.fixture()
def worker(bundle_dir: Path, data: ArrayDataset, tmp_path: Path) -> AgentWorker:
    worker = AgentWorker("arm0", data, seed=3, state_dir=tmp_path / "state")
    assert install(worker, bundle_dir)["installed"] is True
    return worker


def test_bundle_installs_from_its_manifest(worker: AgentWorker) -> None:
    assert worker.bundle is not None and worker.bundle.split == 2
    assert worker.client is not None and worker.aux is not None
    assert worker.server is None  # role-true: the server block stays on the coordinator


def test_a_tampered_manifest_is_refused(bundle_dir: Path, data: ArrayDataset,
                                        tmp_path: Path) -> None:
    worker = AgentWorker("arm1", data, state_dir=tmp_path / "state")
    raw = client_manifest(bundle_dir)
    meta = {"sha256": hashlib.sha256(raw + b" ").hexdigest(), "role": "client"}
    with pytest.raises(BundleError, match="manifest sha256"):
        worker.handle("bundle", 0, 0, meta, {"manifest": np.frombuffer(raw, np.uint8)})
    assert worker.bundle is None


def test_forward_then_backward_is_one_sgd_step(worker: AgentWorker,
                                               data: ArrayDataset) -> None:
    """The client step equals SGD on the same batch done by hand: w - lr · dL/dw, with dL/da
    the gradient the coordinator sent back."""
    assert worker.client is not None
    reference = [p.detach().clone() for p in worker.client.parameters()]
    out = worker.handle("forward", 0, 0, {"batch": BATCH}, {})
    acts, labels = out.tensors["activations"], out.tensors["labels"]
    idx = BatchSampler(len(data), 3).next(BATCH, 0)  # the batch the agent drew
    assert labels.tolist() == data.y[idx].tolist()
    grad = np.random.default_rng(0).standard_normal(acts.shape).astype(np.float32) / 10

    replica = worker.bundle.client_module()  # fresh from the bundle: the weights before
    replica.train()
    x = torch.from_numpy(data.x[idx])
    replayed = replica(x)
    assert np.allclose(replayed.detach().numpy(), acts, atol=1e-5)
    replayed.backward(torch.from_numpy(grad))
    worker.handle("backward", 0, 0, {}, {"grad": grad})
    after, replayed_params = list(worker.client.parameters()), list(replica.parameters())
    assert len(after) == len(reference) == len(replayed_params) > 0
    for before, p_now, p_ref in zip(reference, after, replayed_params):  # noqa: B905 (3.9)
        assert torch.allclose(p_now.detach(), before - LR * p_ref.grad, atol=1e-6)


def test_backward_with_a_wrong_shape_is_refused(worker: AgentWorker) -> None:
    worker.handle("forward", 0, 0, {"batch": BATCH}, {})
    with pytest.raises(ProtocolError, match="needs 'grad' of shape"):
        worker.handle("backward", 0, 0, {}, {"grad": np.zeros((1, 2), np.float32)})


def test_local_training_with_the_aux_head_lowers_the_loss(worker: AgentWorker) -> None:
    first = worker.handle("train", 0, 0, {"target": "aux", "steps": 5, "batch": 16}, {}).meta
    for step in range(1, 6):
        last = worker.handle("train", 0, step, {"target": "aux", "steps": 5, "batch": 16},
                             {}).meta
    assert first["samples"] == 80 and math.isfinite(last["loss"])
    assert last["loss"] < first["loss"]
    scores = worker.handle("eval", 0, 0, {"target": "aux", "batch": 32}, {}).meta
    assert scores["total"] == 96 and 0.0 <= scores["accuracy"] <= 1.0


def test_weights_go_out_as_named_float32_arrays(worker: AgentWorker) -> None:
    assert worker.client is not None
    out = worker.handle("get_weights", 0, 0, {"blocks": ["client"]}, {})
    names = {f"client/{k}" for k in worker.client.state_dict()}
    assert set(out.tensors) == names
    assert out.meta["samples"] == 96
    assert all(a.dtype == np.float32 or a.dtype == np.int64 for a in out.tensors.values())


def test_emulation_books_stretch_compute_and_time_transfers() -> None:
    ticks = iter([0.0, 0.01])  # 10 ms of CPU work
    clock = DeviceClock(EmulationSection(profile="jetson-nano-4gb", compute_slowdown=3.0,
                                         uplink_mbps=80.0), cpu_clock=lambda: next(ticks))
    with clock.compute():
        pass
    clock.transfer(100_000, "up")  # 0.8 Mbit over 80 Mbit/s
    books = clock.snapshot()
    assert books["compute_s"] == pytest.approx(0.03, abs=1e-4)
    assert books["transfer_s"] == pytest.approx(0.01, abs=1e-3)
    assert books["profile"] == "jetson-nano-4gb" and books["compute_slowdown"] == 3.0


def test_telemetry_sample_is_finite_numbers() -> None:
    sample = Telemetry().sample()
    assert sample["rss_mb"] > 0 and math.isfinite(sample["rss_mb"])
    numbers = {k: v for k, v in sample.items() if isinstance(v, (int, float))
               and not isinstance(v, bool)}
    assert numbers and all(math.isfinite(v) for v in numbers.values())
