"""Does a device's upload pull the way the fleet's do? Reversed updates, caught over rounds.

A device that reverses its update (uploads g − (w − g), g the block it was sent) keeps an
honest norm, so the outlier bound passes it, and under the size-weighted mean it subtracts its
share of the fleet's progress: one such device of ten, holding a quarter of the data, cost
FedAvg dearly. Its direction gives it away: an honest update points, on the whole, where
the fleet's median update points (every device starts from the same block and fits the same
task), a reversed one points away.

So at every average of uploaded blocks, each device's update u_k = w_k − g (float tensors it
holds) is compared with the fleet's: per tensor, the coordinate-wise median of the updates of
the devices holding it (no minority can move it). The cosine between u_k and the median,
over u_k's tensors, is accumulated per device and block (running sums kept at `DECAY` each
round). A device whose running mean cosine for a block is below `OPPOSED_BELOW` is
*opposed*: its uploads of that block are left out of the averages until its running mean is
over `RETURN_ABOVE` (a reverser left out has cosines near 0, and at 0 it came back every
third round). Every average re-judges, so a device that mends its uploads comes back once
its honest rounds outweigh the older ones.

Only blocks the devices trained are judged (`Trainer.aggregate(uploaded=...)`), not the
server copies the coordinator trains for SplitFed V1 and Ampere: nobody can reverse those,
and the copy of a device holding a quarter of the data, label skewed, honestly pointed away
from the median for rounds, even in a clean run. The same holds, less so, for such a
device's own uploads (its running mean stays positive, but well under every other
device's), so this catches a
device that keeps reversing its updates, and cannot tell a subtle one from honest skew.

On a clean fleet nobody is opposed and nothing changes, bit for bit (tested, and no verdict
in the clean runs of FedAvg, SCALA and SplitFed V1 measured). The measurements behind the
constants below: docs/results-robustness.md#reversed-updates-the-direction-check.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Mapping

import numpy as np

from jetsplit.server.defences.aggregators import Arrays

# evidence kept at each new round: slow enough that a large, label-skewed honest device's
# early negative cosines do not drag its running mean under OPPOSED_BELOW (at 0.5 they
# nearly did)
DECAY = 0.9
# running mean cosine with the fleet's median update under which a device is opposed. A
# reverser starts far under it from its first upload, and the return bound then holds it.
# The margin is thin for an honest device holding a quarter of the data, label skewed; a
# lower bound would spare it more, but let a FedAvg label flipper, whose updates drift
# away only slowly, stay in
OPPOSED_BELOW = 0.0
# ... and an opposed device is back in once its running mean is over this: a reverser left
# out has small positive cosines (its own classes pull against the fleet's), so a bound
# near 0 lets it back in every few rounds, and each return costs the run dearly; honest
# devices sit above it (but for a large, label-skewed one, who, never opposed, is never
# held to this)
RETURN_ABOVE = 0.25
MIN_DEVICES = 4  # devices holding a tensor before their median is the fleet's update
MIN_EVIDENCE = 1.0  # (decayed) averages seen before a device is judged
SAMPLE = 1 << 18  # coordinates the cosines are taken over, at most

log = logging.getLogger(__name__)


class UpdateDirection:
    """Per-block, per-device running cosine with the fleet's median update, and who is
    opposed now."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.sums: dict[tuple[str, str], float] = {}  # (block, agent) → decayed sum of cosines
        self.counts: dict[tuple[str, str], float] = {}  # (block, agent) → decayed number
        self.last: dict[tuple[str, str], float] = {}  # its latest cosine (for the note)
        self.opposed: dict[tuple[str, str], str] = {}  # why, as of the last judgement

    def new_round(self) -> None:
        """The global block moved: older evidence weighs DECAY."""
        for books in (self.sums, self.counts):
            for key in books:
                books[key] *= DECAY

    def observe(self, block: str, states: Mapping[str, Arrays], reference: Arrays | None
                ) -> None:
        """Add one average's cosines (uploads `states` of `block`, started from
        `reference`), then judge the devices that uploaded."""
        if not self.enabled or reference is None or len(states) < MIN_DEVICES:
            return
        cosines = update_cosines(states, reference)
        log.debug("%s: cosines with the median update: %s", block,
                  " ".join(f"{a} {c:+.3f}" for a, c in cosines.items()))
        for agent, cosine in cosines.items():
            key = (block, agent)
            self.sums[key] = self.sums.get(key, 0.0) + cosine
            self.counts[key] = self.counts.get(key, 0.0) + 1.0
            self.last[key] = cosine
        for agent in states:
            key = (block, agent)
            was_opposed = self.opposed.pop(key, None) is not None
            count = self.counts.get(key, 0.0)
            if count < MIN_EVIDENCE:
                continue
            mean = self.sums[key] / count
            if mean < OPPOSED_BELOW or (was_opposed and mean <= RETURN_ABOVE):
                self.opposed[key] = (
                    f"update opposed to the fleet's: mean cosine with the median update "
                    f"{mean:+.2f} (this time {self.last[key]:+.2f}; back in over "
                    f"{RETURN_ABOVE:+.2f})")

    def excluded(self, block: str, agents: list[str]) -> set[str]:
        """Those of `agents` now opposed in `block` (never half or more of them: the median
        is then no longer the honest majority's, and nobody is trusted less than the
        rest)."""
        out = {a for a in agents if (block, a) in self.opposed}
        return out if 2 * len(out) < len(agents) else set()


