"""Split a labelled dataset across clients: IID or with label skew.

Schemes (strings as they appear in configs and on the command line):

- ``iid`` — a random permutation dealt out evenly; covers every sample.
- ``quantity:α`` — quantity-based label skew (SCALA §5.1, the "#C=α" setting of
  NIID-Bench, Li et al. 2022): client i holds label i mod C plus α−1 further distinct labels
  drawn at random (NIID-Bench's reference code; the first label makes every class used
  once there are at least C clients), and each label's samples are split evenly among the
  clients that hold it. Clients therefore differ in label sets and in size.
- ``dirichlet:β`` — distribution-based label skew (SCALA §5.1): for each class, draw the
  clients' shares from Dir(β) and deal that class's samples accordingly. Small β ⇒ strong
  skew.
- ``ampere:α`` — Ampere §5.1: each device draws ONE class distribution vector from
  Dir(α/(1−α+ε)) (ε = 1e-8, α ∈ (0, 1]); samples are then allocated by drawing labels
  from that vector until the device holds its fixed quota (N / K, the sizes differ by at
  most one); a class that runs out is dropped from the vector and the rest renormalised.
  α = 1 is (nearly) IID, the paper's default is α = 0.33.

Everything is drawn from ``np.random.default_rng(seed)``: same seed, same partition.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from jetsplit.errors import ConfigError

__all__ = [
    "AMPERE_EPSILON",
    "PARTITION_SCHEMES",
    "PartitionScheme",
    "label_histogram",
    "parse_scheme",
    "partition",
]

#: The scheme forms :func:`partition` understands, for error messages and ``--help``.
PARTITION_SCHEMES = ("iid", "quantity:ALPHA (int >= 1)", "dirichlet:BETA (> 0)",
                     "ampere:ALPHA (0 < ALPHA <= 1)")  # fmt: skip

#: ε in Ampere's Dir(α/(1−α+ε)).
AMPERE_EPSILON = 1e-8

_MAX_DIRICHLET_TRIES = 100
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_SCHEME_RE = re.compile(
    rf"(?P<iid>iid)|(?P<kind>quantity|dirichlet|ampere):(?P<value>{_NUMBER})"
)


@dataclass(frozen=True)
class PartitionScheme:
    """A parsed scheme string: ``kind`` and its parameter (``None`` for iid)."""

    kind: str
    value: Optional[float] = None


def parse_scheme(scheme: str) -> PartitionScheme:
    """Parse and validate a scheme string strictly; any other form is a one-line error."""
    m = _SCHEME_RE.fullmatch(scheme) if isinstance(scheme, str) else None
    if m is None:
        raise ConfigError(
            f"unknown partition scheme {scheme!r}; expected one of: "
            f"{', '.join(PARTITION_SCHEMES)}"
        )
    if m.group("iid"):
        return PartitionScheme("iid")
    kind, text = m.group("kind"), m.group("value")
    value = float(text)
    if kind == "quantity":
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(
                f"partition scheme {scheme!r}: quantity needs an integer α >= 1 (classes "
                "per client)"
            )
        return PartitionScheme(kind, float(int(text)))
    if kind == "dirichlet" and not (0.0 < value < float("inf")):
        raise ConfigError(f"partition scheme {scheme!r}: dirichlet needs a finite β > 0")
    if kind == "ampere" and not (0.0 < value <= 1.0):
        raise ConfigError(f"partition scheme {scheme!r}: ampere needs 0 < α <= 1")
    return PartitionScheme(kind, value)


def label_histogram(labels: np.ndarray | Sequence[int], num_classes: int) -> list[int]:
    """Samples per class, as plain ints (JSON-safe), length ``num_classes``."""
    y = np.asarray(labels)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    return [int(v) for v in np.bincount(y.astype(np.int64), minlength=num_classes)]


def client_shards(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    seed: int,
    num_classes: Optional[int] = None,
) -> list[np.ndarray]:
    """Each client's indices as its agent cuts them: a lone client holds every sample under
    any scheme (``quantity:α`` alone would leave classes out), more are `partition`'s. The
    agent, the fleet host, `simulate` and the sizes a trial provisions all read this one cut.
    """
    if num_clients == 1:
        return [np.arange(len(labels), dtype=np.int64)]
    return partition(labels, num_clients, scheme, seed, num_classes)


def partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    seed: int,
    num_classes: int | None = None,
    *,
    min_samples: int = 2,
) -> list[np.ndarray]:
    """Indices of each client's samples: sorted int64 arrays, pairwise disjoint.

    ``iid`` and the Dirichlet schemes cover every sample; ``quantity:α`` leaves out classes
    no client holds (only when ``num_clients·α`` < number of classes). Every client gets
    at least one sample, and under the Dirichlet schemes at least
    ``min(min_samples, N // num_clients)``.
    """
    parsed = parse_scheme(scheme)
    y = _validate_labels(labels, num_classes)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
        raise ConfigError(f"num_clients must be an integer, got {num_clients!r}")
    if not 1 <= num_clients <= len(y):
        raise ConfigError(
            f"num_clients must be between 1 and the number of samples ({len(y)}), "
            f"got {num_clients}"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    k = int(num_clients)

    if parsed.kind == "iid":
        shards = np.array_split(rng.permutation(len(y)), k)
    elif parsed.kind == "quantity":
        assert parsed.value is not None
        shards = _quantity(y, k, int(parsed.value), rng, scheme)
    elif parsed.kind == "ampere":
        assert parsed.value is not None
        shards = _ampere(y, k, parsed.value / (1.0 - parsed.value + AMPERE_EPSILON), rng)
    else:
        assert parsed.value is not None
        beta = parsed.value
        floor = max(1, min(int(min_samples), len(y) // k))
        shards = _dirichlet(y, k, beta, floor, rng)
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]


def _validate_labels(labels: np.ndarray | Sequence[int], num_classes: int | None) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise ConfigError(f"labels must be a 1-D integer array, got {y.dtype} {y.shape}")
    if y.size == 0:
        raise ConfigError("labels are empty: nothing to partition")
    if y.min() < 0:
        raise ConfigError(f"labels must be >= 0, found {int(y.min())}")
    if num_classes is not None and y.max() >= num_classes:
        raise ConfigError(f"label {int(y.max())} is out of range for {num_classes} classes")
    return y.astype(np.int64)


def _quantity(
    y: np.ndarray, k: int, alpha: int, rng: np.random.Generator, scheme: str
) -> list[np.ndarray]:
    """NIID-Bench's #C=α: client i takes class i mod C, then α−1 more distinct classes at
    random; a class is split evenly among its holders (classes nobody drew stay out)."""
    classes = np.unique(y)
    per_client = min(alpha, classes.size)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for client in range(k):
        first = int(classes[client % classes.size])
        others = rng.permutation(classes[classes != first])[:per_client - 1]
        for c in (first, *(int(v) for v in others)):
            holders[c].append(client)

    shards: list[list[np.ndarray]] = [[] for _ in range(k)]
    for c, owners in holders.items():
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        for owner, part in zip(owners, np.array_split(idx, len(owners))):
            shards[owner].append(part)
    out = [np.concatenate(parts) for parts in shards]
    empty = [i for i, s in enumerate(out) if s.size == 0]
    if empty:
        raise ConfigError(
            f"partition {scheme!r} leaves client {empty[0]} with no samples "
            f"({len(empty)} empty of {k}); use fewer clients or a larger α"
        )
    return out


def dirichlet_draw(rng: np.random.Generator, alpha: np.ndarray) -> np.ndarray:
    """One draw of Dir(`alpha`): bit for bit what `rng.dirichlet(alpha)` gives on numpy
    2.1 and later, and the same on every numpy a device may run. Where every α < 0.1 numpy
    breaks a stick with Beta draws, and its Beta draws where a power underflows changed
    twice: numpy 1.26 kept a draw that numpy 1.24 and 1.25 (JetPack 5's) rejected, so later
    draws shift, and numpy 2.1 changed the value such a draw gives. Under concentrations
    below about 0.003 two agents on two numpy versions cut different, overlapping shards
    of one partition. Built on `random()` and `standard_gamma()`, whose streams are the
    same on all of them."""
    alphas = [float(a) for a in alpha]
    k = len(alphas)
    if max(alphas) >= 0.1:  # normalised Gamma draws
        gammas = [float(rng.standard_gamma(a)) for a in alphas]
        total = 0.0
        for g in gammas:  # left to right, as numpy does (3.12's sum() compensates)
            total += g
        scale = 1.0 / total if total > 0.0 else math.nan  # all underflowed: the caller's fallback
        return np.array([g * scale for g in gammas])
    rest = [0.0] * k  # rest[j]: α_j + … + α_{k−1}, summed from the end
    total = 0.0
    for j in range(k - 1, -1, -1):
        total += alphas[j]
        rest[j] = total
    draw, stick = [0.0] * k, 1.0
    for j in range(k - 1):
        piece = _beta_draw(rng, alphas[j], rest[j + 1])
        draw[j] = stick * piece
        stick *= 1.0 - piece
    draw[k - 1] = stick
    return np.array(draw)


def _beta_draw(rng: np.random.Generator, a: float, b: float) -> float:
    """Beta(a, b) as numpy 2.1 and later draw it: Jöhnk's method for a, b ≤ 1, in log space
    where a power underflows; a ratio of Gamma draws otherwise."""
    if a > 1.0 or b > 1.0:
        ga = float(rng.standard_gamma(a))
        gb = float(rng.standard_gamma(b))
        return ga / (ga + gb)
    while True:
        u, v = float(rng.random()), float(rng.random())
        x, y = u ** (1.0 / a), v ** (1.0 / b)
        if x + y <= 1.0 and u + v > 0.0:
            if x > 0.0 and y > 0.0:
                return x / (x + y)
            log_x, log_y = math.log(u) / a, math.log(v) / b
            top = max(log_x, log_y)
            log_x, log_y = log_x - top, log_y - top  # one of them is 0: log1p of the other
            if log_x == 0.0:
                return math.exp(-math.log1p(math.exp(log_y)))
            return math.exp(log_x - math.log1p(math.exp(log_x)))


def _ampere(y: np.ndarray, k: int, concentration: float, rng: np.random.Generator
            ) -> list[np.ndarray]:
    """Ampere §5.1: one class vector q_k ~ Dir(concentration) per device; device k draws
    labels from q_k (restricted to classes with samples left, renormalised) until it holds
    its quota, and takes a random remaining sample of each drawn label."""
    classes = np.unique(y)
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in classes]
    quotas = [len(part) for part in np.array_split(np.arange(len(y)), k)]
    vectors = np.array([dirichlet_draw(rng, np.full(classes.size, concentration))
                        for _ in range(k)])
    shards: list[np.ndarray] = []
    for device in range(k):
        want, taken = quotas[device], []
        while want > 0:
            left = np.array([len(p) for p in pools], dtype=np.float64)
            q = np.where(left > 0, np.nan_to_num(vectors[device]), 0.0)
            q = q / q.sum() if q.sum() > 0 else left / left.sum()
            counts = np.minimum(rng.multinomial(want, q), left.astype(np.int64))
            for c in np.flatnonzero(counts):
                taken += pools[c][:counts[c]]
                del pools[c][:counts[c]]
            want -= int(counts.sum())
        shards.append(np.asarray(taken, dtype=np.int64))
    return shards


def _dirichlet(
    y: np.ndarray, k: int, beta: float, floor: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per class, shares over clients ~ Dir(β). Re-drawn (bounded) until every client
    has ``floor`` samples; if that never happens (tiny β, many clients) the last draw
    is topped up from the largest clients so the run can start."""
    classes = np.unique(y)
    by_class = [np.flatnonzero(y == c) for c in classes]
    concentration = np.full(k, beta)
    shards: list[np.ndarray] = []
    for _ in range(_MAX_DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(k)]
        for idx in by_class:
            shares = dirichlet_draw(rng, concentration)
            if not np.all(np.isfinite(shares)) or shares.sum() <= 0:
                shares = np.full(k, 1.0 / k)  # underflow at tiny β: fall back to even
            cuts = (np.cumsum(shares) * idx.size).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(rng.permutation(idx), cuts)):
                parts[client].append(chunk)
        shards = [np.concatenate(p) for p in parts]
        if min(s.size for s in shards) >= floor:
            return shards
    return _top_up(shards, floor, rng)


def _top_up(shards: list[np.ndarray], floor: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Move random samples from the largest shard to each shard under ``floor``."""
    out = [s.copy() for s in shards]
    for i in range(len(out)):
        while out[i].size < floor:
            donor = max(range(len(out)), key=lambda j: out[j].size)
            pick = int(rng.integers(out[donor].size))
            out[i] = np.append(out[i], out[donor][pick])
            out[donor] = np.delete(out[donor], pick)
    return out
