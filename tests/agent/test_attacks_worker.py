"""The attack harness inside a real worker: each kind at the worker's hooks, against an
honest twin (same data, seed and bundle) or a hand computation. Device-side torch work only
(marker `device_torch`: `make device-check` also runs it on torch 1.13.1)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from jetsplit.bundle import MANIFEST_NAME, Bundle, load_bundle
from jetsplit.data import ArrayDataset, load_dataset_split
from jetsplit.edge_agent.attacks import ALLOW_ENV, Attack, parse_attack
from jetsplit.edge_agent.edge import no_data
from jetsplit.edge_agent.worker import AgentWorker, BatchSampler
from jetsplit.errors import ConfigError, JetsplitError
from jetsplit.models import ModelSpec
from jetsplit.models.weights import to_arrays
from jetsplit.protocol import parse_registration

pytestmark = pytest.mark.device_torch

SEED = 3
BATCH = 8
CLIENT = {"blocks": ["client"]}


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MobileNetV3-small at cut 2 with an aux head, on 8×8 digits."""
    from jetsplit.export.bundle_writer import write_bundle

    out = tmp_path_factory.mktemp("bundle") / "bundle"
    write_bundle(ModelSpec("mobilenetv3-small", (1, 8, 8), 10), 2, out, seed=0)
    return out


@pytest.fixture(scope="module")
def bundle(bundle_dir: Path) -> Bundle:
    return load_bundle(bundle_dir)


@pytest.fixture(scope="module")
def data() -> ArrayDataset:
    return load_dataset_split("digits", 0.2, 0)[0].subset(range(64))


def make(bundle: Bundle, bundle_dir: Path, data: ArrayDataset, spec: str | None,
         tmp_path: Path, name: str = "a0") -> AgentWorker:
    """A worker with the bundle installed (from a shared verified copy, as in simulate)."""
    raw = (bundle_dir / MANIFEST_NAME).read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    attack = None if spec is None else Attack(parse_attack(spec), SEED)
    worker = AgentWorker(name, data, seed=SEED, state_dir=tmp_path / name,
                         bundle_cache={digest: bundle}, attack=attack)
    meta = {"sha256": digest, "role": json.loads(raw)["role"],
            "optimizer": {"name": "sgd", "lr": 0.05}}
    assert worker.handle("bundle", 0, 0, meta, {"manifest": np.frombuffer(raw, np.uint8)}
                         ).meta["installed"] is True
    return worker


def floats(arrays: dict[str, np.ndarray]) -> list[str]:
    return [k for k, v in arrays.items() if np.issubdtype(v.dtype, np.floating)]


def test_scale_uploads_f_times_its_weights(bundle: Bundle, bundle_dir: Path,
                                           data: ArrayDataset, tmp_path: Path) -> None:
    worker = make(bundle, bundle_dir, data, "scale:1000", tmp_path)
    worker.handle("train", 0, 0, {"target": "aux", "steps": 2, "batch": BATCH}, {})
    assert worker.client is not None
    held = to_arrays(worker.client, "client")
    sent = worker.handle("get_weights", 0, 0, CLIENT, {}).tensors
    assert set(sent) == set(held) and len(floats(held)) < len(held)  # BatchNorm counters
    for name, w in held.items():
        want = w * np.float32(1000) if name in floats(held) else w
        assert np.array_equal(sent[name], want), name
    again = to_arrays(worker.client, "client")  # only the upload is scaled, not the block
    assert all(np.array_equal(again[k], held[k]) for k in held)


def test_signflip_around_set_weights_and_around_the_bundle(
        bundle: Bundle, bundle_dir: Path, data: ArrayDataset, tmp_path: Path) -> None:
    worker = make(bundle, bundle_dir, data, "signflip", tmp_path)
    assert worker.client is not None
    initial = to_arrays(worker.client, "client")  # what the bundle gave it
    step = {"target": "aux", "steps": 2, "batch": BATCH}
    worker.handle("train", 0, 0, step, {})
    w = to_arrays(worker.client, "client")
    sent = worker.handle("get_weights", 0, 0, CLIENT, {}).tensors
    for name in floats(w):
        assert np.array_equal(sent[name], 2 * initial[name] - w[name]), name
    g = {k: v + np.float32(0.01) if k in floats(initial) else v for k, v in initial.items()}
    worker.handle("set_weights", 1, 0, {}, g)
    worker.handle("train", 1, 0, step, {})
    w = to_arrays(worker.client, "client")
    sent = worker.handle("get_weights", 1, 0, CLIENT, {}).tensors
    for name in floats(w):
        assert np.array_equal(sent[name], 2 * g[name] - w[name]), name
    assert not all(np.array_equal(sent[k], w[k]) for k in floats(w))
    counter = [k for k in w if k not in floats(w)][0]
    assert np.array_equal(sent[counter], w[counter])


