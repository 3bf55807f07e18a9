"""The same partition on every numpy a device may run.

Each agent cuts its own shard from the seeded partition of the whole training split, so two
agents on different numpy (a JetPack 5 device with numpy 1.17 to 1.24 beside a JetPack 6
one, or beside the coordinator that provisions their sizes) must draw the same partition,
or their shards overlap and leave samples out. numpy changed how `Generator.dirichlet`
draws when every concentration is under 0.1 and its Beta draws underflow, twice: numpy 1.26
kept draws that 1.24 and 1.25 rejected, numpy 2.1 changed the value they give. With numpy's
own draws, numpy 1.24 cut other shards than numpy 2 under `dirichlet:0.001`,
`dirichlet:1e-5`, `ampere:0.001` and `ampere:1e-6` (each digest below differed), the same
under the rest. `dirichlet_draw` gives numpy 2.1's bits from the draws that did not change
(checked against numpy 1.25.2, 1.26.4, 2.0.2 and 2.1.0 by hand: 0 of 8,800 draws differ
from 2.1.0's, 144 from 2.0.2's and 1.26.4's). The digests
were taken on numpy 2.4; `.ci/run` runs this file again on Python 3.8 with numpy 1.24 and
on Python 3.9 with numpy 2.0 (device_pure).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from jetsplit.data.partition import dirichlet_draw, partition

pytestmark = pytest.mark.device_pure

LABELS = np.repeat(np.arange(10), 40)  # 10 classes × 40 samples
#: (scheme, clients, seed) → the first 16 hex digits of the SHA-256 of the shards, in order.
DIGESTS = {
    ("dirichlet:0.5", 10, 0): "7a2b9f17f352115d",
    ("dirichlet:0.01", 20, 5): "be242bfc0c73ba90",
    ("dirichlet:0.001", 10, 3): "bb9c7ef52d4276df",
    ("dirichlet:1e-5", 8, 1): "32ad730e9229a77c",
    ("ampere:0.33", 10, 0): "87e79d15260fb43b",
    ("ampere:0.001", 6, 1): "4b0a1c07d256356d",
    ("ampere:1e-6", 4, 2): "86536b01ffef3c80",
    ("quantity:2", 7, 0): "4d6163b2e0baa652",
    ("iid", 5, 0): "f01470f40e24507b",
}


@pytest.mark.parametrize("case", list(DIGESTS), ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_the_partition_is_the_one_numpy_2_drew(case: tuple[str, int, int]) -> None:
    scheme, clients, seed = case
    parts = partition(LABELS, clients, scheme, seed, 10)
    digest = hashlib.sha256(b"".join(p.astype("<i8").tobytes() + b"|" for p in parts))
    assert digest.hexdigest()[:16] == DIGESTS[case]


NEW_DIRICHLET = tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 1)


@pytest.mark.skipif(not NEW_DIRICHLET, reason="numpy before 2.1 draws underflowing Betas "
                                              "otherwise")
@pytest.mark.parametrize("alpha", [[2.0, 0.5, 1.0], [0.5] * 10, [0.1] * 4, [0.05] * 10,
                                   [0.01, 0.005, 0.02], [0.003] * 2, [1e-3] * 3])
def test_each_draw_is_numpys_own_bit_for_bit(alpha: list[float]) -> None:
    """Against `Generator.dirichlet` itself, the Gamma and the stick-breaking paths, and the
    stream left behind (the next draw is the same too). Over 40 seeds: at `[1e-3] * 3`
    seed 29's second draw takes the log-space path where numpy 2.1's log1p and a plain log
    differ in the last bit."""
    for seed in range(40):
        ours, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
        mine = np.array([dirichlet_draw(ours, np.array(alpha)) for _ in range(4)])
        assert np.array_equal(mine, theirs.dirichlet(np.array(alpha), size=4))
        assert ours.random() == theirs.random()
