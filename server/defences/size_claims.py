"""What a device claims about its data, bounded before it weighs in anything.

A device's registered |D_k| sets its weight in every average (FedAvg, layer-wise averages
over mixed cuts, Ampere's validation mean), its share of each iteration's batch, and the
planner's data size. An enrolled device can still lie: one that claims 10^9 samples would
own every average and most of each batch. So every weight is the claim capped at a multiple
of the fleet's median claim. A minority that exaggerates cannot move the median, so it
cannot raise its own cap; honest devices within `factor` of the median keep their exact
|D_k| (every paper's weights). The device's own work (an Ampere epoch, an upload's row
count) still uses its raw claim: that only costs the liar.

Why 5: honest fleets are skewed too. Under the shipped partitioners the largest honest
device stays under 5× the median at `quantity:2` and at `dirichlet:0.1` with 10 or 20
devices, but not with 50 devices nor at `dirichlet:0.05` with 100
(docs/results-robustness.md#size-lies-and-provisioned-sizes): such fleets need a larger
`size_cap` (or 0), and every cap that fires is logged and kept in summary.json. A liar among
10 devices holds at most 5/14 of an average instead of ~all of it.

The median cap still lets an exaggerating device weigh up to 5× the median, several times
its truth. Where the operator knows what each device holds, `jetsplit provision --size
a3=265` writes it into the coordinator's config (`[train.provisioned_sizes]`), and a claim
then weighs at most that: a liar weighs as its true size, as if it had not lied. The
median is taken over the claims so bounded, and the cap still applies on top (devices
with no provisioned size keep only it).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger("jetsplit.coordinator")

DEFAULT_SIZE_CAP = 5.0  # [train] size_cap: a claim weighs at most this × the median claim
# What bounded a claim, as the summary's `capped_claims` and the report name it.
BY_PROVISIONED, BY_CAP = "provisioned size", "size cap"


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


def provisioned(claims: Mapping[str, int], sizes: Mapping[str, int]) -> dict[str, int]:
    """Each claim, at most the size provisioned for that device (unchanged where none
    was)."""
    return {a: min(n, sizes[a]) if a in sizes else n for a, n in claims.items()}


def fleet_cap(fleet: Mapping[str, int], factor: float, sizes: Mapping[str, int]
              ) -> int | None:
    """`size_cap` over the `fleet`'s claims, each first bounded by its provisioned size (so
    no device's lie, provisioned or not, raises the median)."""
    return size_cap(provisioned(fleet, sizes).values(), factor)


def claim_weights(claims: Mapping[str, int], fleet: Mapping[str, int], factor: float,
                  sizes: Mapping[str, int]) -> dict[str, int]:
    """Each of `claims` as a weight: at most its provisioned size (`sizes`), and at most the
    `fleet_cap`."""
    return capped(provisioned(claims, sizes), fleet_cap(fleet, factor, sizes))


class ClaimBooks:
    """Each device's weight from its claim (as `claim_weights`, under the provisioned `sizes`),
    and which devices' claims were bounded, at what and by which bound (BY_PROVISIONED or
    BY_CAP): logged once per device and claim, and kept for the run's summary
    (`capped_claims`)."""

    def __init__(self, sizes: Mapping[str, int] | None = None) -> None:
        self.sizes = dict(sizes or {})
        self.capped: dict[str, dict[str, int | str]] = {}
        self._cap: tuple[Mapping[str, int] | None, float, int | None] = (None, 0.0, None)

    def weights(self, claims: Mapping[str, int], fleet: Mapping[str, int], factor: float
                ) -> dict[str, int]:
        """`claims` as weights, the fleet's claims setting the median cap. The cap is kept
        while the same `fleet` mapping comes back (the registry hands out one until its
        membership changes), so a step does not walk the fleet."""
        if self._cap[0] is not fleet or self._cap[1] != factor:
            self._cap = (fleet, factor, fleet_cap(fleet, factor, self.sizes))
        weights = capped(provisioned(claims, self.sizes), self._cap[2])
        for agent, claim in claims.items():
            weight = weights[agent]
            if claim <= weight or self.capped.get(agent, {}).get("claimed") == claim:
                continue
            by = BY_CAP if weight < min(claim, self.sizes.get(agent, claim)) else BY_PROVISIONED
            self.capped[agent] = {"claimed": claim, "weight": weight, "by": by}
            if by == BY_CAP:
                log.warning("agent %s claims %d samples, over %d (the size cap × the fleet's "
                            "median claim): it weighs as %d", agent, claim, weight, weight)
            else:
                log.warning("agent %s claims %d samples, over the %d provisioned for it: it "
                            "weighs as %d", agent, claim, weight, weight)
        return weights


