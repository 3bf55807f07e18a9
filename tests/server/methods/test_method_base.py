"""Fast tier: what the methods' base class promises beyond a round (server/methods/base.py):
the final weights it saves, the state it checkpoints and restores (server block, its
optimiser, the global client block; an untrusted client block refused in one line), and how
live re-planning moves agents. The round itself is pinned in test_round_wiring.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.models.weights import to_arrays
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.methods import build_method
from jetsplit.server.methods.base import Method
from jetsplit.server.training.checkpoints import CheckpointError
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

pytestmark = pytest.mark.fast

SIZES = {"a0": 40, "a1": 70, "a2": 90, "a3": 60}
MIXED = {"a0": 1, "a1": 3, "a2": 1, "a3": 3}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Agents and server share this process: one torch thread each (conftest)."""


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(ModelSpec("mobilenetv3-small", (1, 8, 8), 10), 3,
                          tmp_path_factory.mktemp("base") / "k", seed=3, tar=True,
                          aux_ratio=None)
    assert report.tar_path is not None
    return report.tar_path


def _trainer(archive: Path, algorithm: str, cuts: dict[str, int]) -> Trainer:
    train, test = load_dataset_split("digits", 0.2, 0)
    order = np.random.default_rng(0).permutation(len(train))
    starts = np.cumsum([0, *SIZES.values()])
    workers = {a: AgentWorker(a, train.subset(order[starts[i]:starts[i + 1]]), seed=i)
               for i, a in enumerate(SIZES)}
    settings = Settings(algorithm=algorithm, rounds=2, local_steps=2, batch=32, lr=0.05,
                        optimizer="sgd", momentum=0.9, seed=0)
    return Trainer(InProcessEngine(workers), archive, settings, test.subset(np.arange(64)),
                   cuts=cuts)


def _run(t: Trainer, method: Method, rounds: int) -> None:
    for r in range(rounds):
        t.round = r
        method.run_round(sorted(SIZES))


def _optimiser_state(optimizer: torch.optim.Optimizer) -> list[np.ndarray]:
    state = optimizer.state_dict()["state"]
    return [v.detach().cpu().numpy().copy() for i in sorted(state)
            for _, v in sorted(state[i].items()) if torch.is_tensor(v)]


def test_save_writes_the_server_block_and_the_global_client_block(archive: Path,
                                                                   tmp_path: Path) -> None:
    t = _trainer(archive, "scala", MIXED)
    method = build_method("scala", t)
    _run(t, method, rounds=1)
    method.save(tmp_path)
    server, client = (load_file(str(tmp_path / f"{n}.safetensors")) for n in ("server", "client"))
    want = to_arrays(t.server, "server")
    assert sorted(server) == sorted(want) and sorted(client) == sorted(t.global_client)
    assert all(np.array_equal(server[k], v) for k, v in want.items())
    assert all(np.array_equal(client[k], v) for k, v in t.global_client.items())


def test_checkpoint_and_restore_carry_server_block_momentum_and_global_block(
        archive: Path) -> None:
    """After a round with momentum, a fresh trainer restored from the checkpoint holds the
    same server block, the same momentum buffers and the same global client block."""
    t = _trainer(archive, "scala", MIXED)
    method = build_method("scala", t)
    _run(t, method, rounds=1)
    arrays, meta = method.checkpoint()
    fresh = _trainer(archive, "scala", MIXED)
    restored = build_method("scala", fresh)
    before = to_arrays(fresh.server, "server")
    restored.restore(arrays, meta)
    after = to_arrays(fresh.server, "server")
    want = to_arrays(t.server, "server")
    assert any(not np.array_equal(before[k], want[k]) for k in want)  # it really moved
    assert all(np.array_equal(after[k], v) for k, v in want.items())
    assert sorted(fresh.global_client) == sorted(t.global_client)
    assert all(np.array_equal(fresh.global_client[k], v) for k, v in t.global_client.items())
    kept = _optimiser_state(t.optimizer)
    got = _optimiser_state(fresh.optimizer)
    assert kept and len(got) == len(kept) and all(
        np.array_equal(a, b) for a, b in zip(got, kept, strict=True))


def test_restore_refuses_a_client_block_of_the_wrong_shape_in_one_line(
        archive: Path) -> None:
    t = _trainer(archive, "scala", MIXED)
    method = build_method("scala", t)
    arrays, meta = method.checkpoint()
    name = next(k for k in arrays if k.startswith("client/") and arrays[k].ndim == 4)
    arrays[name] = np.zeros((1, *arrays[name].shape[1:]), arrays[name].dtype)
    before = {k: v.copy() for k, v in t.global_client.items()}
    with pytest.raises(CheckpointError, match="checkpoint client block"):
        method.restore(arrays, meta)
    assert all(np.array_equal(t.global_client[k], v) for k, v in before.items())


def test_switch_cuts_moves_only_the_agents_whose_cut_changes(archive: Path) -> None:
    t = _trainer(archive, "splitfed-v1", MIXED)
    method = build_method("splitfed-v1", t)
    assert method.switches_cuts is True
    moved = method.switch_cuts({"a0": 1, "a1": 1, "a2": 3, "a3": 3})
    assert moved == ["a1", "a2"]
    assert {a: t.cut(a) for a in SIZES} == {"a0": 1, "a1": 1, "a2": 3, "a3": 3}


def test_a_round_returns_the_mean_of_its_iterations_losses(archive: Path) -> None:
    """run_round's loss (the metrics row's train_loss, the divergence guard's input) is the
    mean over the round's iterations of what the server update reported."""
    t = _trainer(archive, "scala", MIXED)
    method = build_method("scala", t)
    update, seen = method.server_update, []

    def spy(agents, acts, labels):  # noqa: ANN001, ANN202
        loss, grads = update(agents, acts, labels)
        seen.append(float(loss))  # a float, or a 0-dim tensor read later
        return loss, grads
    method.server_update = spy
    loss = method.run_round(sorted(SIZES))
    assert len(seen) == 2 and loss == pytest.approx(float(np.mean(seen)), rel=1e-12)


def test_the_base_classes_are_abstract() -> None:
    """A method without its round (or a split method without its server update) cannot be
    built: an incomplete method fails at once, not in the middle of a run."""
    from jetsplit.server.methods.base import SplitMethod

    class NoRound(Method):
        name = "scala"

    class NoUpdate(SplitMethod):
        name = "scala"

    for cls in (NoRound, NoUpdate):
        with pytest.raises(TypeError, match="abstract"):
            cls(None)  # type: ignore[arg-type]


def test_a_common_cut_method_refuses_per_device_cuts_in_one_line(archive: Path) -> None:
    """FedAvg trains the whole model at one cut: mixed cuts are refused when it is built,
    equal cuts (or none) are not."""
    from jetsplit.errors import ConfigError

    with pytest.raises(ConfigError, match="fedavg trains every device at one common cut"):
        build_method("fedavg", _trainer(archive, "fedavg", MIXED))
    assert build_method("fedavg", _trainer(archive, "fedavg", dict.fromkeys(SIZES, 3)))
