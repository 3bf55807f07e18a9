"""Bounded influence on the server block: no device's activations may be far larger than the
fleet's.

A split method updates its server block every iteration from every device's activations.
Only NaN and infinity were refused, so a device sending activations × 10^6 steered the
shared block (docs/results-robustness.md). Here each sample's activation norm is bounded at
`factor` × a robust reference: the median of the per-device median norms, over this step's
devices and the last `window` steps' (kept per activation shape, since devices at different
cuts send different tensors). A device whose median is over the bound is scaled back to
the reference as a whole (down-weighted for the step: a scaled-up device is undone), then
any sample still over the bound is scaled down to it (direction kept); the device is noted
for the round's books. A minority of devices cannot move the
median; history recorded from clipped values cannot be ratcheted up faster than `factor`
per window. On a clean run nothing is over the bound, and the step is bit for bit the same.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the first step, not with the config that reads the default
    import torch

DEFAULT_ACTIVATION_BOUND = 5.0  # [train] activation_bound: × the fleet's median norm; 0 off
WINDOW = 32  # steps of per-device medians kept per activation shape


class ActivationBound:
    """Running per-shape reference norms, and the clipping of one step's activations."""

    def __init__(self, factor: float, window: int = WINDOW) -> None:
        self.factor = factor
        self.window = window
        self.history: dict[tuple[int, ...], deque[float]] = {}

    def apply(self, agents: list[str], acts: list[torch.Tensor], notes: dict[str, str],
              scales: dict[str, float] | None = None) -> list[torch.Tensor]:
        """`acts` with every sample's norm at most `factor` × the reference; notes which
        devices had samples scaled down, and how many, and in `scales` the smallest mean
        scale each bounded device got (for the report's influence plot)."""
        if self.factor <= 0 or not agents:
            return acts
        norms, stats = _norm_stats(acts)
        medians: dict[tuple[int, ...], list[float]] = {}
        for a, pair in zip(acts, stats, strict=True):
            if pair is not None:
                medians.setdefault(tuple(a.shape[1:]), []).append(pair[0])
        references = {shape: statistics.median([*self.history.setdefault(
            shape, deque(maxlen=self.window)), *current]) for shape, current in medians.items()}
        out = []
        for agent, a, n, pair in zip(agents, acts, norms, stats, strict=True):
            reference = references.get(tuple(a.shape[1:]))
            if reference is None or pair is None or not pair[1] > self.factor * reference:
                out.append(a)
            else:
                out.append(self._bounded(agent, a, n, pair[0], reference, notes, scales))
        for shape, current in medians.items():  # what was sent, clipped to what was allowed
            self.history[shape].extend(min(m, self.factor * references[shape]) for m in current)
        return out

    def _bounded(self, agent: str, a: torch.Tensor, n: torch.Tensor, median: float,
                 reference: float, notes: dict[str, str], scales: dict[str, float] | None
                 ) -> torch.Tensor:
        """One device's activations `a` (sample norms `n`, their median `median`) with a
        sample over the bound: a device whose typical sample is over it is brought back to
        the fleet's scale as a whole (down-weighted); then any single sample still over it
        is cut. Noted, and its mean scale kept in `scales`."""
        import torch

        bound = self.factor * reference
        whole = reference / median if median > bound else 1.0
        scale = (torch.full_like(n, whole) * torch.clamp(
            bound / (n * whole).clamp_min(1e-30), max=1.0))
        if scales is not None:  # a bounded device only: rare, so its sync is too
            scales[agent] = min(scales.get(agent, 1.0), float(scale.mean()))
        over = int((n * whole > bound).sum())
        notes[agent] = (f"activations bounded: median norm {median:.4g} (fleet "
                        f"{reference:.4g}, bound {bound:.4g})"
                        + (f", all scaled ×{whole:.3g}" if whole != 1.0 else "")
                        + (f", {over} of {a.shape[0]} samples cut" if over else ""))
        return a * scale.view(-1, *([1] * (a.dim() - 1))).to(a.dtype)


def _norm_stats(acts: list[torch.Tensor]
                ) -> tuple[list[torch.Tensor], list[list[float] | None]]:
    """Each device's per-sample norms, and its (median, max) norm (None for an empty
    batch), read in one host transfer: one sync per step, not two per device (on CUDA each
    float() or bool() of a device tensor waits for the GPU)."""
    import torch

    norms = [a.detach().flatten(1).norm(dim=1) if a.shape[0] else a.new_zeros(0)
             for a in acts]
    present = [n for n in norms if n.numel()]
    pairs = iter(torch.stack([torch.stack((n.median(), n.max())) for n in present]).tolist()
                 if present else [])
    return norms, [next(pairs) if n.numel() else None for n in norms]


DEFAULT_LOSS_BOUND = 3.0  # [train] loss_bound: × the fleet's median per-device loss; 0 off