def test_noise_is_seeded_from_the_agent(bundle: Bundle, bundle_dir: Path, data: ArrayDataset,
                                        tmp_path: Path) -> None:
    worker = make(bundle, bundle_dir, data, "noise:0.1", tmp_path)
    assert worker.client is not None
    held = to_arrays(worker.client, "client")
    sent = worker.handle("get_weights", 0, 0, CLIENT, {}).tensors
    rng = np.random.default_rng(SEED)
    for name, w in held.items():
        if name in floats(held):
            w = (w + rng.normal(0.0, 0.1, w.shape)).astype(w.dtype)
        assert np.array_equal(sent[name], w), name


def test_labelflip_in_forward_and_local_training(bundle: Bundle, bundle_dir: Path,
                                                 data: ArrayDataset, tmp_path: Path) -> None:
    liar = make(bundle, bundle_dir, data, "labelflip", tmp_path, "liar")
    # Its twin: an honest agent whose data holds y + 1 mod 10.
    twin = make(bundle, bundle_dir, replace(data, y=(data.y + 1) % 10), None, tmp_path, "twin")
    honest = make(bundle, bundle_dir, data, None, tmp_path, "honest")
    idx = BatchSampler(len(data), SEED).next(BATCH, 0)
    for worker in (liar, twin):
        out = worker.handle("forward", 0, 0, {"batch": BATCH}, {}).tensors
        assert out["labels"].tolist() == ((data.y[idx] + 1) % 10).tolist()
    honest.handle("forward", 0, 0, {"batch": BATCH}, {})
    # Local training: the same steps as the twin's, not as the honest agent's.
    step = {"target": "aux", "steps": 3, "batch": BATCH}
    losses = [w.handle("train", 1, 0, step, {}).meta["loss"] for w in (liar, twin, honest)]
    assert losses[0] == losses[1] != losses[2]
    sent = [w.handle("get_weights", 1, 0, CLIENT, {}).tensors for w in (liar, twin)]
    assert all(np.array_equal(sent[0][k], sent[1][k]) for k in sent[0])


def test_activation_scale_in_forward_replies(bundle: Bundle, bundle_dir: Path,
                                             data: ArrayDataset, tmp_path: Path) -> None:
    liar = make(bundle, bundle_dir, data, "activation-scale:50", tmp_path, "liar")
    honest = make(bundle, bundle_dir, data, None, tmp_path, "honest")
    lied, told = (w.handle("forward", 0, 0, {"batch": BATCH}, {}).tensors
                  for w in (liar, honest))
    assert np.array_equal(lied["labels"], told["labels"])
    assert np.allclose(lied["activations"], told["activations"] * 50, rtol=1e-6, atol=1e-6)
    grad = {"grad": np.ones_like(told["activations"])}
    assert liar.handle("backward", 0, 0, {}, grad).meta == {}  # its own pass is unscaled


@pytest.mark.parametrize(("spec", "size", "histogram"), [
    ("size-lie:6400", 6400, None), ("histogram-lie", 64, [64] + [0] * 9)])
def test_registration_lies_and_still_parses(data: ArrayDataset, tmp_path: Path, spec: str,
                                            size: int, histogram: list[int] | None) -> None:
    worker = AgentWorker("a1", data, seed=SEED, state_dir=tmp_path,
                         attack=Attack(parse_attack(spec), SEED))
    claim = parse_registration(worker.registration()).dataset
    assert claim.size == size and sum(claim.label_histogram) == size
    true = np.bincount(data.y, minlength=10)
    assert claim.label_histogram == (histogram or [int(h) * 100 for h in true])
    assert len(worker.data) == 64  # what it trains on is unchanged


def test_edges_do_not_attack(tmp_path: Path) -> None:
    with pytest.raises(JetsplitError, match="attacks are for client agents"):
        AgentWorker("e0", no_data(), role="edge", state_dir=tmp_path,
                    attack=Attack(parse_attack("scale:2")))


def test_agent_config_attack_reaches_the_daemons_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`jetsplit agent run` builds its worker with build_worker: the [attack] rides along,
    seeded with the agent's seed."""
    from jetsplit.edge_agent.config import AgentConfig
    from jetsplit.edge_agent.worker_factory import build_worker

    monkeypatch.setenv(ALLOW_ENV, "1")
    cfg = AgentConfig.model_validate({
        "agent": "a2", "seed": SEED, "state_dir": str(tmp_path), "device": "cpu",
        "data": {"dataset": "digits", "clients": 4, "index": 2},
        "attack": {"kind": "noise:0.1"}})
    worker = build_worker(cfg)
    assert worker.attack.kind == "noise"
    w = {"client/x": np.zeros(3, np.float32)}
    assert np.array_equal(worker.attack.upload(w)["client/x"],
                          Attack(parse_attack("noise:0.1"), SEED).upload(w)["client/x"])
    monkeypatch.delenv(ALLOW_ENV)
    with pytest.raises(ConfigError, match="agent a2: attack: attacks are for tests"):
        build_worker(cfg)  # a config built in code is checked again where the worker is made
