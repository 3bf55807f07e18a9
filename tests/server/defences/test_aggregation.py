"""FedAvg and its layer-wise form by hand (fast tier; imports no torch, so that mutation
testing of server/defences/aggregators.py runs it in seconds per mutant)."""

from __future__ import annotations

import numpy as np
import pytest

from jetsplit.server.defences.aggregators import fedavg, layerwise_fedavg

pytestmark = pytest.mark.fast



def test_fedavg_weights_each_agent_by_its_share_of_the_total() -> None:
    """(1·1 + 4·3 + 0·4) / 8 and (2·1 + 8·3 + 0·4) / 8; integer buffers take the
    element-wise max over agents; agents whose tensors differ, or none, are refused."""
    states = {"b": {"w": np.array([4.0, 8.0], np.float32), "n": np.array([3, 9])},
              "a": {"w": np.array([1.0, 2.0], np.float32), "n": np.array([7, 1])},
              "c": {"w": np.array([0.0, 0.0], np.float32), "n": np.array([5, 5])}}
    out = fedavg(states, {"a": 1, "b": 3, "c": 4})
    assert out["w"].dtype == np.float32 and out["w"].tolist() == [1.625, 3.25]
    assert out["n"].tolist() == [7, 9]
    with pytest.raises(ValueError, match="no models"):
        fedavg({}, {})
    for odd, names in (("b", ["w"]), ("c", ["w", "n", "x"])):  # fewer, more than a's
        bad = {**states, odd: {n: np.zeros(2) for n in names}}
        with pytest.raises(ValueError, match=f"agent {odd} sent tensors that differ from a's"):
            fedavg(bad, {"a": 1, "b": 3, "c": 4})


def test_layerwise_fedavg_renormalises_over_each_layers_holders() -> None:
    """Devices at different cuts: l1 is held by a, b, c (weights 1, 2, 3: (2 + 8 + 24) / 6);
    l2 only by a and c, so its weights are 1 and 3 out of 4, not out of 6: (10 + 120) / 4."""
    states = {"a": {"l1": np.array([2.0]), "l2": np.array([10.0])},
              "b": {"l1": np.array([4.0])},
              "c": {"l1": np.array([8.0]), "l2": np.array([40.0])}}
    out = layerwise_fedavg(states, {"a": 1, "b": 2, "c": 3})
    assert list(out) == ["l1", "l2"]
    assert out["l1"].tolist() == pytest.approx([34 / 6], abs=1e-12)
    assert out["l2"].tolist() == [32.5]


@pytest.mark.parametrize("chunk", [1, 7, 1 << 18])
def test_fedavg_in_slices_is_the_whole_tensor_sum_bit_for_bit(
        chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weighted sum a slice at a time (FEDAVG_CHUNK elements) against the whole-tensor
    float64 sum it replaced: sizes that are and are not multiples of the slice, a
    transposed (non-contiguous) upload, float16 and float32, a scalar, an empty tensor,
    five agents with unequal weights; every bit equal, shapes and dtypes kept."""
    from jetsplit.server.defences import aggregators

    monkeypatch.setattr(aggregators, "FEDAVG_CHUNK", chunk)
    rng = np.random.default_rng(0)
    shapes = {"w": (5, 9), "t": (9, 5), "h": (23,), "s": (), "e": (0, 3)}
    dtypes = {"w": np.float32, "t": np.float32, "h": np.float16, "s": np.float32,
              "e": np.float32}
    states = {}
    for agent in "abcde":
        arrays = {n: rng.standard_normal(shape).astype(dtypes[n]) * 1e3 for n, shape in
                  shapes.items()}
        arrays["t"] = np.ascontiguousarray(arrays["t"].T).T  # non-contiguous view
        states[agent] = arrays
    weights = {"a": 40, "b": 70, "c": 130, "d": 1, "e": 3}
    total = float(sum(weights.values()))
    out = fedavg(states, weights)
    for name in shapes:
        want = np.zeros(shapes[name], np.float64)
        for agent in sorted(states):
            want += states[agent][name].astype(np.float64) * (weights[agent] / total)
        want = want.astype(dtypes[name])
        assert out[name].shape == want.shape and out[name].dtype == want.dtype, name
        assert out[name].tobytes() == want.tobytes(), name
    assert not states["a"]["t"].flags.c_contiguous
