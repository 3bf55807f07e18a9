"""Divergence: a training loss that leaves the level of guessing by an order of magnitude,
or stops being a number, ends the run in one line naming the method, the round, the tier
and the likely cause, instead of training on at chance while looking like a finished run.

Why these thresholds: a classifier that guesses has cross-entropy ln C (2.30 for 10
classes), and an untrained one starts near it; a mean loss ten times above both that and the
run's first loss means confident wrong answers everywhere, which only a step too large
produces (PSL at its summed loss: docs/results.md#measurements-behind-the-defaults).
One such step is not yet divergence: SplitFed V1 on AlexNet/MNIST at its defaults (13
samples per server copy) spikes an order of magnitude once in its first steps and then
learns. So the loss must stay over that line for `PATIENCE` checks in a row at one tier,
unless it is a hundred times over (`SPIKE`) or not a number, which end the run at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jetsplit.catalog import METHODS
from jetsplit.errors import JetsplitError
from jetsplit.server.training.optimisers import reduction, tier_optimizer

GROWTH = 10.0  # × max(ln C, first loss): beyond this for PATIENCE checks, diverged
PATIENCE = 3  # consecutive checks over GROWTH at one tier (a transient spike recovers)
SPIKE = 100.0  # × the same base: diverged at once


def _sums_clients(algorithm: str) -> bool:
    entry = METHODS.get(algorithm)
    return entry is not None and entry.reduces_server_loss


class Diverged(JetsplitError):
    """Training diverged: its loss grew by orders of magnitude or is NaN/inf."""


def _averages_uploads(algorithm: str) -> bool:
    entry = METHODS.get(algorithm)
    return entry is not None and entry.aggregates_clients


def likely_cause(settings: Any, tier: str, round_: int = 0) -> str:
    """What most likely made `tier`'s steps too large under `settings`; after round 0 of a
    method that averages uploads under the plain mean, an outsized upload is named too."""
    opt = tier_optimizer(settings, tier if tier != "device" else "client")
    momentum = f" with momentum {opt.momentum:g}" if opt.momentum else ""
    if tier == "server" and _sums_clients(settings.algorithm) and reduction(settings) == "sum":
        cause = (f"the server block steps on the sum of the clients' losses "
                 f"(psl_reduction 'sum'), |S| times a mean's step, at lr {opt.lr:g}{momentum}: "
                 f"use psl_reduction 'mean' or a smaller server lr")
    else:
        cause = f"the {tier} learning rate {opt.lr:g}{momentum} is too high for this model"
    if (round_ > 0 and _averages_uploads(settings.algorithm)
            and getattr(settings, "aggregator", "mean") == "mean"):
        cause += ("; or an outsized upload: aggregator 'mean' averages every update as sent "
                  "([train] aggregator = clipped bounds each one)")
    return cause


@dataclass
class DivergenceGuard:
    """Checks each training loss of a run against the divergence thresholds."""

    settings: Any
    classes: int
    first: float | None = None  # the run's first finite loss under the chance-level limit
    over: dict[str, int] = field(default_factory=dict)  # tier → checks over the limit in a row

    @property
    def base(self) -> float:
        return max(math.log(self.classes), self.first or 0.0)

    @property
    def limit(self) -> float:
        return GROWTH * self.base

    def check(self, loss: float | None, round_: int, tier: str) -> None:
        """Raise `Diverged` (one line) when `loss`, measured at `tier`, has diverged."""
        if loss is None:
            return
        where = f"{self.settings.algorithm} diverged in round {round_} at the {tier} tier"
        cause = f"likely cause: {likely_cause(self.settings, tier, round_)}"
        if not math.isfinite(loss):
            raise Diverged(f"{where}: training loss is {loss}; {cause}")
        base = f"{'chance level' if self.first is None else 'first loss'} ({self.base:.3g})"
        if loss > SPIKE * self.base:
            raise Diverged(f"{where}: training loss {loss:.4g} is over {SPIKE:g}x the {base}; "
                           f"{cause}")
        self.over[tier] = self.over.get(tier, 0) + 1 if loss > self.limit else 0
        if self.over[tier] >= PATIENCE:
            raise Diverged(f"{where}: training loss {loss:.4g} has been over {GROWTH:g}x the "
                           f"{base} for {PATIENCE} checks in a row; {cause}")
        if self.first is None and not self.over[tier]:  # the base: a loss not yet over it
            self.first = loss
