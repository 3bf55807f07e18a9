"""The step deadlines' windows travel in the checkpoint (server/defences/step_deadlines.py):
a coordinator resumed from its checkpoint waits what the run it continues would have, not
the configured `deadline_s` again; a damaged window is refused in one line. The engine is
the in-process one with hand-set step times (testing/clocked_engine.py): the test checks the
deadlines the engine was asked to wait, never wall time."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from clocked_engine import ClockedInProcess  # testing/, on the path in tests

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.server.defences.step_deadlines import MAX_SAVED_SAMPLES, StepDeadlines
from jetsplit.server.run.assembly import RunSpec, checkpointed_bundle, execute
from jetsplit.server.training.checkpoints import CheckpointError
from jetsplit.server.training.settings import Settings

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Agents and server share this process: one torch thread each (conftest)."""


@pytest.mark.fast
def test_the_windows_round_trip_and_keep_their_last_window() -> None:
    saved = StepDeadlines(60.0, k=4.0, window=3, floor_s=1.0)
    saved.samples = {}
    for t in (0.5, 0.25, 2.0):
        saved.observe(_exchange("forward", t))
    saved.observe(_exchange("backward", 0.75))
    snapshot = json.loads(json.dumps(saved.snapshot()))
    assert snapshot == {"backward": [0.75], "forward": [0.5, 0.25, 2.0]}
    fresh = StepDeadlines(60.0, k=4.0, window=2, floor_s=1.0)  # a resume may shrink it
    assert fresh.deadline("forward") == 60.0
    fresh.restore(snapshot)
    assert list(fresh.samples["forward"]) == [0.25, 2.0]  # the last two
    # read back, not yet timed here: the whole deadline, until one exchange of the kind
    assert fresh.deadline("forward") == 60.0 and fresh.deadline("backward") == 60.0
    fresh.observe(_exchange("forward", 0.5))  # window 2.0, 0.5
    assert fresh.deadline("forward") == 8.0 and fresh.deadline("backward") == 60.0
    fresh.observe(_exchange("backward", 0.25))  # window 0.75, 0.25
    assert fresh.deadline("backward") == 3.0
    fresh.restore(None)  # a checkpoint from before the windows were kept: nothing changes
    assert fresh.deadline("forward") == 8.0


@pytest.mark.fast
@pytest.mark.parametrize("bad", [
    [0.5], {"forward": 0.5}, {"forward": [0.5, "1"]}, {"forward": [float("nan")]},
    {"forward": [float("inf")]}, {"forward": [-0.5]}, {"forward": [True]}, {"": [0.5]},
    {"k" * 65: [0.5]}, {"forward": [0.5] * (MAX_SAVED_SAMPLES + 1)},
    {f"kind{i}": [0.5] for i in range(65)},
])
def test_a_damaged_window_is_refused(bad: Any) -> None:
    deadlines = StepDeadlines(60.0)
    with pytest.raises((TypeError, ValueError)):
        deadlines.restore(bad)
    assert deadlines.samples == {}


def _exchange(kind: str, elapsed: float) -> Any:
    return SimpleNamespace(kind=kind, replies={"a0": SimpleNamespace(elapsed_s=elapsed)})


def _fleet(step_s: float) -> ClockedInProcess:
    train, _ = load_dataset_split("digits", 0.2, 0)
    shards = np.array_split(np.random.default_rng(0).permutation(len(train))[:150], 3)
    workers = {f"a{i}": AgentWorker(f"a{i}", train.subset(s), seed=i)
               for i, s in enumerate(shards)}
    return ClockedInProcess(workers, default_s=step_s)


def _steps(engine: ClockedInProcess) -> list[tuple[int, str, float]]:
    """The (round, kind, deadline) of each exchange the engine was asked, bundles aside
    (they keep their own deadline)."""
    return [a for a in engine.asked if not a[1].startswith("bundle")]


def _settings(rounds: int) -> Settings:
    return Settings(algorithm="splitfed-v1", rounds=rounds, local_steps=1, batch=24, lr=0.05,
                    threads=1, deadline_s=60.0, deadline_k=4.0, deadline_floor_s=0.5)


def test_a_resumed_run_starts_from_the_saved_windows(tmp_path: Path) -> None:
    report = write_bundle(SPEC, 3, tmp_path / "bundle", seed=3, tar=True, aux_ratio=None)
    assert report.tar_path is not None
    _, test = load_dataset_split("digits", 0.2, 0)
    held, out = test.subset(np.arange(40)), tmp_path / "run"
    first = _fleet(0.75)  # every reply 0.75 s: each kind's deadline becomes 4 × 0.75 = 3 s
    execute(first, RunSpec(_settings(2), report.tar_path, held, out))
    asked = _steps(first)
    assert asked[0] == (0, "forward", 60.0)  # a fresh run: nothing timed yet, the whole deadline
    # round 1: every kind timed in round 0 gets 3 s; the first push is its kind's first
    assert sorted({(k, d) for r, k, d in asked if r == 1}) == [
        ("backward", 3.0), ("forward", 3.0), ("get_weights", 3.0), ("release", 3.0),
        ("set_weights", 60.0)]
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert set(state["step_deadlines"]) >= {"forward", "backward", "set_weights"}
    assert all(set(v) == {0.75} for v in state["step_deadlines"].values())

    resumed = _fleet(0.25)  # faster now: only the saved windows can give 3 s in round 3
    execute(resumed, RunSpec(_settings(4), checkpointed_bundle(out), held, out, resume=True))
    asked = _steps(resumed)
    # the first exchange of each kind waits the whole deadline, as a fresh run's (agents
    # restarted with the coordinator start cold); after it, the saved window counts:
    # 4 × the 95th percentile of 0.75, 0.75, 0.25 (without it: 4 × 0.25 = 1 s)
    assert asked[0] == (2, "set_weights", 60.0)
    assert sorted({(k, d) for r, k, d in asked if r == 2}) == [
        ("backward", 60.0), ("forward", 60.0), ("get_weights", 60.0), ("release", 60.0),
        ("set_weights", 60.0)]
    assert sorted({(k, d) for r, k, d in asked if r == 3}) == [
        ("backward", 3.0), ("forward", 3.0), ("get_weights", 3.0), ("release", 3.0),
        ("set_weights", 3.0)]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["deadlines_s"]["forward"] for r in rows] == [60.0, 3.0, 60.0, 3.0]

    path = out / "checkpoint" / "state.json"
    state = json.loads(path.read_text())
    state["step_deadlines"] = {"forward": [0.75, -1.0]}  # a damaged window: one line
    path.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"^checkpoint state is damaged: step deadline "
                                              r"window 'forward': a step time is not"):
        execute(_fleet(2.0), RunSpec(_settings(4), checkpointed_bundle(out), held, out,
                                     resume=True))
