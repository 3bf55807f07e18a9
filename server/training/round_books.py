"""A round's books: what each phase took, how many samples each agent pushed through its
block forward, backward or as a whole model, and who missed which exchange and why.

The trainer keeps one `RoundBooks`, the round loop clears it at every round start and
turns it into the metrics row (phases, device GFLOPs, missed agents)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from jetsplit.server.defences.aggregators import Shares
from jetsplit.server.engines.seam import Outcome


@dataclass
class RoundBooks:
    phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # seconds
    fwd_samples: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bwd_samples: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    full_samples: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # FedAvg
    missed: dict[str, str] = field(default_factory=dict)  # agent → why
    missed_kind: dict[str, str] = field(default_factory=dict)  # agent → the exchange missed
    aggregation: dict[str, str] = field(default_factory=dict)  # agent → clipped / left out
    bounded: dict[str, str] = field(default_factory=dict)  # agent → activations scaled down
    # agent → "N steps down-weighted, last: …" (its loss far above the fleet's)
    down_weighted: dict[str, str] = field(default_factory=dict)
    down_weighted_steps: dict[str, int] = field(default_factory=dict)  # agent → steps
    # agent → "N steps left out of the server update, last: …" (labels that do not fit)
    excluded: dict[str, str] = field(default_factory=dict)
    excluded_steps: dict[str, int] = field(default_factory=dict)  # agent → steps
    # agent → "N steps with its server-gradient share clipped, last: …" (GAPSL,
    # and under gradient_shares = "all" SCALA's family, PSL and SplitFed V2)
    gradient_clipped: dict[str, str] = field(default_factory=dict)
    gradient_clipped_steps: dict[str, int] = field(default_factory=dict)  # agent → steps
    # agent → the smallest mean scale its activations got in a step (1: untouched)
    activation_scale: dict[str, float] = field(default_factory=dict)
    influence: Shares = field(default_factory=Shares)  # each device's share of the averages
    # agent → how it answered the round-start proof-of-life probe (server/defences/sitting_out.py)
    probes: dict[str, str] = field(default_factory=dict)
    # Also sees every noted outcome, across rounds (the trainer's Bench:
    # server/defences/sitting_out.py).
    listener: Callable[[Outcome], None] | None = None

    def reset(self) -> None:
        """A new round: nothing done, nobody missed anything yet."""
        for books in (self.phases, self.fwd_samples, self.bwd_samples, self.full_samples,
                      self.missed, self.missed_kind, self.aggregation, self.bounded,
                      self.down_weighted, self.down_weighted_steps, self.excluded,
                      self.excluded_steps, self.gradient_clipped,
                      self.gradient_clipped_steps, self.activation_scale,
                      self.influence, self.probes):
            books.clear()

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to `phase`."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] += time.perf_counter() - started

    def note(self, outcome: Outcome) -> Outcome:
        """Remember who missed this exchange, and what (for the round's report)."""
        self.missed.update(outcome.missed)
        self.missed_kind.update(dict.fromkeys(outcome.missed, outcome.kind))
        if self.listener is not None:
            self.listener(outcome)
        return outcome

    def agents(self) -> list[str]:
        """Every agent that pushed samples through its block this round."""
        return sorted(set(self.fwd_samples) | set(self.bwd_samples) | set(self.full_samples))
