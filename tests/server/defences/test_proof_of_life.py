"""Proof of life before selection (server/defences/sitting_out.py, the trainer's `probe`): an
agent that sat out or missed its last exchange must answer a `status` probe at the start of
a round before it is selectable; a silent one sits out again without being sent a single
step. By hand on the bench, then in SplitFed V1 runs in one process where a2 answers nothing
(or nothing in round 0 only), every command and the deadline it was given recorded."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.server.defences.sitting_out import PROBE, Bench
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.run.assembly import RunSpec, execute
from jetsplit.server.training.settings import Settings


def _outcome(answered: list[str], missed: dict[str, str], kind: str = "forward") -> Any:
    return SimpleNamespace(agents=answered, missed=missed, kind=kind)


@pytest.mark.fast
def test_a_benched_agent_is_probed_and_a_silent_one_sits_out_again() -> None:
    bench = Bench(max_misses=2)
    for _ in range(2):
        bench.note(_outcome(["a0"], {"a1": "deadline"}))
    assert bench.until == {"a1": 2} and bench.to_probe(["a0", "a1"]) == []  # sitting out
    bench.round = 2  # its rounds are over: it may play, once it answers
    assert bench.playing(["a0", "a1"]) == ["a0", "a1"]
    assert bench.to_probe(["a0", "a1"]) == ["a1"]
    bench.note(_outcome([], {"a1": "deadline"}, PROBE))  # silent: out again, strikes double
    assert bench.until == {"a1": 5} and bench.strikes == {"a1": 2}
    assert bench.playing(["a0", "a1"]) == ["a0"] and bench.misses == {}
    bench.round = 5
    assert bench.to_probe(["a0", "a1"]) == ["a1"]
    bench.note(_outcome(["a1"], {}, PROBE))  # it answers: selectable, nothing to prove
    assert bench.to_probe(["a0", "a1"]) == [] and bench.playing(["a1"]) == ["a1"]
    assert bench.strikes == {"a1": 2}


@pytest.mark.fast
def test_one_missed_exchange_means_a_probe_and_an_error_is_an_answer() -> None:
    bench = Bench(max_misses=3)
    bench.note(_outcome(["a0"], {"a1": "deadline", "a2": "error: boom", "a3": "offline"}))
    assert bench.to_probe(["a0", "a1", "a2", "a3"]) == ["a1"]  # only silence is suspect
    assert bench.until == {}  # one miss of three: not benched
    bench.note(_outcome([], {"a1": "error: not ready"}, PROBE))
    assert bench.to_probe(["a1"]) == [] and bench.until == {}
    bench.note(_outcome([], {"a2": "deadline"}, PROBE))  # a probe to a non-suspect: nothing
    assert bench.until == {}
    bench.note(_outcome([], {"a1": "deadline"}))
    bench.note(_outcome(["a1"], {}, "backward"))  # any answer clears it
    assert bench.to_probe(["a1"]) == [] and bench.misses == {}
    never = Bench(max_misses=0)  # benching off: nobody is ever probed
    never.note(_outcome([], {"a1": "deadline"}))
    assert never.to_probe(["a1"]) == []


class _Silent(InProcessEngine):
    """The in-process engine with one agent that installs its bundle, then answers
    nothing in the rounds `silent_in` (it stays online, as a hung process would); every
    other command to it is recorded with the deadline it was given."""

    def __init__(self, workers: dict[str, AgentWorker], agent: str, silent_in: set[int]
                 ) -> None:
        super().__init__(workers)
        self.agent, self.silent_in = agent, silent_in
        self.sent: list[tuple[int, str, float]] = []
        self._deadline = 0.0

    def send_and_receive(self, commands: Any, *, round: int = 0, step: int = 0,
                         deadline_s: float = 60.0) -> Any:
        self._deadline = deadline_s
        return super().send_and_receive(commands, round=round, step=step,
                                        deadline_s=deadline_s)

    def _run_one(self, agent: str, command: Any, round: int, step: int) -> Any:
        if agent == self.agent and not command.kind.startswith("bundle"):  # set up, then hung
            self.sent.append((round, command.kind, self._deadline))
            if round in self.silent_in:
                return "deadline"
        return super()._run_one(agent, command, round, step)


def _run(tmp_path: Path, silent_in: set[int], name: str) -> tuple[_Silent, list[dict]]:
    spec = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
    bundle = tmp_path / "bundle.tar.gz"
    if not bundle.exists():
        write_bundle(spec, 3, tmp_path / "bundle", seed=3, tar=True, aux_ratio=None)
    train, test = load_dataset_split("digits", 0.2, 0)
    shards = np.array_split(np.random.default_rng(0).permutation(len(train))[:180], 3)
    workers = {f"a{i}": AgentWorker(f"a{i}", train.subset(s), seed=i)
               for i, s in enumerate(shards)}
    engine = _Silent(workers, "a2", silent_in)
    settings = Settings(algorithm="splitfed-v1", rounds=5, local_steps=3, batch=24, lr=0.05,
                        max_misses=2, probe_deadline_s=2.5, threads=1)
    out = tmp_path / name
    execute(engine, RunSpec(settings, bundle, test.subset(np.arange(40)), out))
    return engine, [json.loads(line) for line in (out / "metrics.jsonl").open()]


def test_silent_after_benching_costs_a_probe_not_a_step(tmp_path: Path,
                                                        one_torch_thread: None) -> None:
    engine, rows = _run(tmp_path, set(range(5)), "silent")
    # round 0: two forwards (60 s each: in one process nothing is timed), benched for
    # round 1; round 2: the probe alone, 2.5 s, unanswered → out for rounds 3 and 4 too
    assert engine.sent == [(0, "forward", 60.0), (0, "forward", 60.0), (2, PROBE, 2.5)]
    assert [r["selected"] for r in rows] == [["a0", "a1", "a2"]] + [["a0", "a1"]] * 4
    assert [r["probes"] for r in rows] == [{}, {}, {"a2": "no answer: deadline"}, {}, {}]
    assert rows[2]["missed"] == {"a2": "deadline"}  # booked like any exchange
    assert [r["benched"] for r in rows] == [["a2"]] * 5
    assert all(r["train_loss"] is not None for r in rows)


def test_an_agent_that_answers_its_probe_plays_again(tmp_path: Path,
                                                     one_torch_thread: None) -> None:
    engine, rows = _run(tmp_path, {0}, "recovers")
    kinds = [(r, k) for r, k, _ in engine.sent]
    assert kinds[:3] == [(0, "forward"), (0, "forward"), (2, PROBE)]
    assert (2, "forward") in kinds and (1, "forward") not in kinds
    assert rows[2]["probes"] == {"a2": "answered"} and "a2" in rows[2]["selected"]
    assert [r["benched"] for r in rows] == [["a2"], ["a2"], [], [], []]
    assert all(r["selected"] == ["a0", "a1", "a2"] for r in rows[2:])
    assert all(r["probes"] == {} for r in rows[3:])  # it answered since: no more probes
