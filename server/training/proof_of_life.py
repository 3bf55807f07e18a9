"""Proof of life before selection: the round-start `status` probe to agents that sat out or
missed their last exchange (server/defences/sitting_out.py decides who, and benches the
silent again when it sees the booked outcome). This blocking form serves engines that wait
on no clock (in one process); over MQTT the probe is posted without waiting
(server/training/rejoin.py).

The probe is booked like any exchange (`RoundBooks.note`: misses, the bench, the step
times), and each agent's answer goes into the round's `probes` for the report."""

from __future__ import annotations

from jetsplit.server.defences.sitting_out import PROBE
from jetsplit.server.engines.seam import Command, Engine
from jetsplit.server.training.round_books import RoundBooks


def probe(engine: Engine, books: RoundBooks, agents: list[str], *, round: int,
          wait_s: float) -> list[str]:
    """Send `agents` a `status` with `wait_s` to answer; who answered."""
    if not agents:
        return []
    with books.timed("probe"):
        out = books.note(engine.broadcast(Command(PROBE), agents, round=round,
                                          deadline_s=wait_s))
    for agent in agents:
        reply = out.replies.get(agent)
        if reply is None:
            books.probes[agent] = f"no answer: {out.missed.get(agent, 'deadline')}"
        elif reply.elapsed_s is None:
            books.probes[agent] = "answered"
        else:
            books.probes[agent] = f"answered in {reply.elapsed_s:.2f} s"
    return out.agents
