"""Every method's exchanges get the in-exchange cutoff (server/engines/cutoff.py), decided in
one place (`Engine.wait_limits`): a device silent in FedAvg's local training, Ampere's
local training or uploads, or SHeRL-FL's edge loads and steps is waited for k = 2 × its
peers' time for its share of the work (or the floor), not the step's whole deadline. The
engine is the in-process one with hand-set step times (testing/clocked_engine.py): the test
checks the waits the engine was asked for and the round's books, never wall time. Whole
rounds of three methods (about a minute on a busy 2-core machine): the default tier, not
the fast one; the cutoff's arithmetic is pinned fast in tests/server/engines/test_cutoff.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clocked_engine import ClockedInProcess  # testing/, on the path in tests

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.edge import no_data
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.server.methods import build_method
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
DEADLINE_S = 60.0
# a0…a2 hold 90 samples, a3 twice as many: with batch 45, B_k = 9 and 18, so a3's work
# (samples to train on, rows to upload) is twice each peer's
SIZES = [90, 90, 90, 180]
STEP_S = {"a0": 1.0, "a1": 1.5, "a2": 0.5}  # each peer's reply time, by hand


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Agents and server share this process: one torch thread each (conftest)."""


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, 2, tmp_path_factory.mktemp("cutoffs") / "k", seed=3, tar=True)
    assert report.tar_path is not None
    return report.tar_path


def _clients(sizes: list[int]) -> dict[str, AgentWorker]:
    train, _ = load_dataset_split("digits", 0.2, 0)
    order = np.random.default_rng(0).permutation(len(train))
    starts = np.cumsum([0, *sizes])
    return {f"a{i}": AgentWorker(f"a{i}", train.subset(order[starts[i]:starts[i + 1]]),
                                 seed=i) for i in range(len(sizes))}


def _trainer(archive: Path, workers: dict[str, AgentWorker], silent: dict[str, set[str]],
             step_s: dict[str, float], **settings: Any) -> Trainer:
    _, test = load_dataset_split("digits", 0.2, 0)
    engine = ClockedInProcess(workers, step_s=step_s, silent=silent)
    base: dict[str, Any] = dict(rounds=2, local_steps=1, batch=45, lr=0.05, seed=0,
                                deadline_s=DEADLINE_S, deadline_floor_s=1.0)
    return Trainer(engine, archive, Settings(**{**base, **settings}), test.subset(np.arange(40)))


def _engine(t: Trainer) -> ClockedInProcess:
    assert isinstance(t.engine, ClockedInProcess)
    return t.engine


def test_fedavg_local_training_of_a_silent_device_is_cut_off(archive: Path) -> None:
    t = _trainer(archive, _clients(SIZES), {"a3": {"train"}}, STEP_S, algorithm="fedavg")
    method = build_method("fedavg", t)
    t.round = 0
    method.run_round(["a0", "a1", "a2", "a3"])
    # a3 trains 18 × 1 samples against each peer's 9: 2 × max(1.0, 1.5, 0.5) × 18/9
    assert _engine(t).waited("train", "a3") == [6.0]
    assert t.books.missed["a3"] == "deadline (cut off after 6.0 s: the others had answered)"
    assert t.books.missed_kind["a3"] == "train"


def test_a_device_given_less_work_still_waits_its_peers_time(archive: Path) -> None:
    """a0 (9 samples) silent among a3 (18) and two peers: its pace against a3 is 1/2, so
    at least 1: 2 × max(1.5, 1.0 × 1, 0.5) = 3.0."""
    t = _trainer(archive, _clients(SIZES), {"a0": {"train"}},
                 {"a1": 1.5, "a2": 0.5, "a3": 1.0}, algorithm="fedavg")
    build_method("fedavg", t).run_round(["a0", "a1", "a2", "a3"])
    assert _engine(t).waited("train", "a0") == [3.0]


def test_ampere_local_training_and_uploads_of_a_silent_device_are_cut_off(
        archive: Path, tmp_path: Path) -> None:
    t = _trainer(archive, _clients(SIZES), {"a3": {"train"}}, STEP_S, algorithm="ampere",
                 device_epochs=1, activation_dir=str(tmp_path / "acts"))
    method = build_method("ampere", t)
    t.round = 0
    method.run_round(["a0", "a1", "a2", "a3"])
    # an epoch each: 10 steps of 9 against a3's 10 of 18, so twice the work: 2 × 1.5 × 2
    assert _engine(t).waited("train", "a3") == [6.0]
    assert t.books.missed_kind["a3"] == "train"

    t2 = _trainer(archive, _clients(SIZES), {"a3": {"generate"}}, STEP_S, algorithm="ampere",
                  device_epochs=1, activation_dir=str(tmp_path / "acts2"))
    method = build_method("ampere", t2)
    for round_ in range(2):  # the device epoch, then the uploads
        t2.round = round_
        t2.books.reset()
        method.run_round(["a0", "a1", "a2", "a3"])
    # a3 owes 180 rows against each peer's 90: 2 × 1.5 × 2, not the whole 60 s
    assert _engine(t2).waited("generate", "a3") == [6.0]
    assert t2.books.missed["a3"].startswith("deadline (cut off after 6.0 s")


@pytest.mark.parametrize(("kind", "want"), [
    ("edge_load", 3.0),  # the same edge model to each: 2 × e0's 1.5 s
    ("edge_step", 6.0),  # e1 serves 16 + 16 samples against e0's 8 + 8: 2 × 1.5 × 2
])
def test_sherl_edge_exchanges_of_a_silent_edge_are_cut_off(archive: Path, kind: str,
                                                          want: float) -> None:
    workers = _clients([40, 40, 80, 80])
    workers.update({e: AgentWorker(e, no_data(), role="edge", seed=0) for e in ("e0", "e1")})
    t = _trainer(archive, workers, {"e1": {kind}}, {"e0": 1.5}, algorithm="sherl", batch=48,
                 edges={"e0": ["a0", "a1"], "e1": ["a2", "a3"]})
    method = build_method("sherl", t)
    t.round = 0
    method.run_round(["a0", "a1", "a2", "a3"])
    assert _engine(t).waited(kind, "e1") == [want]
    assert t.books.missed["e1"] == (f"deadline (cut off after {want:.1f} s: the others had "
                                    "answered)")
    assert t.books.missed_kind["e1"] == kind


@pytest.mark.parametrize(("silent_from", "want"), [
    (1, 3.0),  # round 0's forward of 0.75 s on record: its own floor, 4 × 0.75
    (0, 10.0),  # silent from the start, nothing on record: the fleet floor
])
def test_a_device_that_goes_silent_is_cut_off_at_its_own_record(archive: Path, silent_from: int,
                                                                want: float) -> None:
    """The trainer hands the cutoff each device's own floor (server/defences/step_deadlines.py
    `floor_of`): a3 answers its SCALA forwards in 0.75 s until it goes silent; its peers'
    2 × 0.5 s is under either floor."""
    everyone = ["a0", "a1", "a2", "a3"]
    t = _trainer(archive, _clients([90, 90, 90, 90]), {},
                 {"a0": 0.25, "a1": 0.5, "a2": 0.25, "a3": 0.75}, algorithm="scala",
                 local_steps=1, deadline_floor_s=10.0)
    method = build_method("scala", t)
    for round_ in range(silent_from + 1):
        if round_ == silent_from:
            assert _engine(t).waits == []
            _engine(t).silent = {"a3": {"forward"}}
        t.round = round_
        t.books.reset()
        method.run_round(everyone)
    assert _engine(t).waited("forward", "a3") == [want]
    assert t.books.missed_kind["a3"] == "forward"
