"""Do a device's labels fit its activations? Flipped labels, caught where a split server sees
both.

A device that flips or shifts its labels sends honest-looking activations with honest-looking
norms, and its loss on the server block stays near the fleet's: its own client block and the
shared server block both learn its mapping (a shifted-label device holding a quarter of the
data passes every norm and loss bound, and costs SCALA dearly). But in split learning the
coordinator sees every sample's activations *and* its label, and all devices start each round
from the same client block: the samples an honest device labels c look like everyone's c,
while those a label-shifter labels c look like everyone's c − 1.

So per activation shape, each device's activations are summed per label, after a fixed random
projection to `DIMS` dimensions (distances kept within a few percent; centroids of 100 devices
stay small). Each class's fleet centroid is the coordinate-wise median of the devices'
centroids for it (at least `MIN_HOLDERS` devices with `MIN_SAMPLES` of it each, so a minority
cannot move it). A device's label-c centroid is *consistent* when the fleet centroid nearest to
it is c's; a device most of whose judged samples sit nearest another class's is *inconsistent*:
it sits out the shared server update, its uploads are left out of the averages and its share
of each step's batch goes to the others (it sends a probe of `PROBE_BATCH` samples), while it
stays so. Sums decay by half at each round (the client block moves between rounds),
and every step re-judges, so a device that mends its labels comes back.

A verdict changes only after `CONFIRM` judgements in a row say so, each at a step the device
sent samples. On a block not yet trained the fleet's centroids sit close, and an honest device
can be over half for a single step, while a shifter is over half at every step of a round
but the first after a new round's decay: no threshold tells them apart, persistence does
(measured: docs/results-robustness.md#flipped-labels-the-label-check).

On a clean fleet nobody is inconsistent and nothing changes, bit for bit (measured: the clean
runs of `benchmarks/bench_robust.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the first step, not with the config that reads the default
    import torch

DIMS = 64  # random projection of each flattened activation
MIN_SAMPLES = 8.0  # a device's (decayed) samples of a class before its centroid is judged
MIN_HOLDERS = 3  # devices holding a class before the fleet has a centroid for it
DECAY = 0.5  # sums and counts kept at each new round
INCONSISTENT_SHARE = 0.5  # over this share of a device's judged samples nearest another class
PROBE_BATCH = 8  # samples per step an inconsistent device still sends (to be judged again)
CONFIRM = 2  # judgements in a row, at steps it sent, before a device's verdict changes


class LabelConsistency:
    """Per-shape, per-device, per-label activation sums, and who is inconsistent now."""

    def __init__(self, classes: int, enabled: bool = True, seed: int = 0) -> None:
        self.classes, self.enabled, self.seed = classes, enabled, seed
        self.projections: dict[tuple[int, ...], torch.Tensor] = {}
        self.sums: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}  # shape → agent → C×DIMS
        self.counts: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}  # shape → agent → C
        self.inconsistent: dict[str, str] = {}  # agent → why, as of its last judgement over
        self.against: dict[str, int] = {}  # agent → judgements in a row against its verdict

    def new_round(self) -> None:
        """The client block moved: older evidence counts half."""
        for books in (self.sums, self.counts):
            for per_agent in books.values():
                for agent in per_agent:
                    per_agent[agent] = per_agent[agent] * DECAY

    def observe(self, agents: list[str], acts: list[torch.Tensor],
                labels: list[torch.Tensor]) -> None:
        """Add one step's activations and labels, then judge every device of those shapes."""
        if not self.enabled or not agents:
            return
        import torch

        shapes: set[tuple[int, ...]] = set()
        sent: set[str] = set()
        with torch.no_grad():
            for agent, a, y in zip(agents, acts, labels, strict=True):
                if not a.shape[0]:
                    continue
                shape = tuple(a.shape[1:])
                shapes.add(shape)
                sent.add(agent)
                projected = a.detach().flatten(1).to(torch.float32) @ self._projection(shape, a)
                sums = self.sums.setdefault(shape, {}).setdefault(
                    agent, projected.new_zeros(self.classes, DIMS))
                counts = self.counts.setdefault(shape, {}).setdefault(
                    agent, projected.new_zeros(self.classes))
                sums.index_add_(0, y, projected)
                counts.index_add_(0, y, torch.ones_like(y, dtype=counts.dtype))
            for shape in shapes:
                self._judge(shape, sent)

    def _projection(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A fixed Gaussian D×DIMS matrix per shape (seeded: the same run, the same bits)."""
        import torch

        if shape not in self.projections:
            width = like[0].numel()
            generator = torch.Generator().manual_seed(self.seed + width)
            matrix = torch.randn(width, DIMS, generator=generator) / DIMS ** 0.5
            self.projections[shape] = matrix.to(like.device)
        return self.projections[shape]

    def _judge(self, shape: tuple[int, ...], sent: set[str]) -> None:
        """Judge the devices of `shape` that sent samples this step; a verdict changes on
        its CONFIRM-th judgement in a row against it. The centroids' medians and distances
        are taken where the activations are, and read to the host once (on CUDA each read
        waits for the card)."""
        import torch

        sums, counts = self.sums[shape], self.counts[shape]
        agents = sorted(sums)
        count = torch.stack([counts[a] for a in agents])  # devices × C, where the acts are
        centroid = torch.stack([sums[a] for a in agents]) / count.clamp_min(1e-12)[..., None]
        held = count >= MIN_SAMPLES  # devices × C
        fleet = held.sum(dim=0) >= MIN_HOLDERS  # C: the classes with a fleet centroid
        # Each class's median over its holders: the others are NaN, which nanmedian skips,
        # taking the same lower middle value as a median over the holders alone.
        medians = torch.where(held[..., None], centroid, float("nan")).nanmedian(dim=0).values
        distance = torch.cdist(centroid.flatten(0, 1), medians)  # (devices·C) × C
        nearest = distance.masked_fill(~fleet, float("inf")).argmin(dim=1)  # a fleet class
        host = torch.cat([count.flatten(), nearest.to(count.dtype)]).cpu()  # the one read
        count = host[:count.numel()].view(len(agents), self.classes)
        nearest = host[count.numel():].long().view(len(agents), self.classes)
        held = count >= MIN_SAMPLES
        fleet = held.sum(dim=0) >= MIN_HOLDERS
        if int(fleet.sum()) < 2:
            for agent in sent & set(agents):
                self._verdict(agent, None)
            return
        judged = held & fleet
        wrong = judged & (nearest != torch.arange(self.classes))
        judged_n = (count * judged).sum(dim=1).tolist()
        wrong_n = (count * wrong).sum(dim=1).tolist()
        for i, agent in enumerate(agents):
            if agent not in sent:
                continue
            why = None
            if judged_n[i] >= MIN_SAMPLES and wrong_n[i] > INCONSISTENT_SHARE * judged_n[i]:
                moved = [f"{c}→{int(nearest[i, c])}" for c in range(self.classes)
                         if bool(wrong[i, c])]
                why = (f"labels inconsistent with its activations: {wrong_n[i]:.0f} of "
                       f"{judged_n[i]:.0f} samples sit nearest another class's "
                       f"({', '.join(moved[:5])})")
            self._verdict(agent, why)

    def _verdict(self, agent: str, why: str | None) -> None:
        """One judgement of `agent` (`why` None: consistent): the verdict turns on the
        CONFIRM-th in a row against it; a judgement that agrees resets the count."""
        if (why is not None) == (agent in self.inconsistent):
            self.against[agent] = 0
            if why is not None:
                self.inconsistent[agent] = why  # the latest numbers
            return
        self.against[agent] = self.against.get(agent, 0) + 1
        if self.against[agent] < CONFIRM:
            return
        self.against[agent] = 0
        if why is None:
            del self.inconsistent[agent]
        else:
            self.inconsistent[agent] = why

    def excluded(self, agents: list[str]) -> set[str]:
        """Those of `agents` now inconsistent (never all of them: then nobody is trusted
        less than the rest, and the step goes on as if unjudged)."""
        out = {a for a in agents if a in self.inconsistent}
        return out if len(out) < len(agents) else set()

