"""Rejoin: a device that missed an exchange sits out the round's later steps until it answers
a cheap probe, so a silent device costs one (cut-off) wait, not one per step; and proof of
life never blocks a round.

Over an engine that waits on clocks (`Engine.clocked`: MQTT), when an agent misses an
exchange by deadline (silence, the in-exchange cutoff, a refused reply), the trainer posts it
a `status` probe (`PROBE`) without waiting (`Engine.post`, it rides alongside the next step)
and leaves it out of the round's later exchanges: steps, pushes, pulls, releases
(`Trainer.live`). At each later step boundary the probes' answers are read
(`Engine.collect`, non-blocking): an agent that answered (a reply, or an error: it is alive)
plays again from that step on; it still holds this round's weights.

The proof of life grows with the misses: after its n-th miss in a round an agent must answer
n + 1 probes in a row (each posted once the one before is answered) before it plays again.
One answer cannot tell a device that recovered from a flaky one that answers only every
other command (a marginal link, a thermal governor); two in a row can. So a device that
stalled once answers two probes and plays on, while the flaky one answers the first probe,
misses the second, stays out for the round after a single cut-off wait, and the next
round's start books that silence and benches it (server/defences/sitting_out.py: 1, 2, 4 …
rounds) instead of letting a probe bring it back for one more cut-off wait. An honest
device, slow or not, answers every probe: it is never held out longer than its probes
take, and never benched for it.

The round-start probe of agents that sat out or missed their last exchange
(server/defences/sitting_out.py) is posted the same way before selection: they are not
selectable that round, and are from the next one on once they answered.

At the next round's start every outstanding probe is read one last time (`settle`) and booked
as one `status` exchange (`RoundBooks.note`): the bench clears who answered and benches again
who stayed silent, and that round's `probes` say which. Nothing here reads a clock: an answer
counts when it is in at a step boundary.
"""

from __future__ import annotations

from jetsplit.server.defences.sitting_out import DEADLINE, PROBE
from jetsplit.server.engines.seam import Command, Engine, Outcome, Posted, Reply
from jetsplit.server.training.round_books import RoundBooks

# Probe answers in a row owed after a round's first miss (one more per further miss): two,
# the fewest that tell a recovered device from one answering every other command.
PROOF_AFTER_FIRST_MISS = 2


def alive(result: Reply | str) -> bool:
    """Whether a probe's result shows a live agent: any reply, or an error it sent."""
    return isinstance(result, Reply) or result.startswith("error")


class Rejoin:
    """Who sits out for silence this round, and the probes that bring them back."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.posts: list[Posted] = []  # outstanding probes, oldest first
        self.results: dict[str, Reply | str] = {}  # agent → its latest probe's result
        self.out: set[str] = set()  # missed an exchange this round: back once it answers
        self.waiting: set[str] = set()  # probed at round start: out for this round
        self.misses: dict[str, int] = {}  # deadline misses this round, per agent
        self.owed: dict[str, int] = {}  # probe answers in a row it still owes to play again
        self.round = 0  # the round probes are posted in (from the last outcome or probe)

    def missed(self, outcome: Outcome, *, round: int, step: int = 0) -> None:
        """An exchange's outcome: who missed it by deadline sits out and gets a probe."""
        if outcome.kind == PROBE or outcome.kind.startswith("bundle"):
            return  # a probe's silence is settled at round start; bundles are setup
        self.round = round
        new = sorted(a for a, why in outcome.missed.items()
                     if why.startswith(DEADLINE) and a not in self.out | self.waiting)
        for agent in new:  # its n-th miss this round: n + 1 answers in a row to play again
            self.misses[agent] = self.misses.get(agent, 0) + 1
            self.owed[agent] = self.misses[agent] + PROOF_AFTER_FIRST_MISS - 1
        if new:
            self._post(new, round, step)
            self.out.update(new)

    def probe(self, agents: list[str], *, round: int) -> None:
        """The round-start probe to `agents` (suspects): out of this round either way."""
        self.round = round
        fresh = sorted(set(agents) - self.waiting)
        if fresh:
            self._post(fresh, round, 0)
            self.waiting.update(fresh)

    def playing(self, agents: list[str]) -> list[str]:
        """`agents` without those sitting out; reads the probes' answers first, and an
        answer brings an agent that missed a step back."""
        if self.posts:
            self._read(final=False)
            self._answered()
        return [a for a in agents if a not in self.out and a not in self.waiting]

    def _answered(self) -> None:
        """Count the probes answered since the last look: an agent that owes no more
        answers plays again; one that still does gets the next probe at once."""
        again = []
        for agent in sorted(self.out):
            if agent not in self.results or not alive(self.results[agent]):
                continue
            self.owed[agent] = self.owed.get(agent, PROOF_AFTER_FIRST_MISS) - 1
            if self.owed[agent] <= 0:
                self.out.discard(agent)
            else:
                again.append(agent)
        if again:
            self._post(again, self.round, 0)

    def sitting_out(self) -> list[str]:
        """Who sits out now for silence (not selectable, not polled)."""
        return sorted(self.out | self.waiting)

    def let_play(self, agents: list[str]) -> None:
        """`agents` may play despite a pending probe (everyone else sits out: better slow
        than nothing)."""
        self.waiting.difference_update(agents)
        self.out.difference_update(agents)
        for agent in agents:
            self.owed.pop(agent, None)

    def settle(self, books: RoundBooks) -> Outcome | None:
        """At a round's start: read every outstanding probe a last time, book the results
        as one `status` exchange (silence benches again), and start the round afresh."""
        if self.posts:
            self._read(final=True)
        results, self.results, self.posts = self.results, {}, []
        self.out, self.waiting, self.misses, self.owed = set(), set(), {}, {}
        if not results:
            return None
        replies = {a: r for a, r in sorted(results.items()) if isinstance(r, Reply)}
        missed = {a: r for a, r in sorted(results.items()) if isinstance(r, str)}
        for agent, result in sorted(results.items()):
            books.probes[agent] = _said(result)
        return books.note(Outcome(replies, missed, PROBE))

    def _post(self, agents: list[str], round: int, step: int) -> None:
        for agent in agents:
            self.results.pop(agent, None)  # a fresh probe: an older answer says nothing
        self.posts.append(self.engine.post(Command(PROBE), agents, round=round, step=step))

    def _read(self, *, final: bool) -> None:
        """Collect what the outstanding probes brought; a settled probe is dropped."""
        for posted in self.posts:
            out = self.engine.collect(posted, final=final)
            self.results.update(out.missed)
            self.results.update(out.replies)
        self.posts = [p for p in self.posts if p.pending]


def _said(result: Reply | str) -> str:
    """How an agent answered its probe, for the round's `probes`."""
    if isinstance(result, str):
        return f"no answer: {result}" if not result.startswith("error") else result
    if result.elapsed_s is None:
        return "answered"
    return f"answered in {result.elapsed_s:.2f} s"
