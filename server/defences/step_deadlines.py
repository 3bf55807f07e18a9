"""Step deadlines that follow the fleet, so a silent device costs seconds where steps take
seconds, not the configured minute.

The deadline of an exchange kind (forward, backward, set_weights, …) is `k` × the 95th
percentile of that kind's recent step times, clamped to [floor, `deadline_s`]. A step time
is how long the slowest *answering* agent of one exchange took (`Reply.elapsed_s`); an
agent that missed gives no sample, so silence never stretches the deadline, and a slow
but honest device that answers keeps its own times in the window. The floor is the larger
of `deadline_floor_s` and a margin over the slowest profiled device's predicted step
(compute and link, from the planner: server/cuts/planning.py), so such a device is never
benched for being slow before the window knows it. Until a kind has `MIN_SAMPLES` samples,
its deadline is the configured `deadline_s`; over MQTT the in-exchange cutoff
(server/engines/cutoff.py) ends that first wait once the other agents answered, so a silent
device costs seconds even then.

The cutoff's floor follows each device's own record (`floor_of`): once a device has answered
`OWN_MIN_SAMPLES` exchanges of a kind, its floor for that kind is `k` × the median of its
own answered times, never under `OWN_FLOOR_LEAST_S` (a loaded host's scheduling jitter) nor
the margin over the slowest predicted step, never over the fleet floor. The median, not the
95th percentile: a record of a few answers holds the cold first ones (a model's first
forward), which would make the percentile its maximum. A device that always answered in
0.3 s is then cut off after 2 s, not 10, and a slow honest one after a multiple of its own
times; a device without a record keeps the fleet floor.

The windows travel in the run's checkpoint (`snapshot`, `restore`), so a resumed
coordinator goes on from what the run it continues learned, not from nothing; they are read
back like any untrusted file. Its first exchange of each kind still waits `deadline_s`, as a
fresh run's does: agents restarted with it start cold (a model built, a bundle loaded, on a
host that may be busy), and a whole fleet missing a warm deadline fails the round; from that
exchange's step time on, the saved window and the new times decide. The devices' own
records do not travel: a resumed coordinator gives each device the fleet floor until it has
answered again, the cautious side.

Wall time only decides how long the coordinator waits; nothing deterministic (the model
clock of re-planning, selection, training) reads it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Protocol

from jetsplit.server.defences.untrusted_numbers import finite

MIN_SAMPLES = 1  # step times of a kind before its deadline adapts (the floor guards the first)
FLOOR_MARGIN = 3.0  # × the slowest profiled device's predicted step (prediction error)
DEFAULT_K = 4.0
DEFAULT_WINDOW = 50
DEFAULT_FLOOR_S = 10.0
MAX_KINDS = 64  # exchange kinds a checkpoint may carry windows for
MAX_KIND_CHARS = 64
MAX_SAVED_SAMPLES = 10_000  # per kind, read back (the window keeps its own last ones)
MAX_STEP_S = 1e6  # a saved step time above this is no step time
# A device's answered exchanges of a kind before its own record counts. One is enough: a
# cold first answer only raises the floor (the safe side), and `OWN_FLOOR_LEAST_S` bounds a
# lucky fast one; a weight push comes once a round, so two would leave a device that goes
# silent in round 2 the fleet floor at its first push.
OWN_MIN_SAMPLES = 1
OWN_FLOOR_LEAST_S = 2.0  # the least a device's own floor goes (a loaded host's jitter)


class _Timed(Protocol):
    elapsed_s: float | None


class _Outcome(Protocol):
    kind: str

    @property
    def replies(self) -> Mapping[str, _Timed]: ...


def percentile95(values: Iterable[float]) -> float:
    """The nearest-rank 95th percentile: the ⌈0.95·n⌉-th smallest value (no
    interpolation, so a hand count checks it)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


def predicted_floor(predicted_step_s: Mapping[str, float], floor_s: float) -> float:
    """The least deadline: `floor_s`, or `FLOOR_MARGIN` × the slowest device's predicted
    step (agent → seconds) when that is longer. Non-finite or negative predictions are
    ignored (a plan is computed, but its inputs are profiles)."""
    usable = [float(v) for v in predicted_step_s.values()
              if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0]
    return max([floor_s, *(FLOOR_MARGIN * v for v in usable)])


