"""The in-process engine's by-reference path against its encoding path: the same models bit
for bit and the same bytes booked, and no way for an agent to write into what the
coordinator holds (or for the coordinator to see an agent's later writes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from jetsplit.data import load_dataset_split, partition
from jetsplit.edge_agent.result import Result
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.models.weights import to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.engines.seam import Command, InProcessEngine
from jetsplit.server.methods import build_method
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, 2, tmp_path_factory.mktemp("b") / "bundle", seed=3, tar=True)
    assert report.tar_path is not None
    return report.tar_path


class Scribbler(AgentWorker):
    """An agent that writes into the weights it is sent before installing them."""

    def _do_set_weights(self, args: Any, round_: int, step: int, tensors: Any) -> Result:
        for array in tensors.values():
            array[...] = 0
        return super()._do_set_weights(args, round_, step, tensors)


def fleet(archive: Path, *, by_reference: bool, worker: type[AgentWorker] = AgentWorker,
          content: str = "client") -> InProcessEngine:
    train, _ = load_dataset_split("digits", 0.2, 0)
    shards = partition(train.y, 2, "iid", 0, train.num_classes)
    engine = InProcessEngine({f"a{i}": worker(f"a{i}", train.subset(s), seed=i)
                              for i, s in enumerate(shards)}, by_reference=by_reference)
    assert BundleShipper(engine, archive, lr=0.01, deadline_s=60,
                         content=content).ensure(engine.online()) == engine.online()
    return engine


def two_rounds(archive: Path, algorithm: str, by_reference: bool
               ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    engine = fleet(archive, by_reference=by_reference,
                   content="full" if algorithm == "fedavg" else "client")
    _, test = load_dataset_split("digits", 0.2, 0)
    trainer = Trainer(engine, archive, Settings(algorithm=algorithm, rounds=2, local_steps=2,
                                                batch=16, lr=0.05), test)
    method = build_method(algorithm, trainer)
    for r in range(2):
        trainer.round = r
        method.run_round(engine.online())
    return ({**trainer.global_client, **to_arrays(trainer.server, "server")},
            engine.counters.snapshot())


def without_bundle_replies(books: dict[str, Any]) -> dict[str, Any]:
    """The books but the bundle offers' replies, whose meta carries a measured time."""
    for sides in books.values():
        sides["up"].pop(Kind.BUNDLE.value)
    return books


@pytest.mark.parametrize("algorithm", ["splitfed-v1", "fedavg"])
def test_by_reference_trains_and_books_as_encoding_does(
        archive: Path, algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same weights bit for bit, the same bytes per agent, kind and direction (the
    clock stopped: a header's timestamp is part of its length)."""
    monkeypatch.setattr("jetsplit.wire.envelope.time.time", lambda: 1700000000.25)
    weights, books = two_rounds(archive, algorithm, by_reference=True)
    encoded_weights, encoded_books = two_rounds(archive, algorithm, by_reference=False)
    assert without_bundle_replies(books) == without_bundle_replies(encoded_books)
    assert books["a0"]["up"]  # something was booked
    assert set(weights) == set(encoded_weights)
    for name, value in weights.items():
        assert value.tobytes() == encoded_weights[name].tobytes(), name


def test_an_agent_cannot_write_into_the_coordinators_weights(archive: Path) -> None:
    engine = fleet(archive, by_reference=True, worker=Scribbler)
    weights = {k: v for k, v in to_arrays(engine.workers["a0"].client, "client").items()}
    kept = {k: v.copy() for k, v in weights.items()}
    out = engine.broadcast(Command(Kind.SET_WEIGHTS.value, {}, weights), ["a0", "a1"])
    assert set(out.missed) == {"a0", "a1"}
    assert all("read-only" in reason for reason in out.missed.values())
    for name, value in weights.items():
        assert np.array_equal(value, kept[name]) and value.flags.writeable


def test_what_the_coordinator_received_does_not_follow_the_agents_training(
        archive: Path) -> None:
    engine = fleet(archive, by_reference=True)
    pulled = engine.send_and_receive({"a0": Command(Kind.GET_WEIGHTS.value)})["a0"].tensors
    kept = {k: v.copy() for k, v in pulled.items()}
    client = engine.workers["a0"].client
    assert client is not None
    with torch.no_grad():
        for p in client.parameters():
            p.add_(1.0)  # the agent trains on: its blocks move in place
    assert all(np.array_equal(pulled[k], kept[k]) for k in kept)
    assert not any(v.flags.writeable for v in pulled.values())


def test_local_training_leaves_no_gradients_held(archive: Path) -> None:
    """An agent's whole-model training frees its last step's gradients when it ends."""
    engine = fleet(archive, by_reference=True, content="full")
    out = engine.send_and_receive({"a0": Command(Kind.TRAIN.value, {
        "target": "full", "batch": 8, "steps": 2, "lr": 0.01})})
    assert "a0" in out.replies
    worker = engine.workers["a0"]
    assert worker.client is not None and worker.server is not None
    assert all(p.grad is None for block in (worker.client, worker.server)
               for p in block.parameters())
