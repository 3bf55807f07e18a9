"""The agent worker behind the in-process engine: bundles, split steps, local training,
weights, activation generation, and every failure turned into a recorded, reasoned miss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from jetsplit.bundle import load_bundle
from jetsplit.data import load_dataset_split, partition
from jetsplit.edge_agent.worker import AgentWorker, BatchSampler
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec, build_model
from jetsplit.models.weights import from_arrays
from jetsplit.protocol import Kind
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.engines.seam import Command, InProcessEngine
from jetsplit.server.methods import build_method
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
SPLIT = 2


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, SPLIT, tmp_path_factory.mktemp("b") / "bundle", seed=3, tar=True)
    assert report.tar_path is not None
    return report.tar_path


def make_engine(agents: int = 2, seed: int = 0) -> InProcessEngine:
    train, _ = load_dataset_split("digits", 0.2, 0)
    shards = partition(train.y, agents, "iid", 0, train.num_classes)
    workers = {f"a{i}": AgentWorker(f"a{i}", train.subset(s), seed=seed + i)
               for i, s in enumerate(shards)}
    return InProcessEngine(workers)


def installed(archive: Path, agents: int = 2, content: str = "client") -> InProcessEngine:
    engine = make_engine(agents)
    ready = BundleShipper(engine, archive, lr=0.01, deadline_s=60,
                          content=content).ensure(engine.online())
    assert ready == engine.online()
    return engine


def client_state(engine: InProcessEngine, agent: str) -> dict[str, torch.Tensor]:
    reply = engine.send_and_receive({agent: Command(Kind.GET_WEIGHTS.value)})[agent]
    return from_arrays(reply.tensors, "client")


def one_round(engine: InProcessEngine, archive: Path, algorithm: str, batch: int
              ) -> tuple[Trainer, float | None]:
    _, test = load_dataset_split("digits", 0.2, 0)
    trainer = Trainer(engine, archive, Settings(algorithm=algorithm, rounds=1, local_steps=1,
                                                batch=batch, lr=0.01), test)
    loss = build_method(algorithm, trainer).run_round(engine.online())
    return trainer, loss


def test_splitfed_v1_with_one_client_and_t1_is_one_centralised_sgd_step(archive: Path) -> None:
    """One agent, one iteration: client and server blocks move exactly as the whole model
    does under one SGD step on the same batch."""
    engine = installed(archive, agents=1)
    bundle = load_bundle(archive)
    client0, server0 = bundle.client_module(), bundle.server_module()
    reference = build_model(SPEC, seed=0)
    reference.load_state_dict({**client0.state_dict(), **server0.state_dict()})
    trainer, loss = one_round(engine, archive, "splitfed-v1", batch=16)

    worker = engine.workers["a0"]
    idx = BatchSampler(len(worker.data), worker.seed).next(16)
    x, y = torch.from_numpy(worker.data.x[idx]), torch.from_numpy(worker.data.y[idx])
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    ref_loss = torch.nn.functional.cross_entropy(reference(x), y)
    ref_loss.backward()
    ref_opt.step()
    assert loss == pytest.approx(float(ref_loss.detach()), abs=1e-6)
    expected = reference.state_dict()
    got = {**from_arrays(trainer.global_client, "client"), **trainer.server.state_dict()}
    assert set(got) == set(expected)
    worst = max(float((got[k].double() - expected[k].double()).abs().max()) for k in expected)
    assert worst < 1e-6
    moved = max(float((client0.state_dict()[k] - got[k]).abs().max())
                for k in client0.state_dict() if got[k].is_floating_point())
    assert moved > 1e-4  # the step did change the client block


def test_byte_counters_follow_each_kind(archive: Path) -> None:
    engine = installed(archive)
    one_round(engine, archive, "psl", batch=16)
    snap = engine.counters.snapshot()
    client = sum((archive.parent / "bundle" / name).stat().st_size
                 for name in ("client.safetensors", "client.onnx"))
    for agent in ("a0", "a1"):
        # role-true: the client block's files (and two small offers), never the server block
        down = snap[agent]["down"]["bundle"] + snap[agent]["down"]["bundle_part"]
        assert client < down < client + 16384
        assert snap[agent]["up"]["forward"] > 8 * 16 * 4 * 4  # 8 samples of 16×4×4 fp32
        assert snap[agent]["down"]["backward"] > 8 * 16 * 4 * 4
    assert engine.counters.total("up") == sum(
        sum(v["up"].values()) for v in snap.values())


def test_failures_become_misses_with_reasons(archive: Path) -> None:
    engine = make_engine()
    out = engine.send_and_receive({"a0": Command(Kind.FORWARD.value, {"batch": 4})})
    assert out.replies == {} and "no bundle installed" in out.missed["a0"]
    out = engine.send_and_receive({"a0": Command("explode")})
    assert "unknown command 'explode'" in out.missed["a0"]
    out = engine.send_and_receive({"a1": Command(Kind.FORWARD.value, {"batch": 0})})
    assert "batch" in out.missed["a1"]
    out = engine.send_and_receive({"a1": Command(Kind.BUNDLE.value, {"sha256": "0" * 64},
                                                 {"manifest": np.zeros(10, np.uint8)})})
    assert "sha256" in out.missed["a1"]
    assert [m.reason.startswith("error") for m in engine.registry.missed] == [True] * 4
    engine.registry.set_state("a0", "offline")
    out = engine.send_and_receive({"a0": Command(Kind.STATUS.value)})
    assert out.missed == {"a0": "offline"}


def test_backward_needs_its_forward_and_the_right_shape(archive: Path) -> None:
    engine = installed(archive, agents=1)
    grad = np.zeros((4, 16, 4, 4), np.float32)
    out = engine.send_and_receive({"a0": Command(Kind.BACKWARD.value, {}, {"grad": grad})},
                                  step=5)
    assert "no such forward" in out.missed["a0"]
    engine.send_and_receive({"a0": Command(Kind.FORWARD.value, {"batch": 4})}, step=6)
    out = engine.send_and_receive({"a0": Command(Kind.BACKWARD.value, {},
                                                 {"grad": grad[:, :3]})}, step=6)
    assert "shape" in out.missed["a0"]


def test_weights_round_trip_and_reject_wrong_shapes(archive: Path) -> None:
    engine = installed(archive)
    state = engine.send_and_receive({"a0": Command(Kind.GET_WEIGHTS.value)})["a0"].tensors
    changed = {k: (v + 1 if v.dtype == np.float32 else v) for k, v in state.items()}
    assert engine.send_and_receive(
        {"a1": Command(Kind.SET_WEIGHTS.value, {}, changed)}).replies
    back = client_state(engine, "a1")
    for key, value in changed.items():
        assert np.array_equal(back[key.split("/", 1)[1]].numpy(), value)
    name = next(k for k, v in state.items() if v.ndim == 4)
    bad = {**state, name: state[name][:1]}
    out = engine.send_and_receive({"a1": Command(Kind.SET_WEIGHTS.value, {}, bad)})
    assert "the model needs" in out.missed["a1"]
    out = engine.send_and_receive({"a1": Command(Kind.SET_WEIGHTS.value, {},
                                                 {"nope/x": state[name]})})
    assert "client/" in out.missed["a1"]


def test_an_upload_that_releases_hands_over_the_blocks_own_memory(archive: Path) -> None:
    """get_weights with `release`: the same values as a plain upload, in the block's own
    memory (no copy), and the block dropped as `release` drops it; a later set_weights
    builds it again from the weights pushed."""
    engine = installed(archive)
    worker = engine.workers["a0"]
    kept = engine.send_and_receive({"a0": Command(Kind.GET_WEIGHTS.value)})["a0"].tensors
    assert worker.client is not None
    held = {f"client/{k}": t for k, t in worker.client.state_dict().items()}
    out = engine.send_and_receive({"a0": Command(Kind.GET_WEIGHTS.value,
                                                 {"blocks": ["client"], "release": True})})
    handed = out["a0"].tensors
    assert sorted(handed) == sorted(kept) == sorted(held)
    for name, value in handed.items():
        assert np.array_equal(value, kept[name])
        assert np.shares_memory(value, held[name].numpy())  # the block's, not a copy
        assert not np.shares_memory(kept[name], held[name].numpy())  # a plain one copies
    assert worker._modules == {}  # dropped, as release drops it
    changed = {k: (v + 1 if v.dtype == np.float32 else v) for k, v in kept.items()}
    assert engine.send_and_receive({"a0": Command(Kind.SET_WEIGHTS.value, {}, changed)}).replies
    back = client_state(engine, "a0")
    for key, value in changed.items():
        assert np.array_equal(back[key.split("/", 1)[1]].numpy(), value)


def test_generation_runs_onnx_and_matches_torch(archive: Path) -> None:
    engine = installed(archive, agents=1, content="aux")
    out = engine.send_and_receive({"a0": Command(Kind.GENERATE.value, {"batch": 64})})
    reply = out["a0"]
    assert reply.meta["backend"] == "CPUExecutionProvider"
    worker = engine.workers["a0"]
    client = load_bundle(archive).client_module().eval()
    with torch.no_grad():
        expected = client(torch.from_numpy(worker.data.x)).numpy()
    assert reply.tensors["activations"].shape == expected.shape
    assert float(np.abs(reply.tensors["activations"] - expected).max()) < 1e-4
    assert np.array_equal(reply.tensors["labels"], worker.data.y)
    # After training, the exported block is stale: refuse unless torch is allowed.
    engine.send_and_receive({"a0": Command(Kind.TRAIN.value, {"steps": 1, "batch": 8})})
    out = engine.send_and_receive({"a0": Command(Kind.GENERATE.value, {})})
    assert "no longer matches" in out.missed["a0"]
    out = engine.send_and_receive({"a0": Command(Kind.GENERATE.value, {"allow_torch": True})})
    assert out["a0"].meta["backend"] == "torch"


def test_local_training_with_aux_head_learns(archive: Path) -> None:
    engine = installed(archive, agents=1, content="aux")
    before = engine.send_and_receive({"a0": Command(Kind.EVAL.value)})["a0"].meta
    for _ in range(4):
        engine.send_and_receive({"a0": Command(Kind.TRAIN.value,
                                               {"steps": 40, "batch": 32, "lr": 0.05})})
    after = engine.send_and_receive({"a0": Command(Kind.EVAL.value)})["a0"].meta
    assert after["total"] == len(engine.workers["a0"].data)
    assert after["loss"] < before["loss"] - 0.3
    assert after["accuracy"] > max(0.3, before["accuracy"])


def test_batches_are_reproducible_per_seed() -> None:
    a, b, c = BatchSampler(50, 1), BatchSampler(50, 1), BatchSampler(50, 2)
    first = [a.next(16) for _ in range(7)]
    assert all(np.array_equal(x, y) for x, y in zip(first, [b.next(16) for _ in range(7)],
                                                      strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(first, [c.next(16) for _ in range(7)],
                                                          strict=True))
    epoch = np.concatenate(first[:3])
    assert len(set(epoch.tolist())) == 48  # no repeats inside an epoch


def test_a_restarted_sampler_draws_what_an_uninterrupted_one_draws() -> None:
    # Resuming from a checkpoint (or an agent restart) must not change the batches.
    steady = BatchSampler(50, 3)
    for round_ in range(3):
        for _ in range(4):
            steady.next(16, round_)
    fresh = BatchSampler(50, 3)
    assert all(np.array_equal(steady.next(16, 3), fresh.next(16, 3)) for _ in range(5))
    assert not np.array_equal(BatchSampler(50, 3).next(16, 0), BatchSampler(50, 3).next(16, 1))


def test_registry_selects_only_eligible_agents() -> None:
    engine = make_engine(3)
    registry = engine.registry
    assert registry.eligible(zoo_version=1) == ["a0", "a1", "a2"]
    registry.register("a1", {**registry.registration("a1"), "zoo_version": 999})
    registry.register("a3", {**registry.registration("a0"), "agent": "a3", "role": "edge"})
    registry.set_state("a2", "offline")
    assert registry.eligible(zoo_version=1) == ["a0"]
    assert registry.eligible(role="edge", zoo_version=1) == ["a3"]
    registry.note_bundle("a0", "f" * 64)
    assert registry.registration("a0")["bundle"] == "f" * 64
    registry.register("a0", {**registry.registration("a0"), "bundle": None})  # a restart
    assert registry.registration("a0")["bundle"] is None
    snap = {r["agent"]: r for r in registry.snapshot()}
    assert snap["a2"]["state"] == "offline" and snap["a2"]["offline_events"] == 1


class _Liar(AgentWorker):
    """An agent whose forward replies are malformed (wrong shape, NaN, bad labels)."""

    def __init__(self, *args: object, mode: str, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.mode = mode

    def _do_forward(self, args, round_, step, tensors):  # noqa: ANN001, ANN202
        result = super()._do_forward(args, round_, step, tensors)
        acts, labels = result.tensors["activations"], result.tensors["labels"]
        if self.mode == "shape":
            result.tensors["activations"] = acts[:, :1]
        elif self.mode == "nan":
            acts[0].flat[0] = np.nan
        else:
            result.tensors["labels"] = labels + 100
        return result


@pytest.mark.parametrize(("mode", "reason"), [("shape", "expected float32"),
                                              ("nan", "NaN"), ("labels", "out of range")])
def test_malformed_replies_are_dropped_and_training_goes_on(archive: Path, mode: str,
                                                            reason: str) -> None:
    train, test = load_dataset_split("digits", 0.2, 0)
    workers = {"a0": AgentWorker("a0", train.subset(range(0, 200))),
               "a1": _Liar("a1", train.subset(range(200, 400)), mode=mode)}
    engine = InProcessEngine(workers)
    trainer = Trainer(engine, archive, Settings(algorithm="psl", rounds=1, local_steps=2,
                                                batch=32), test)
    loss = build_method("psl", trainer).run_round(["a0", "a1"])
    assert loss is not None and np.isfinite(loss)
    missed = trainer.books.missed
    assert missed["a1"].startswith("error: bad reply") and reason in missed["a1"]
    assert trainer.books.bwd_samples["a0"] == 32 and trainer.books.bwd_samples.get("a1", 0) == 0