class StepDeadlines:
    """Recent step times per exchange kind, and the deadline each kind gets now."""

    def __init__(self, ceiling_s: float, *, k: float = DEFAULT_K, window: int = DEFAULT_WINDOW,
                 floor_s: float = DEFAULT_FLOOR_S, predicted_floor_s: float = 0.0) -> None:
        """`floor_s`: the fleet floor (`predicted_floor` of the configured one);
        `predicted_floor_s`: its part from the predictions alone, which no device's own
        record goes under."""
        if window < 1:
            raise ValueError("window must be at least 1")
        self.ceiling_s, self.k, self.window = float(ceiling_s), float(k), int(window)
        self.floor_s = min(float(floor_s), self.ceiling_s)  # the configured ceiling wins
        self.predicted_floor_s = min(max(float(predicted_floor_s), 0.0), self.floor_s)
        self.samples: dict[str, deque[float]] = {}
        self.own: dict[tuple[str, str], deque[float]] = {}  # (kind, agent) → its answered times
        self.timed: set[str] = set()  # kinds timed by this process (not only read back)
        self.used: dict[str, float] = {}  # kind → the largest deadline given this round
        self.full: dict[str, int] = {}  # kind → exchanges this round given the whole ceiling

    def deadline(self, kind: str) -> float:
        """Seconds an exchange of `kind` waits now (and books the value for the round)."""
        times = self.samples.get(kind, ())
        if self.k <= 0 or len(times) < MIN_SAMPLES or kind not in self.timed:
            value = self.ceiling_s
        else:
            value = min(self.ceiling_s, max(self.floor_s, self.k * percentile95(times)))
        self.used[kind] = max(self.used.get(kind, 0.0), value)
        self.full[kind] = self.full.get(kind, 0) + (value >= self.ceiling_s)
        return value

    def floor_of(self, agent: str, kind: str) -> float:
        """The cutoff's floor for `agent` in an exchange of `kind`: `k` × the median (the
        lower one) of its own answered times within [max(`OWN_FLOOR_LEAST_S`, the predicted
        floor), the fleet floor]; the fleet floor until it answered `OWN_MIN_SAMPLES`."""
        times = self.own.get((kind, agent), ())
        if self.k <= 0 or len(times) < OWN_MIN_SAMPLES:
            return self.floor_s
        least = max(OWN_FLOOR_LEAST_S, self.predicted_floor_s)
        return min(self.floor_s, max(least, self.k * statistics.median_low(times)))

    def observe(self, outcome: _Outcome) -> None:
        """One exchange's step time: its slowest timed reply (none answered: nothing); and
        each answering agent's own time joins its record."""
        timed = {a: r.elapsed_s for a, r in outcome.replies.items()
                 if r.elapsed_s is not None and math.isfinite(r.elapsed_s) and r.elapsed_s >= 0}
        if timed and outcome.kind:
            self.timed.add(outcome.kind)
            self.samples.setdefault(outcome.kind, deque(maxlen=self.window)).append(
                max(timed.values()))
            for agent, elapsed in timed.items():
                self.own.setdefault((outcome.kind, agent),
                                    deque(maxlen=self.window)).append(elapsed)

    def snapshot(self) -> dict[str, list[float]]:
        """The windows, JSON-safe: kind → its step times, oldest first."""
        return {kind: list(times) for kind, times in sorted(self.samples.items())}

    def restore(self, saved: object) -> None:
        """Put `snapshot`'s windows back (a checkpoint is untrusted: bounded sizes, kinds
        as short names, finite non-negative seconds; ValueError or TypeError otherwise).
        None (a checkpoint written before the windows were kept) leaves them empty. A kind
        adapts again once this process has timed one exchange of it."""
        if saved is None:
            return
        if not isinstance(saved, Mapping) or len(saved) > MAX_KINDS:
            raise TypeError(f"step deadline windows: not a mapping of at most {MAX_KINDS} "
                            "kinds")
        windows: dict[str, deque[float]] = {}
        for kind, times in saved.items():
            if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND_CHARS:
                raise ValueError(f"step deadline windows: bad kind {str(kind)[:40]!r}")
            if not isinstance(times, list) or len(times) > MAX_SAVED_SAMPLES:
                raise TypeError(f"step deadline window {kind!r}: not a list of at most "
                                f"{MAX_SAVED_SAMPLES} step times")
            values = [finite(t, 0.0, MAX_STEP_S) for t in times]
            if any(v is None for v in values):
                raise ValueError(f"step deadline window {kind!r}: a step time is not a "
                                 f"finite number of seconds in [0, {MAX_STEP_S:g}]")
            windows[kind] = deque((v for v in values if v is not None), maxlen=self.window)
        self.samples = windows
        self.timed = set()

    def new_round(self) -> tuple[dict[str, float], dict[str, int]]:
        """The round's books, and a fresh record for the next: per kind, the largest
        deadline given, and how many exchanges were given the whole configured one."""
        used, full = dict(sorted(self.used.items())), dict(sorted(self.full.items()))
        self.used, self.full = {}, {}
        return used, full
