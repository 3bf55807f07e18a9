"""Agents that keep missing their deadline sit out, so one silent device cannot stall a fleet.

A device that stays online but never answers costs every step it is asked in the full step
deadline (60 s by default), and the fleet crawls with it (measured: docs/results.md). After
`max_misses` deadline misses in a row, such an agent is benched: dropped from the rest of
the round's exchanges and from selection for the next 1, then 2, 4, … rounds (doubling
with each benching, at most 32). Errors and offline agents are not counted here: an error
comes back at once, and an offline agent is already dropped from each step at once.

Proof of life: an agent that sat out, or missed (by deadline) its last exchange, is a
suspect. At the start of a round, before selection, the trainer sends each suspect it could
select a cheap `status` probe (`PROBE`); an answer of any kind clears it (so does any other
answer), silence benches it again for the next 1, 2, 4 … rounds (its strikes go on
doubling), so a device that has not answered anything since it was benched never costs a
round a step deadline. In one process the probe is an exchange with `probe_deadline_s`
(server/training/proof_of_life.py); over MQTT it is posted without waiting, the suspect is
out of that round, and the probe's outcome reaches `note` at the next round's start, as do
the probes sent to agents that missed a step (server/training/rejoin.py).
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger("jetsplit.coordinator")

# How an engine's reason for a missed step begins when the agent did not answer in time
# (silence, or a reply the coordinator refused, e.g. an oversized one).
DEADLINE = "deadline"
MAX_BENCH_ROUNDS = 32
PROBE = "status"  # the command a suspect must answer before it is selectable again


class _Outcome(Protocol):
    missed: dict[str, str]
    kind: str

    @property
    def agents(self) -> list[str]: ...


class Bench:
    """Consecutive deadline misses per agent, and who sits out until which round."""

    def __init__(self, max_misses: int) -> None:
        self.max_misses = max_misses  # 0: never bench anyone
        self.misses: dict[str, int] = {}  # deadline misses in a row
        self.strikes: dict[str, int] = {}  # times benched so far
        self.until: dict[str, int] = {}  # agent → first round it may be selected again
        self.suspect: set[str] = set()  # sat out or missed its last exchange: probe first
        self.round = 0

    def note(self, outcome: _Outcome) -> None:
        """One exchange's outcome: an answer clears the agent's misses and suspicion; a
        missed deadline makes it a suspect and adds one miss, and the `max_misses`-th in a
        row benches it. A probe (`PROBE`) left unanswered benches it again at once."""
        for agent in outcome.agents:
            self.misses.pop(agent, None)
            self.suspect.discard(agent)
        if self.max_misses <= 0:
            return
        for agent, reason in outcome.missed.items():
            if not reason.startswith(DEADLINE):
                if outcome.kind == PROBE and reason.startswith("error"):
                    self.suspect.discard(agent)  # an error is an answer: it is alive
                continue
            if outcome.kind == PROBE:
                if agent in self.suspect and not self.benched(agent):
                    self._bench(agent, f"did not answer the round-start {PROBE} probe")
                continue
            self.suspect.add(agent)
            if self.benched(agent):
                continue
            self.misses[agent] = self.misses.get(agent, 0) + 1
            if self.misses[agent] >= self.max_misses:
                self.misses.pop(agent)
                self._bench(agent, f"missed {self.max_misses} deadlines in a row (last: "
                                   f"{outcome.kind or 'a step'})")

    def _bench(self, agent: str, why: str) -> None:
        """Sit `agent` out for the rest of this round and the next 1, 2, 4 … rounds."""
        strikes = self.strikes.get(agent, 0)
        rounds = min(MAX_BENCH_ROUNDS, 2 ** strikes)
        self.strikes[agent] = strikes + 1
        self.until[agent] = self.round + 1 + rounds
        self.suspect.add(agent)
        log.warning("agent %s %s: it sits out round %d to %d", agent, why, self.round + 1,
                    self.round + rounds + 1)

    def to_probe(self, agents: list[str]) -> list[str]:
        """The agents of `agents` that may play this round but must answer a probe first."""
        return sorted(a for a in agents if a in self.suspect and not self.benched(a))

    def benched(self, agent: str) -> bool:
        until = self.until.get(agent)
        return until is not None and self.round < until

    def playing(self, agents: list[str]) -> list[str]:
        """`agents` without those sitting out this round."""
        return [a for a in agents if not self.benched(a)]

    def sitting_out(self) -> list[str]:
        return sorted(a for a in self.until if self.benched(a))
