"""How uploads combine: FedAvg's sample-weighted mean (McMahan et al.; SplitFed's Fed
server), layer-wise over mixed cuts, and the robust rules chosen by `[train] aggregator`.

FedAvg trusts every upload: one enrolled device that scales its weights by 1,000 wrecks a
run (docs/results-robustness.md). These rules bound what one device can do to an average, for every
block devices send (client blocks, aux heads, a SHeRL-FL edge's block, FedAvg's whole
model), layer by layer over mixed cuts like `layerwise_fedavg`:

- `mean`: the |D_k|-weighted mean, FedAvg's rule (the papers'; the default).
- `clipped`: norm-clipped FedAvg. Each device's update w_k − g (g: the block it started
  from) is scaled down to at most `clip_factor` × the median update norm, then averaged
  with |D_k| weights (as in DP-FedAvg's fixed clipping, with an adaptive bound).
- `median`: the coordinate-wise median (Yin et al., 2018), unweighted.
- `trimmed-mean`: per coordinate, the ⌊β·n⌋ largest and smallest values dropped, the rest
  averaged, unweighted (Yin et al., 2018); β = `robust_fraction`.
- `multi-krum`: each device scored by the summed squared distances to its n − f − 2
  nearest others; the n − f best kept and averaged with |D_k| weights (Blanchard et al.,
  2017); f = ⌊β·n⌋, at most (n − 3) / 2.

Before any rule, a device whose update is more than `outlier_bound` × the median update
norm (over at least three devices) is left out of that average: scaled or noisy weights are
hundreds of times the typical update, a healthy honest one is not (a tiny device training
BatchNorm on batches of 3 can be far over it: left out, like a broken one). Where nobody is over it
every rule gives the same bits as without it; it keeps one upload from owning the `mean`.

Integer buffers (BatchNorm's `num_batches_tracked`) take the element-wise max under
`mean` and the element-wise median under the robust rules, so no single device sets them.
Each rule notes per device what it did (clipped by how much, left out), for the round's
books, and its *share*: the weight its upload carried in the result, averaged over the
float parameters of the layers it holds (|D_k| / Σ|D| under `mean`; scaled by its clip
under `clipped`; 0 when Multi-Krum leaves it out; for the coordinate-wise rules, how often
its value was the one kept, over the number kept). An honest fleet's shares follow its
sizes; a device the rule bounds shows up as a share near 0. The coordinate-wise rules need
no reference; `clipped` without one clips around the coordinate-wise median.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping

import numpy as np

Arrays = dict[str, np.ndarray]


def fedavg(states: Mapping[str, Arrays], weights: Mapping[str, float]) -> Arrays:
    """Weighted mean per tensor over agents (in id order, so the sum is reproducible).

    Float tensors are averaged in float64 and cast back; integer buffers (BatchNorm's
    `num_batches_tracked`) take the maximum, which is what a single model would have seen.
    """
    agents = sorted(states)
    if not agents:
        raise ValueError("fedavg of no models")
    total = float(sum(weights[a] for a in agents))
    names = list(states[agents[0]])
    for agent in agents[1:]:
        if list(states[agent]) != names:
            raise ValueError(f"agent {agent} sent tensors that differ from {agents[0]}'s")
    out: Arrays = {}
    for name in names:
        first = states[agents[0]][name]
        if np.issubdtype(first.dtype, np.floating):
            out[name] = _weighted_sum(
                [states[a][name] for a in agents], [weights[a] / total for a in agents])
        else:
            out[name] = np.max(np.stack([states[a][name] for a in agents]), axis=0)
    return out


FEDAVG_CHUNK = 1 << 18  # elements per float64 slice of one tensor's weighted sum


def _weighted_sum(arrays: list[np.ndarray], factors: list[float]) -> np.ndarray:
    """Σ_k factor_k · array_k in float64, cast back to the first array's dtype, a slice
    of FEDAVG_CHUNK elements at a time: every element sees exactly the operations, in the
    same order, of the whole-tensor sum, so the result is the same bits, while the float64
    temporaries stay a few MiB instead of three times the largest tensor (an AlexNet
    server block's 38M-element layer: 900 MB per average)."""
    first = arrays[0]
    flats = [np.ravel(a) for a in arrays]
    out = np.empty(first.size, first.dtype)
    for start in range(0, first.size, FEDAVG_CHUNK):
        stop = min(start + FEDAVG_CHUNK, first.size)
        acc = np.zeros(stop - start, np.float64)
        for flat, factor in zip(flats, factors, strict=True):
            acc += flat[start:stop].astype(np.float64) * factor
        out[start:stop] = acc.astype(first.dtype)
    return out.reshape(first.shape)


def layerwise(states: Mapping[str, Arrays], weights: Mapping[str, float],
              combine: Callable[[Mapping[str, Arrays], Mapping[str, float]], Arrays]) -> Arrays:
    """`combine` of each tensor over the agents that hold it: devices at different cuts hold
    different layers (server/cuts/completions.py), so layer l combines the devices with c_k ≥ l.
    Tensors held by the same agents are combined together, in first-seen order."""
    agents = sorted(states)
    names: dict[str, None] = {}  # first-seen order, agents in id order
    for agent in agents:
        names.update(dict.fromkeys(states[agent]))
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        groups.setdefault(tuple(a for a in agents if name in states[a]), []).append(name)
    out: Arrays = {}
    for holders, group in groups.items():
        out.update(combine({a: {n: states[a][n] for n in group} for a in holders}, weights))
    return {n: out[n] for n in names}


def layerwise_fedavg(states: Mapping[str, Arrays], weights: Mapping[str, float]) -> Arrays:
    """FedAvg layer by layer over each layer's holders (weights renormalised over them).
    Where every agent holds every tensor this is `fedavg`, bit for bit."""
    return layerwise(states, weights, fedavg)



AGGREGATORS = ("mean", "clipped", "median", "trimmed-mean", "multi-krum")
DEFAULT_CLIP_FACTOR = 2.0
DEFAULT_ROBUST_FRACTION = 0.2
DEFAULT_OUTLIER_BOUND = 10.0  # [train] outlier_bound: × the median update norm; 0 off

Notes = dict[str, str]  # agent → what a rule did to its upload this time


class Shares:
    """Each device's share of the aggregates of a round, averaged over the parameters of
    every layer group it was in (devices at different cuts hold different layers)."""

    def __init__(self) -> None:
        self._weighted: dict[str, float] = {}
        self._params: dict[str, int] = {}

    def add(self, shares: Mapping[str, float], params: int) -> None:
        """One layer group's shares, over `params` float parameters."""
        for agent, share in shares.items():
            self._weighted[agent] = self._weighted.get(agent, 0.0) + share * params
            self._params[agent] = self._params.get(agent, 0) + params

    def result(self) -> dict[str, float]:
        return {a: round(self._weighted[a] / p, 6) for a, p in sorted(self._params.items()) if p}

    def clear(self) -> None:
        self._weighted.clear()
        self._params.clear()


def _normalised(weights: Mapping[str, float], agents: list[str]) -> dict[str, float]:
    """|D_k| / Σ|D| over `agents` (sizes are positive: `claims.registered_size`)."""
    total = float(sum(weights[a] for a in agents))
    return {a: float(weights[a]) / total for a in agents}


def _kept_counts(order: np.ndarray, devices: int, low: int, high: int) -> np.ndarray:
    """Per device, how many of its values (over the coordinates of `order`, the devices'
    sorted positions per coordinate) sat at sorted positions low..high-1."""
    return np.bincount(order[low:high].ravel(), minlength=devices)


def _kept_shares(counts: np.ndarray, agents: list[str], coords: int, kept: int
                 ) -> dict[str, float]:
    """Each device's share of a coordinate-wise rule that averages `kept` sorted positions
    over `coords` coordinates: each kept value counts 1/kept (`counts`: `_kept_counts`
    summed over the tensor)."""
    return {a: float(counts[i]) / (max(1, coords) * kept) for i, a in enumerate(agents)}


def _floats(states: Mapping[str, Arrays], agents: list[str]) -> list[str]:
    return [n for n, v in states[agents[0]].items() if np.issubdtype(v.dtype, np.floating)]


def _with_integers(states: Mapping[str, Arrays], agents: list[str], floats: Arrays) -> Arrays:
    """`floats` plus the integer buffers, each the element-wise median over all devices
    (rounded down), in the states' order: no single device sets a counter."""
    out: Arrays = {}
    for n, first in states[agents[0]].items():
        if n in floats:
            out[n] = floats[n]
        else:
            stacked = np.stack([states[a][n] for a in agents])
            out[n] = np.floor(np.median(stacked, axis=0)).astype(first.dtype)
    return out


def _update_norm(state: Arrays, names: list[str], reference: Arrays) -> float:
    """‖state − reference‖ over the float tensors `names`, without a float64 copy of the
    block: each tensor's difference in float32 (exact where the two are close, as an update
    is), its squares summed per tensor; again in float64 only where that overflowed, so a
    huge update reads as huge, never as infinite. On 10 uploads of AlexNet's 24M parameters
    the float64 vectors took most of a round's average."""
    def total(dtype: type) -> float:
        squares = 0.0
        for n in names:
            d = (state[n].astype(dtype, copy=False) - reference[n].astype(dtype, copy=False)
                 ).ravel()
            squares += float(np.dot(d, d))
        return squares

    with np.errstate(over="ignore", invalid="ignore"):
        fast = total(np.float32)
    return float(np.sqrt(fast if np.isfinite(fast) else total(np.float64)))


CHUNK = 1 << 20  # coordinates per slice of a coordinate-wise rule (10 devices: 80 MB)


def _columns(states: Mapping[str, Arrays], agents: list[str], name: str
             ) -> Iterator[tuple[slice, np.ndarray]]:
    """Tensor `name` of every device, flattened, `CHUNK` coordinates at a time: (the slice,
    the devices' values there as a float64 (devices, coordinates) array). A coordinate-wise
    rule over each slice gives the bits it gives over the whole tensor, without a float64
    copy of every upload (and the sort order beside it), which on a large model holds dozens
    of uploads' worth of memory (docs/results-robustness.md#robust-aggregation-rules)."""
    flat = [states[a][name].reshape(-1) for a in agents]
    for start in range(0, flat[0].size, CHUNK):
        part = slice(start, min(start + CHUNK, flat[0].size))
        yield part, np.stack([f[part].astype(np.float64) for f in flat])


def _coordinate_wise(states: Mapping[str, Arrays], agents: list[str], shares: Shares | None,
                     low: int, high: int,
                     rule: Callable[[np.ndarray, np.ndarray | None], np.ndarray], *,
                     sorts: bool) -> Arrays:
    """Every float tensor through `rule` ((a (devices, coordinates) slice, its stable
    argsort along the devices where the rule `sorts` or shares are kept, else None) → the
    merged coordinates), slice by slice; each device's share of it in `shares`: how often
    its value sat at sorted positions low..high-1, the ones the rule averages."""
    floats = {}
    for n in _floats(states, agents):
        first = states[agents[0]][n]
        merged = np.empty(first.size, first.dtype)
        counts = np.zeros(len(agents), np.int64)
        for part, stacked in _columns(states, agents, n):
            order = np.argsort(stacked, axis=0, kind="stable") \
                if sorts or shares is not None else None
            merged[part] = rule(stacked, order)
            if order is not None and shares is not None:
                counts += _kept_counts(order, len(agents), low, high)
        floats[n] = merged.reshape(first.shape)
        if shares is not None:
            shares.add(_kept_shares(counts, agents, first.size, high - low), first.size)
    return _with_integers(states, agents, floats)


def median(states: Mapping[str, Arrays], weights: Mapping[str, float],
           reference: Arrays | None = None, notes: Notes | None = None,
           shares: Shares | None = None, **_: float) -> Arrays:
    agents = sorted(states)
    middle = (len(agents) - 1) // 2, len(agents) // 2 + 1  # one (odd n) or the two middle
    return _coordinate_wise(states, agents, shares, *middle,
                            lambda stacked, _: np.median(stacked, axis=0), sorts=False)


def trimmed_mean(states: Mapping[str, Arrays], weights: Mapping[str, float],
                 reference: Arrays | None = None, notes: Notes | None = None,
                 shares: Shares | None = None, *,
                 robust_fraction: float = DEFAULT_ROBUST_FRACTION, **_: float) -> Arrays:
    agents = sorted(states)
    trim = trimmed_count(len(agents), robust_fraction)
    return _coordinate_wise(states, agents, shares, trim, len(agents) - trim,
                            lambda stacked, order: np.take_along_axis(stacked, order, axis=0)[
                                trim:len(agents) - trim].mean(axis=0), sorts=True)


def trimmed_count(n: int, fraction: float) -> int:
    """Values dropped at each end: ⌊β·n⌋, leaving at least one."""
    return max(0, min(math.floor(fraction * n), (n - 1) // 2))


def clipped(states: Mapping[str, Arrays], weights: Mapping[str, float],
            reference: Arrays | None = None, notes: Notes | None = None,
            shares: Shares | None = None, *,
            clip_factor: float = DEFAULT_CLIP_FACTOR, **_: float) -> Arrays:
    agents = sorted(states)
    names = _floats(states, agents)
    if reference is None or any(n not in reference for n in names):
        reference = median(states, weights)
    norms = {a: _update_norm(states[a], names, reference) for a in agents}
    bound = clip_factor * float(np.median(list(norms.values())))
    total = float(sum(weights[a] for a in agents))
    kept: dict[str, float] = {}
    for a in agents:
        scale = 1.0 if norms[a] <= bound else bound / norms[a]
        if scale < 1.0 and notes is not None:
            notes[a] = f"clipped ×{scale:.3g} (update norm {norms[a]:.3g} > {bound:.3g})"
        kept[a] = scale * weights[a] / total
    if shares is not None:
        shares.add(kept, sum(reference[n].size for n in names))
    floats = {}
    for n in names:  # one tensor at a time in float64: never a copy of every upload
        ref = reference[n].astype(np.float64)
        merged = ref.copy()
        for a in agents:
            merged += kept[a] * (states[a][n].astype(np.float64) - ref)
        floats[n] = merged.astype(states[agents[0]][n].dtype)
    return _with_integers(states, agents, floats)


def krum_kept(n: int, fraction: float) -> tuple[int, int]:
    """(f, devices kept) for Multi-Krum over n: f = ⌊β·n⌋ bounded by n > 2f + 2."""
    f = max(0, min(math.floor(fraction * n), (n - 3) // 2))
    return f, n - f


def multi_krum(states: Mapping[str, Arrays], weights: Mapping[str, float],
               reference: Arrays | None = None, notes: Notes | None = None,
               shares: Shares | None = None, *,
               robust_fraction: float = DEFAULT_ROBUST_FRACTION, **_: float) -> Arrays:
    agents = sorted(states)
    f, keep = krum_kept(len(agents), robust_fraction)
    names = _floats(states, agents)
    kept = agents
    if f > 0 and names:  # too few devices to leave any out, or only integers: keep all
        distances = np.zeros((len(agents), len(agents)))
        for i, j in itertools.combinations(range(len(agents)), 2):  # no copy of every upload
            distances[i, j] = distances[j, i] = _update_norm(
                states[agents[i]], names, states[agents[j]]) ** 2
        neighbours = len(agents) - f - 2
        scores = [float(np.sort(np.delete(distances[i], i))[:neighbours].sum())
                  for i in range(len(agents))]
        order = sorted(range(len(agents)), key=lambda i: (scores[i], agents[i]))
        kept = sorted(agents[i] for i in order[:keep])
        if notes is not None:
            for i in order[keep:]:
                notes[agents[i]] = f"left out by multi-krum (score {scores[i]:.6g})"
    merged = fedavg({a: {n: states[a][n] for n in names} for a in kept}, weights)
    if shares is not None:
        share = _normalised(weights, kept)
        shares.add({a: share.get(a, 0.0) for a in agents}, _float_params(states, agents, names))
    return _with_integers(states, agents, merged)


def _float_params(states: Mapping[str, Arrays], agents: list[str], names: list[str]) -> int:
    return sum(int(states[agents[0]][n].size) for n in names)


def mean(states: Mapping[str, Arrays], weights: Mapping[str, float],
         reference: Arrays | None = None, notes: Notes | None = None,
         shares: Shares | None = None, **_: float) -> Arrays:
    """FedAvg's |D_k|-weighted mean (`aggregation.fedavg`), with each device's share."""
    if shares is not None:
        agents = sorted(states)
        shares.add(_normalised(weights, agents),
                   _float_params(states, agents, _floats(states, agents)))
    return fedavg(states, weights)


def without_outliers(states: Mapping[str, Arrays], factor: float,
                     reference: Arrays | None = None, notes: Notes | None = None,
                     shares: Shares | None = None) -> list[str]:
    """The devices (sorted) whose update norm is at most `factor` × the median update norm;
    the others are noted and given a share of 0. Updates are taken from `reference` (the
    block they started from), else from the coordinate-wise median. Fewer than three
    devices, no float tensors, a median norm of 0 or `factor` 0: everybody is kept."""
    agents = sorted(states)
    names = _floats(states, agents)
    if factor <= 0 or len(agents) < 3 or not names:
        return agents
    if reference is None or any(n not in reference for n in names):
        reference = median(states, {a: 1.0 for a in agents})
    norms = {a: _update_norm(states[a], names, reference) for a in agents}
    typical = float(np.median(list(norms.values())))
    if not typical > 0:
        return agents
    out = [a for a in agents if norms[a] > factor * typical]
    for a in out:
        if notes is not None:
            notes[a] = (f"left out: update norm {norms[a]:.3g} over {factor:g}× the median "
                        f"{typical:.3g}")
    if out and shares is not None:
        shares.add(dict.fromkeys(out, 0.0), _float_params(states, agents, names))
    return [a for a in agents if a not in out]


Rule = Callable[..., Arrays]
RULES: dict[str, Rule] = {"mean": mean, "clipped": clipped, "median": median,
                          "trimmed-mean": trimmed_mean, "multi-krum": multi_krum}


def aggregate(states: Mapping[str, Arrays], weights: Mapping[str, float], rule: str, *,
              reference: Arrays | None = None, notes: Notes | None = None,
              shares: Shares | None = None, clip_factor: float = DEFAULT_CLIP_FACTOR,
              robust_fraction: float = DEFAULT_ROBUST_FRACTION,
              outlier_bound: float = 0.0, outliers: set[str] | None = None) -> Arrays:
    """`rule` over the devices' uploads, layer by layer over the devices that hold each
    layer (mixed cuts), each layer group's outliers left out first (`without_outliers`,
    off at 0; those left out of any group are added to `outliers`); `reference` is the
    block they started from."""
    combine = RULES[rule]

    def one_group(group: Mapping[str, Arrays], group_weights: Mapping[str, float]) -> Arrays:
        kept = without_outliers(group, outlier_bound, reference, notes, shares)
        if len(kept) < len(group):
            if outliers is not None:
                outliers.update(set(group) - set(kept))
            group = {a: group[a] for a in kept}
        return combine(group, group_weights, reference, notes, shares, clip_factor=clip_factor,
                       robust_fraction=robust_fraction)

    return layerwise(states, weights, one_group)
