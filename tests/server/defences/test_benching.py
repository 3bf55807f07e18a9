"""An agent that keeps missing its deadline sits out (server/defences/sitting_out.py): after
`max_misses` misses in a row it is dropped from the rest of the round and from selection for
1, then 2, 4 … rounds, and comes back after. Pinned by hand, then in a 4-round SplitFed V1 run in
one process where one of three agents never answers a forward (that run is not in the fast
tier: a minute on a busy 2-core machine)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.server.defences.sitting_out import Bench
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.run.assembly import RunSpec, execute
from jetsplit.server.training.settings import Settings


def _outcome(answered: list[str], missed: dict[str, str]) -> Any:
    return SimpleNamespace(agents=answered, missed=missed, kind="forward")


@pytest.mark.fast
def test_misses_in_a_row_bench_an_agent_for_doubling_rounds() -> None:
    bench = Bench(max_misses=2)
    bench.note(_outcome(["a0"], {"a1": "deadline", "a2": "error: boom"}))
    assert bench.misses == {"a1": 1} and not bench.benched("a1")  # errors do not count
    bench.note(_outcome(["a0", "a1"], {}))  # one answer clears the run of misses
    assert bench.misses == {}
    bench.note(_outcome([], {"a1": "deadline"}))
    bench.note(_outcome([], {"a1": "deadline (its reply was refused: OversizedMessage)"}))
    assert bench.benched("a1") and bench.until == {"a1": 2} and bench.strikes == {"a1": 1}
    assert bench.playing(["a0", "a1", "a2"]) == ["a0", "a2"]
    bench.note(_outcome([], {"a1": "deadline"}))  # while benched: not counted again
    assert bench.misses == {} and bench.until == {"a1": 2}
    bench.round = 1
    assert bench.sitting_out() == ["a1"]
    bench.round = 2  # back: selectable again
    assert bench.playing(["a1"]) == ["a1"] and bench.sitting_out() == []
    for _ in range(2):
        bench.note(_outcome([], {"a1": "deadline"}))
    assert bench.until == {"a1": 5} and bench.strikes == {"a1": 2}  # rest of 2, then 3, 4
    never = Bench(max_misses=0)
    for _ in range(10):
        never.note(_outcome([], {"a1": "deadline"}))
    assert never.playing(["a1"]) == ["a1"] and never.until == {}


class _SilentOnForward(InProcessEngine):
    """The in-process engine with one agent that never answers a forward (it stays online
    and answers everything else, as a stalled device would)."""

    def __init__(self, workers: dict[str, AgentWorker], silent: str) -> None:
        super().__init__(workers)
        self.silent, self.asked = silent, Counter[int]()

    def _run_one(self, agent: str, command: Any, round: int, step: int) -> Any:
        if agent == self.silent and command.kind == "forward":
            self.asked[round] += 1
            return "deadline"
        return super()._run_one(agent, command, round, step)


def _run(tmp_path: Path, max_misses: int) -> tuple[_SilentOnForward, list[dict], dict]:
    spec = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
    bundle = tmp_path / "bundle.tar.gz"
    if not bundle.exists():
        report = write_bundle(spec, 3, tmp_path / "bundle", seed=3, tar=True, aux_ratio=None)
        assert report.tar_path == bundle
    train, test = load_dataset_split("digits", 0.2, 0)
    shards = np.array_split(np.random.default_rng(0).permutation(len(train))[:240], 3)
    workers = {f"a{i}": AgentWorker(f"a{i}", train.subset(s), seed=i)
               for i, s in enumerate(shards)}
    engine = _SilentOnForward(workers, "a2")
    settings = Settings(algorithm="splitfed-v1", rounds=4, local_steps=4, batch=24, lr=0.05,
                        max_misses=max_misses, threads=1)
    out = tmp_path / f"run-{max_misses}"
    summary = execute(engine, RunSpec(settings, bundle, test.subset(np.arange(60)), out))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return engine, rows, summary


def test_a_silent_agent_sits_out_and_is_asked_again_later(tmp_path: Path,
                                                           one_torch_thread: None) -> None:
    engine, rows, summary = _run(tmp_path, max_misses=2)
    # round 0: asked at steps 0 and 1, benched after the 2nd miss (rest of 0, and 1);
    # round 2: back, asked twice again, benched for the rest of 2 and rounds 3, 4
    assert dict(engine.asked) == {0: 2, 2: 2}
    assert [r["selected"] for r in rows] == [["a0", "a1", "a2"], ["a0", "a1"],
                                             ["a0", "a1", "a2"], ["a0", "a1"]]
    assert [r["benched"] for r in rows] == [["a2"], ["a2"], ["a2"], ["a2"]]
    assert summary["benched"] == {"a2": 2}
    assert all(r["train_loss"] is not None for r in rows)  # the others trained every round
    # without benching, every step of every round waits for it
    never, _, summary = _run(tmp_path, max_misses=0)
    assert dict(never.asked) == {0: 4, 1: 4, 2: 4, 3: 4} and summary["benched"] == {}
