"""What a device claims about its data, bounded before it weighs in anything.

A device's registered |D_k| sets its weight in every average (FedAvg, layer-wise averages
over mixed cuts, Ampere's validation mean), its share of each iteration's batch, and the
planner's data size. An enrolled device can still lie: one that claims 10^9 samples would
own every average and 89% of each batch. So every weight is the claim capped at a multiple
of the fleet's median claim. A minority that exaggerates cannot move the median, so it
cannot raise its own cap; honest devices within `factor` of the median keep their exact
|D_k| (every paper's weights). The device's own work (an Ampere epoch, an upload's row
count) still uses its raw claim: that only costs the liar.

Why 5: honest fleets are skewed too. Over 5 to 10 seeds of the shipped partitioners on 5,000
labels, the largest honest device held at most 1.85× the median under `quantity:2`, 3.62×
under `dirichlet:0.1` with 10 devices and 4.19× with 20, but up to 12.7× with 50 devices
and 25× under `dirichlet:0.05` with 100: such fleets need a larger `size_cap` (or 0), and
every cap that fires is logged and kept in summary.json. A liar among 10 devices holds at
most 5/14 of an average instead of ~all of it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger("jetsplit.coordinator")

DEFAULT_SIZE_CAP = 5.0  # [train] size_cap: a claim weighs at most this × the median claim


def registered_size(registration: Mapping[str, Any]) -> int | None:
    """|D_k| as the agent registered it (untrusted: a positive int or None)."""
    dataset = registration.get("dataset")
    size = dataset.get("size") if isinstance(dataset, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def size_cap(fleet: Iterable[int], factor: float) -> int | None:
    """The largest weight one claim may carry: ⌊factor × median⌋ of the fleet's positive
    claims (at least 1); None when uncapped (`factor` 0) or nobody has claimed yet."""
    claims = [n for n in fleet if n > 0]
    if factor <= 0 or not claims:
        return None
    return max(1, math.floor(factor * statistics.median(claims)))


def capped(claims: Mapping[str, int], cap: int | None) -> dict[str, int]:
    """Each claim, at most `cap` (unchanged when `cap` is None)."""
    return dict(claims) if cap is None else {a: min(n, cap) for a, n in claims.items()}


class ClaimBooks:
    """Which devices' claims were capped, at what: logged once per device and claim, and
    kept for the run's summary (`capped_claims`)."""

    def __init__(self) -> None:
        self.capped: dict[str, dict[str, int]] = {}

    def note(self, claims: Mapping[str, int], cap: int | None) -> None:
        if cap is None:
            return
        for agent, claim in claims.items():
            if claim > cap and self.capped.get(agent, {}).get("claimed") != claim:
                self.capped[agent] = {"claimed": claim, "weight": cap}
                log.warning("agent %s claims %d samples, over %d (the size cap × the fleet's "
                            "median claim): it weighs as %d", agent, claim, cap, cap)