# A registered label histogram against the labels the device then sends (LabelTally).
HISTOGRAM_MARGIN = 0.1  # total variation allowed beyond sampling noise
HISTOGRAM_NOISE = 1.5  # × √(C/n): three times the bound on an honest tally's expected TV
HISTOGRAM_MIN_PER_CLASS = 20  # judge only after 20·C labels


class LabelTally:
    """The labels each device sent with its activations, against the histogram it
    registered.

    SCALA's client prior P_k is the device's registered label histogram, and nothing else
    about a registration can be checked: but in split learning every activation batch comes
    with its labels, so the coordinator sees the device's label distribution for itself.
    Once a device has sent `HISTOGRAM_MIN_PER_CLASS`·C labels, a claim whose total
    variation distance from them is over `HISTOGRAM_MARGIN` + `HISTOGRAM_NOISE`·√(C/n) is
    replaced, for the rest of the run, by the running tally (an honest tally's expected
    distance is at most ½√(C/n), for any distribution). Logged once and kept for the
    summary (`histogram_claims`). An honest device is never judged wrong in expectation;
    where it is within the margin its registered counts stay (a clean run's same bits)."""

    def __init__(self, classes: int, enabled: bool = True) -> None:
        self.classes, self.enabled = classes, enabled
        self.counts: dict[str, list[int]] = {}
        self.replaced: dict[str, dict[str, float]] = {}  # agent → {distance, bound, labels}

    def add(self, agent: str, labels: Any) -> None:
        """Count one reply's labels (already range-checked by the trainer)."""
        if not self.enabled:
            return
        import numpy as np

        seen = np.bincount(np.asarray(labels, dtype=np.int64), minlength=self.classes)
        counts = self.counts.setdefault(agent, [0] * self.classes)
        for c, n in enumerate(seen.tolist()[:self.classes]):
            counts[c] += n

    def prior_counts(self, agent: str, claimed: Any) -> Any:
        """The counts SCALA's P_k should come from: the registered `claimed` histogram, or
        this device's tally once the claim is shown wrong (then always the tally)."""
        if not self.enabled:
            return claimed
        tally = self.counts.get(agent)
        if agent in self.replaced:
            return tally
        n = sum(tally) if tally else 0
        if n < HISTOGRAM_MIN_PER_CLASS * self.classes or not _usable(claimed, self.classes):
            return claimed
        total = float(sum(claimed))
        distance = 0.5 * sum(abs(c / total - t / n) for c, t in zip(claimed, tally, strict=True))
        bound = HISTOGRAM_MARGIN + HISTOGRAM_NOISE * math.sqrt(self.classes / n)
        if distance <= bound:
            return claimed
        self.replaced[agent] = {"distance": round(distance, 4), "bound": round(bound, 4),
                                "labels": n}
        log.warning("agent %s: its registered label histogram is %.3f (total variation) from "
                    "the %d labels it sent, over %.3f: its prior now comes from those labels",
                    agent, distance, n, bound)
        return tally


def _usable(claimed: Any, classes: int) -> bool:
    """A histogram the distance can be taken on (anything else is refused downstream)."""
    return (isinstance(claimed, list) and len(claimed) == classes
            and all(isinstance(c, (int, float)) and not isinstance(c, bool)
                    and math.isfinite(c) and c >= 0 for c in claimed)
            and sum(claimed) > 0)
