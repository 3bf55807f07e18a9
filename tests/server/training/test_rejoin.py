"""The rejoin rule (server/training/rejoin.py): an agent that missed an exchange by deadline
sits out the round's later steps until it answers two probes in a row, posted alongside
them (one more per further miss of the round); the
round-start probe keeps a suspect out of that round; at the next round's start every
outstanding probe is booked as one `status` exchange, so the bench clears who answered and
benches again who stayed silent. The engine's answers are set by hand: no clock, no wait."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from jetsplit.data import ArrayDataset
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.server.defences.sitting_out import PROBE, Bench
from jetsplit.server.engines.seam import (
    Command,
    Engine,
    InProcessEngine,
    Outcome,
    Posted,
    Reply,
)
from jetsplit.server.training.rejoin import Rejoin
from jetsplit.server.training.round_books import RoundBooks

pytestmark = pytest.mark.fast


class _Hand(Engine):
    """Posts are recorded; what each agent answered is whatever the test put in `said`
    (an agent absent from it is still silent)."""

    clocked = True

    def __init__(self) -> None:
        super().__init__("hand")
        self.posts: list[tuple[str, list[str], int]] = []
        self.said: dict[str, Reply | str] = {}

    def send_and_receive(self, commands: Any, *, round: int = 0, step: int = 0,
                         deadline_s: float = 60.0) -> Outcome:
        raise AssertionError("the rejoin rule never waits on an exchange")

    def post(self, command: Command, agents: list[str], *, round: int = 0, step: int = 0
             ) -> Posted:
        self.posts.append((command.kind, list(agents), round))
        return Posted(command.kind, list(agents), round, step, pending=list(agents))

    def collect(self, posted: Posted, *, final: bool = False) -> Outcome:
        done = {a: self.said[a] for a in posted.pending if a in self.said}
        if final:
            done.update({a: "deadline" for a in posted.pending if a not in done})
        posted.pending = [a for a in posted.pending if a not in done]
        return Outcome({a: r for a, r in done.items() if isinstance(r, Reply)},
                       {a: r for a, r in done.items() if isinstance(r, str)}, posted.kind)


def _reply(agent: str, elapsed_s: float | None = 0.5) -> Reply:
    return Reply(agent, PROBE, {}, {}, elapsed_s=elapsed_s)


def _setup(max_misses: int = 3) -> tuple[_Hand, Rejoin, Bench, RoundBooks]:
    engine, bench, books = _Hand(), Bench(max_misses), RoundBooks()
    rejoin = Rejoin(engine)
    books.listener = lambda out: (bench.note(out), rejoin.missed(out, round=bench.round))
    return engine, rejoin, bench, books


AGENTS = ["a0", "a1", "a2", "a3"]


def test_a_miss_sits_out_until_two_probes_in_a_row_are_answered() -> None:
    engine, rejoin, bench, books = _setup()
    books.note(Outcome({a: _reply(a) for a in AGENTS[:3]},
                       {"a3": "deadline (cut off after 4.0 s: the others had answered)"},
                       "forward"))
    assert engine.posts == [(PROBE, ["a3"], 0)]  # one probe, not a wait
    assert rejoin.playing(AGENTS) == AGENTS[:3]  # step 1: out, and not asked
    assert rejoin.playing(AGENTS) == AGENTS[:3]  # step 2: still silent, still out
    engine.said["a3"] = _reply("a3", 0.25)
    assert rejoin.playing(AGENTS) == AGENTS[:3]  # step 3: one answer of the two it owes
    assert engine.posts == [(PROBE, ["a3"], 0)] * 2  # the second probe went out at once
    assert rejoin.playing(AGENTS) == AGENTS  # step 4: two in a row, it plays again
    assert bench.misses == {"a3": 1}  # a mid-round answer is no step: misses stay
    bench.round = 1
    settled = rejoin.settle(books)  # next round's start: booked as one status exchange
    assert settled is not None and settled.kind == PROBE and settled.agents == ["a3"]
    assert books.probes == {"a3": "answered in 0.25 s"}
    assert bench.misses == {} and bench.to_probe(AGENTS) == []  # the answer clears it
    assert engine.posts == [(PROBE, ["a3"], 0)] * 2  # and nothing more was sent


def test_a_silent_agent_is_benched_at_the_next_round_start_without_a_wait() -> None:
    engine, rejoin, bench, books = _setup()
    books.note(Outcome({"a0": _reply("a0")}, {"a3": "deadline"}, "forward"))
    books.note(Outcome({"a0": _reply("a0")}, {}, "backward"))  # a3 was not asked
    assert rejoin.playing(AGENTS) == ["a0", "a1", "a2"]
    assert rejoin.sitting_out() == ["a3"]
    bench.round = 1
    rejoin.settle(books)
    # round 1: silent at its probe, so benched for the rest of round 1 and the next 1
    assert books.probes == {"a3": "no answer: deadline"} and books.missed == {"a3": "deadline"}
    assert bench.until == {"a3": 3} and bench.strikes == {"a3": 1}
    assert rejoin.sitting_out() == [] and rejoin.playing(AGENTS) == AGENTS  # bench's job now
    assert engine.posts == [(PROBE, ["a3"], 0)]


def test_the_round_start_probe_keeps_a_suspect_out_of_that_round() -> None:
    engine, rejoin, bench, books = _setup()
    rejoin.probe(["a3"], round=4)
    assert engine.posts == [(PROBE, ["a3"], 4)]
    engine.said["a3"] = _reply("a3", None)
    assert rejoin.playing(AGENTS) == AGENTS[:3]  # answered, but out for this round
    bench.round = 5
    rejoin.settle(books)
    assert books.probes == {"a3": "answered"} and rejoin.playing(AGENTS) == AGENTS
    # silent at its next round-start probe: benched for the rest of round 6 and round 7
    bench.suspect.add("a3")
    engine.said.clear()
    rejoin.probe(["a3"], round=5)
    books.probes.clear()
    bench.round = 6
    rejoin.settle(books)
    assert books.probes == {"a3": "no answer: deadline"} and bench.until == {"a3": 8}


def test_errors_offline_probes_and_bundles_send_no_probe() -> None:
    engine, rejoin, _, books = _setup()
    books.note(Outcome({}, {"a1": "error: boom", "a2": "offline"}, "forward"))
    books.note(Outcome({}, {"a3": "deadline"}, PROBE))
    books.note(Outcome({}, {"a3": "deadline"}, "bundle"))
    assert engine.posts == [] and rejoin.playing(AGENTS) == AGENTS
    # an error in answer to a probe is an answer: it is alive
    books.note(Outcome({}, {"a3": "deadline"}, "forward"))
    books.note(Outcome({}, {"a3": "deadline"}, "backward"))  # already out: one probe
    assert engine.posts == [(PROBE, ["a3"], 0)]
    engine.said["a3"] = "error: not ready"
    assert rejoin.playing(AGENTS) == AGENTS[:3]  # one answer; a second is owed
    assert rejoin.playing(AGENTS) == AGENTS


def test_everyone_out_may_play_anyway() -> None:
    _, rejoin, _, books = _setup()
    rejoin.probe(["a0", "a1"], round=0)
    assert rejoin.playing(["a0", "a1"]) == []
    rejoin.let_play(["a0", "a1"])
    assert rejoin.playing(["a0", "a1"]) == ["a0", "a1"]
    assert rejoin.settle(books) is not None  # its probe is still booked


def test_the_in_process_engine_answers_a_post_at_once() -> None:
    data = ArrayDataset(np.zeros((4, 1, 8, 8), np.float32), np.arange(4, dtype=np.int64),
                        "tiny", 4)
    engine = InProcessEngine({f"a{i}": AgentWorker(f"a{i}", data) for i in range(2)})
    assert not engine.clocked
    posted = engine.post(Command(PROBE), ["a1", "a0"], round=2)
    out = engine.collect(posted)
    assert out.agents == ["a0", "a1"] and out.kind == PROBE and out.missed == {}
    assert engine.collect(posted, final=True).agents == []  # each answer once


def test_the_proof_of_life_grows_with_the_misses_of_a_round() -> None:
    """The n-th miss of a round asks n + 1 probe answers in a row: a device that stalled
    twice and answers every probe plays again after two, then three of them."""
    engine, rejoin, bench, books = _setup()
    books.note(Outcome({"a0": _reply("a0")}, {"a3": "deadline"}, "forward"))
    engine.said["a3"] = _reply("a3")
    assert rejoin.playing(AGENTS) == AGENTS[:3]  # one miss: one answer of two
    assert rejoin.playing(AGENTS) == AGENTS  # the second brings it back
    del engine.said["a3"]
    books.note(Outcome({"a0": _reply("a0")}, {"a3": "deadline (cut off after 8.0 s)"},
                       "backward"))
    assert rejoin.playing(AGENTS) == AGENTS[:3]
    engine.said["a3"] = _reply("a3")
    assert rejoin.playing(AGENTS) == AGENTS[:3]  # one answer of the three it owes
    assert engine.posts == [(PROBE, ["a3"], 0)] * 4  # the next probe went out at once
    assert rejoin.playing(AGENTS) == AGENTS[:3]  # two of three
    assert rejoin.playing(AGENTS) == AGENTS  # the third answer: it plays again
    assert engine.posts == [(PROBE, ["a3"], 0)] * 5
    assert bench.misses == {"a3": 2} and bench.until == {}
    bench.round = 1
    rejoin.settle(books)
    assert books.probes == {"a3": "answered in 0.50 s"} and bench.until == {}
    assert bench.to_probe(AGENTS) == []  # answered: nothing owed next round


def test_a_device_answering_every_other_command_stays_out_and_is_benched() -> None:
    """After its first miss it answers the first of the two probes it owes and misses the
    second: out for the rest of the round after one cut-off wait, and benched at the next
    round's start (never brought back for a second miss)."""
    engine, rejoin, bench, books = _setup()
    books.note(Outcome({"a0": _reply("a0")}, {"a3": "deadline"}, "set_weights"))
    engine.said["a3"] = _reply("a3")  # 2nd command (a probe): answered
    assert rejoin.playing(AGENTS) == AGENTS[:3]
    del engine.said["a3"]  # 3rd (the next probe): silent
    for _ in range(4):  # the round's later steps: still out, nothing more sent
        assert rejoin.playing(AGENTS) == AGENTS[:3]
    assert len(engine.posts) == 2
    assert bench.misses == {"a3": 1} and bench.until == {}  # one miss, no more
    bench.round = 1
    rejoin.settle(books)
    assert books.probes == {"a3": "no answer: deadline"}
    assert bench.until == {"a3": 3} and bench.strikes == {"a3": 1}  # out of rounds 1 and 2
