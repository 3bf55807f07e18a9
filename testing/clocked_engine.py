"""The in-process engine as a clocked one, for tests of the waits: every agent really runs
(workers in this process), but each reply carries a step time set by hand, some agents are
silent on some exchange kinds, and no clock is read or slept on. Where an agent is silent,
the engine asks `Engine.wait_limits` (the one place an exchange's waits are decided, as the
MQTT engine does) how long it would have waited, and records it in `waits`: the test checks
those values, never wall time."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from jetsplit.server.engines.seam import Command, Engine, InProcessEngine, Outcome, Reply


@dataclass(frozen=True)
class Wait:
    """One silent agent's wait in one exchange: what the engine was asked to wait."""

    round: int
    step: int
    kind: str
    agent: str
    limit_s: float  # the wait it got (the cutoff's, or the deadline)
    deadline_s: float  # the exchange's deadline


class ClockedInProcess(InProcessEngine):
    """`step_s`: agent → the seconds each of its replies takes (default `default_s`);
    `silent`: agent → the exchange kinds it never answers (it stays online)."""

    clocked = True

    def __init__(self, workers: Mapping[str, Any], *, step_s: Mapping[str, float] | None = None,
                 default_s: float = 1.0, silent: Mapping[str, Collection[str]] | None = None
                 ) -> None:
        super().__init__(workers)
        self.step_s, self.default_s = dict(step_s or {}), default_s
        self.silent = {a: set(kinds) for a, kinds in (silent or {}).items()}
        self.waits: list[Wait] = []
        self.asked: list[tuple[int, str, float]] = []  # (round, kind, deadline) per exchange

    def send_and_receive(self, commands: Mapping[str, Command], *, round: int = 0,
                         step: int = 0, deadline_s: float = 60.0) -> Outcome:
        kind = next(iter(commands.values())).kind if commands else ""
        self.asked.append((round, kind, deadline_s))
        replies: dict[str, Reply] = {}
        missed: dict[str, str] = {}
        quiet = [a for a in sorted(commands) if commands[a].kind in self.silent.get(a, ())]
        for agent in sorted(set(commands) - set(quiet)):
            result = self._run_one(agent, commands[agent], round, step)
            if isinstance(result, Reply):
                result.elapsed_s = self.step_s.get(agent, self.default_s)
                replies[agent] = result
            else:
                missed[agent] = result
        answered = {a: r.elapsed_s for a, r in replies.items() if r.elapsed_s is not None}
        for agent, limit in self.wait_limits(commands, quiet, answered, deadline_s).items():
            self.waits.append(Wait(round, step, kind, agent, limit, deadline_s))
            missed[agent] = (f"deadline (cut off after {limit:.1f} s: the others had answered)"
                             if limit < deadline_s else "deadline")
        return self._finish(replies, missed, kind, round, step)

    def send_and_stream(self, commands: Mapping[str, Command], *, round: int = 0,
                        step: int = 0, deadline_s: float = 60.0) -> Iterator[Outcome]:
        """Waits for all, then yields each in id order (the engines' common fallback)."""
        return Engine.send_and_stream(self, commands, round=round, step=step,
                                      deadline_s=deadline_s)

    def waited(self, kind: str, agent: str) -> list[float]:
        """The waits `agent` got in exchanges of `kind`, in order."""
        return [w.limit_s for w in self.waits if w.kind == kind and w.agent == agent]