def update_cosines(states: Mapping[str, Arrays], reference: Arrays,
                   sample: int = SAMPLE) -> dict[str, float]:
    """Per device, cos(u_k, m) over the float tensors it holds that `reference` has and at
    least MIN_DEVICES devices hold: u_k its update, m the coordinate-wise median update. A
    device with no such tensor, a zero update (or a zero median), or one too large for a
    finite cosine, gets none. Over `sample` coordinates in all, the same seeded random
    ones for every device (on a large model, close to the cosine over every coordinate at
    a small fraction of its cost); below that, over every one, exactly."""
    judged = _judged(states, reference)
    fraction = min(1.0, sample / max(1, sum(reference[n].size for n in judged)))
    dots: dict[str, float] = {}
    own: dict[str, float] = {}
    fleet: dict[str, float] = {}
    for name, agents in judged.items():
        flat, median = _updates(states, reference, name, agents, fraction)
        mm = float(median @ median)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("tensor %s %s", name, " ".join(
                f"{a} {float(u @ median) / (math.sqrt(float(u @ u) * mm) or 1):+.2f}"
                for a, u in zip(agents, flat, strict=True)))
        for agent, u in zip(agents, flat, strict=True):
            dots[agent] = dots.get(agent, 0.0) + float(u @ median)
            own[agent] = own.get(agent, 0.0) + float(u @ u)
            fleet[agent] = fleet.get(agent, 0.0) + mm
    cosines = {a: dots[a] / math.sqrt(own[a] * fleet[a]) for a in sorted(dots)
               if own[a] > 0 and fleet[a] > 0}
    return {a: c for a, c in cosines.items() if math.isfinite(c)}  # no NaN in the sums


def _judged(states: Mapping[str, Arrays], reference: Arrays) -> dict[str, list[str]]:
    """Tensor name → the devices holding it (float, the reference's shape), for the
    tensors at least MIN_DEVICES devices hold."""
    holders: dict[str, list[str]] = {}
    for agent in sorted(states):
        for name, value in states[agent].items():
            ref = reference.get(name)
            if (ref is not None and ref.shape == value.shape
                    and np.issubdtype(value.dtype, np.floating)):
                holders.setdefault(name, []).append(agent)
    return {n: a for n, a in holders.items() if len(a) >= MIN_DEVICES}


def _updates(states: Mapping[str, Arrays], reference: Arrays, name: str, agents: list[str],
             fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The devices' updates of tensor `name` (one row each, over a seeded `fraction` of
    its coordinates, every one at 1) and their coordinate-wise median."""
    size = reference[name].size
    where: np.ndarray | slice = slice(None)
    if fraction < 1.0:
        where = np.random.default_rng(zlib.crc32(name.encode())).integers(
            0, size, max(1, math.ceil(size * fraction)))
    # float64: a scaled upload's squared norm overflows float32 (scale:1000 did)
    start = reference[name].reshape(-1)[where].astype(np.float64)
    flat = np.stack([states[a][name].reshape(-1)[where].astype(np.float64) - start
                     for a in agents])
    return flat, np.median(flat, axis=0)