class RunningBound:
    """Per step: a device whose value (a loss, a gradient norm) is far above the fleet's
    recent ones is down-weighted in the shared server block's update.

    The reference is the median of this step's per-device values and the last `window`
    steps' (one SplitFed V2 step serves one device, so the history holds the others); a
    device over `factor` × the reference gets weight bound ÷ value, so its term weighs as if
    its value were at the bound. History keeps values clipped at the bound, so it cannot be
    ratcheted up while the window holds more honest steps than not. Nothing over the bound
    (a clean run): no weights, and the method takes its unweighted path, bit for bit."""

    verb = "down-weighted"  # what the books say happened to a device over the bound
    noun = "value"  # what was measured

    def __init__(self, factor: float, window: int = WINDOW, floor: float = 0.0) -> None:
        self.factor = factor
        self.floor = floor  # a value at or under it is never over the bound
        self.history: deque[float] = deque(maxlen=window)

    def weights(self, agents: list[str], values: list[float], notes: dict[str, str],
                steps: dict[str, int]) -> list[float] | None:
        """One weight per device (in `agents` order), or None where none is over the
        bound; the round's books count, per down-weighted device, its steps (`steps`) and
        say in `notes` how many and the latest step's numbers."""
        import math

        if self.factor <= 0 or not agents:
            return None
        finite = [x for x in values if math.isfinite(x) and x >= 0]
        if not finite:
            return None
        reference = statistics.median([*self.history, *finite])
        bound = max(self.factor * reference, self.floor)
        self.history.extend(min(x, bound) for x in finite)
        if bound <= 0 or all(x <= bound for x in finite):
            return None
        over = (f"the floor {self.floor:.4g} (the fleet's {reference:.4g})"
                if bound == self.floor else f"{self.factor:g}× the fleet's {reference:.4g}")
        return bounded_weights(agents, values, bound, notes, steps, lambda value, weight: (
            f"{self.verb}, last: {self.noun} {value:.4g} over {over}, weight {weight:.3g}"))


class LossBound(RunningBound):
    """A device whose loss on the server block is far above the fleet's is down-weighted.

    Flipped or shifted labels do not show in the activations; they show in the loss: once
    the honest devices have learned, a device whose labels disagree with its inputs keeps a
    loss many times theirs, and every step its gradient pulls the shared block toward its
    labels. Such a loss is far over chance level (ln C, what a uniform guess scores).
    `floor` (the trainer gives LOSS_FLOOR × ln C) keeps an honest device that does better
    than chance in: late in a clean run the fleet's median loss nears 0, and 3× it
    down-weighted honest devices' hard batches in most rounds of a clean run; under
    SplitFed V2's client-after-client schedule the next device's first steps sit over 3×
    the loss of the server block just fitted to the last one
    (docs/results-robustness.md#what-the-default-defence-costs-a-clean-run)."""

    noun = "loss"


LOSS_FLOOR = 1.0  # × ln(classes), chance level: a mean loss under it is never down-weighted


class StepGradientBound(RunningBound):
    """SplitFed V2's gradient bound: each step serves one device, so that device's share of
    the server gradient is the whole step's gradient; its norm is bounded at `factor` × the
    recent steps' (the other devices') median. Measuring it costs one norm per step."""

    verb = "with its server-gradient share clipped"
    noun = "gradient norm"


def bounded_weights(agents: list[str], values: list[float], bound: float,
                    notes: dict[str, str], steps: dict[str, int],
                    say: Callable[[float, float], str]) -> list[float]:
    """Per device, bound ÷ value where its (finite) value is over `bound`, else 1; each
    device over it gets a step counted and the note "N steps " + say(value, weight)."""
    import math

    out = []
    for agent, value in zip(agents, values, strict=True):
        weight = bound / value if math.isfinite(value) and value > bound else 1.0
        out.append(weight)
        if weight < 1.0:
            steps[agent] = steps.get(agent, 0) + 1
            notes[agent] = f"{steps[agent]} steps {say(value, weight)}"
    return out


def share_norms(terms: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[float]:
    """The norm of each term's gradient over `params`: each device's share of a shared
    step's server gradient. One backward per term (the graph is kept for the step's own),
    one host read for them all."""
    import torch

    grads = []
    for term in terms:
        got = torch.autograd.grad(term, list(params), retain_graph=True, allow_unused=True)
        grads.append([g for g in got if g is not None])
    return gradient_norms(grads)


def gradient_norm(grads: Sequence[torch.Tensor]) -> float:
    """The norm of a whole gradient given per tensor (see `gradient_norms`)."""
    return gradient_norms([grads])[0]


def gradient_norms(gradients: Sequence[Sequence[torch.Tensor]]) -> list[float]:
    """The norm of each whole gradient (each given per tensor; an empty one is 0), with one
    host read for all: in the tensors' own precision (float64 costs many times more on a
    large model), again in float64 only for a gradient where that overflowed, so a huge
    gradient reads as huge, never as infinite."""
    import math

    import torch

    device = next((grads[0].device for grads in gradients if grads), torch.device("cpu"))

    def norm(grads: Sequence[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=device)
        return torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g, dtype=dtype) for g in grads]))

    if not gradients:
        return []
    values = torch.stack([norm(grads, None).float() for grads in gradients]).tolist()
    return [v if math.isfinite(v) else float(norm(grads, torch.float64))
            for v, grads in zip(values, gradients, strict=True)]


DEFAULT_GRADIENT_BOUND = 5.0  # [train] gradient_bound: × this step's median share; 0 off


def gradient_shares(agents: list[str], norms: list[float], factor: float,
                    notes: dict[str, str], steps: dict[str, int]) -> list[float] | None:
    """Each device's weight so that its share of the server block's gradient (the norm of
    its own term's gradient) is at most `factor` × the median share of this step: weight
    bound ÷ norm above the bound, 1 below; None when nobody is above (the unweighted step,
    bit for bit) or with fewer than three devices (no median to stand against). Needs the
    per-device gradients: GAPSL computes them anyway for its selection; SCALA's family and
    PSL measure their norms only under `[train] gradient_shares = "all"`
    (`share_norms`, one backward per device per step)."""
    import math

    finite = [n for n in norms if math.isfinite(n)]
    if factor <= 0 or len(finite) < 3:
        return None
    bound = factor * statistics.median(finite)
    if bound <= 0 or all(n <= bound for n in finite):
        return None
    return bounded_weights(agents, norms, bound, notes, steps, lambda norm, _: (
        f"with its server-gradient share clipped, last: {norm:.4g} over {factor:g}× the "
        f"median {bound / factor:.4g}"))
