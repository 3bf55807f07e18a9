"""The in-exchange cutoff: once some devices of an exchange have answered, the rest are
waited for only a few times as long, so a silent device costs seconds even on the very first
step, when no step time is known yet (server/defences/step_deadlines.py needs history).

For an agent still open, the limit (seconds from the exchange's start) is

    min(deadline, max(floor, k × max over answered b of elapsed_b × pace(agent, b)))

with floor the agent's own (`floor_of(agent, kind)`: the step deadlines' record of its
answered times, server/defences/step_deadlines.py; `floor_s` where none is given) and
pace(a, b) = max(1, speed(a, b) × work(a, b)): speed is predicted_a / predicted_b when
the planner predicted both devices' steps, else 1; work is work_a / work_b when both
commands say how much work they ask (`Command.work`: samples to train on, rows to upload),
else 1. The devices of one exchange did the same kind of work at the same time, so an honest
one answers within a small multiple of its peers' time for its share of the work; a device
predicted slower (a Jetson Nano among Orins, a slow link) or given more (a larger shard's
epoch) gets that share more, and the floor holds for each: a multiple of the device's own
answered times once it has a record, else the fleet's (`deadline_floor_s`, raised to a
margin over the slowest predicted step). While nobody has
answered, the exchange's deadline applies.

The exchanges cut off are the training steps of every method (`STEP_KINDS`: split steps,
weight pushes and pulls, FedAvg's and Ampere's local training, Ampere's uploads, SHeRL-FL's
edge loads and steps); a bundle's transfer scales with each link and keeps its own
deadline, and a probe is never waited for. The engine decides each exchange's waits in one
place (`Engine.wait_limits`). Pure arithmetic: the engine passes the elapsed times in, so
tests give hand-made ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from jetsplit.protocol import Kind

DEFAULT_CUTOFF_K = 2.0  # × the answering devices' time: same work, same moment
STEP_KINDS = frozenset({Kind.FORWARD.value, Kind.BACKWARD.value, Kind.SET_WEIGHTS.value,
                        Kind.GET_WEIGHTS.value, Kind.RELEASE.value, Kind.TRAIN.value,
                        Kind.GENERATE.value, Kind.EDGE_LOAD.value, Kind.EDGE_STEP.value})


def _usable(value: object) -> float | None:
    """A prediction to divide by: finite and positive, else None (profiles are inputs)."""
    if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
        return float(value)
    return None


@dataclass(frozen=True)
class Cutoff:
    """How long the rest of an exchange is waited for once others answered."""

    floor_s: float
    k: float = DEFAULT_CUTOFF_K
    predicted_s: Mapping[str, float] = field(default_factory=dict)  # agent → planner's step
    kinds: frozenset[str] = STEP_KINDS
    # (agent, kind) → that agent's own floor; None: `floor_s` for everyone
    floor_of: Callable[[str, str], float] | None = field(default=None, compare=False)

    def applies(self, kind: str) -> bool:
        """Whether exchanges of `kind` are cut off (k = 0 turns the cutoff off)."""
        return self.k > 0 and kind in self.kinds

    def floor(self, agent: str, kind: str) -> float:
        """The least `agent` is waited for in an exchange of `kind` once others answered."""
        return self.floor_s if self.floor_of is None else self.floor_of(agent, kind)

    def pace(self, agent: str, other: str, work: Mapping[str, float] | None = None) -> float:
        """How many times longer `agent` may take than `other` (at least 1): its predicted
        step over the other's, times its work over the other's (`work`: agent → units of
        work its command asks; either ratio is 1 where a value is missing or unusable)."""
        return max(1.0, _ratio(self.predicted_s, agent, other) * _ratio(work or {}, agent, other))

    def limit(self, agent: str, answered: Mapping[str, float], deadline_s: float,
              work: Mapping[str, float] | None = None, floor_s: float | None = None) -> float:
        """Seconds from the exchange's start that `agent` is waited for, given the answered
        agents' elapsed seconds, each command's work and the agent's floor (`floor_s` of the
        cutoff where None; the deadline while nobody has answered)."""
        times = [(b, t) for b, t in answered.items()
                 if b != agent and math.isfinite(t) and t >= 0]
        if not times:
            return deadline_s
        scaled = max(t * self.pace(agent, b, work) for b, t in times)
        floor = self.floor_s if floor_s is None else floor_s
        return min(deadline_s, max(floor, self.k * scaled))


def _ratio(values: Mapping[str, float], agent: str, other: str) -> float:
    """values[agent] / values[other], or 1 where either is missing or unusable."""
    mine, theirs = _usable(values.get(agent)), _usable(values.get(other))
    return 1.0 if mine is None or theirs is None else mine / theirs
