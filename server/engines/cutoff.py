"""The in-exchange cutoff: once some devices of an exchange have answered, the rest are
waited for only a few times as long, so a silent device costs seconds even on the very first
step, when no step time is known yet (server/defences/step_deadlines.py needs history).

For an agent still open, the limit (seconds from the exchange's start) is

    min(deadline, max(floor, k × max over answered b of elapsed_b × pace(agent, b)))

with pace(a, b) = max(1, predicted_a / predicted_b) when the planner predicted both devices'
steps, else 1. The devices of one exchange did the same work at the same time, so an honest
one of the same kind answers within a small multiple of its peers; a device predicted slower
(a Jetson Nano among Orins, a slow link) gets its predicted share more, and the floor (the
step deadlines' own: `deadline_floor_s`, raised to a margin over the slowest predicted step)
holds for everyone. While nobody has answered, the exchange's deadline applies.

Only the step exchanges whose work is alike across devices are cut off (`STEP_KINDS`); a
bundle's transfer, say, scales with each link and keeps its own deadline. Pure arithmetic:
the engine passes the elapsed times in, so tests give hand-made ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from jetsplit.protocol import Kind

DEFAULT_CUTOFF_K = 2.0  # × the answering devices' time: same work, same moment
STEP_KINDS = frozenset({Kind.FORWARD.value, Kind.BACKWARD.value, Kind.SET_WEIGHTS.value,
                        Kind.GET_WEIGHTS.value, Kind.RELEASE.value})


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

    def applies(self, kind: str) -> bool:
        """Whether exchanges of `kind` are cut off (k = 0 turns the cutoff off)."""
        return self.k > 0 and kind in self.kinds

    def pace(self, agent: str, other: str) -> float:
        """How many times slower `agent` is predicted than `other` (at least 1)."""
        mine, theirs = _usable(self.predicted_s.get(agent)), _usable(self.predicted_s.get(other))
        if mine is None or theirs is None:
            return 1.0
        return max(1.0, mine / theirs)

    def limit(self, agent: str, answered: Mapping[str, float], deadline_s: float) -> float:
        """Seconds from the exchange's start that `agent` is waited for, given the answered
        agents' elapsed seconds (the deadline while nobody has answered)."""
        times = [(b, t) for b, t in answered.items()
                 if b != agent and math.isfinite(t) and t >= 0]
        if not times:
            return deadline_s
        scaled = max(t * self.pace(agent, b) for b, t in times)
        return min(deadline_s, max(self.floor_s, self.k * scaled))
