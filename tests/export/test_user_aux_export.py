"""The aux head of a user network's block (pooled features + hidden layer + classifier)
through a bundle: exported to ONNX and run in ONNX Runtime against PyTorch, and rebuilt from
the bundle (what an agent does) as the very head the coordinator built."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from jetsplit.bundle import load_bundle
from jetsplit.export.bundle_writer import ONNX_ATOL, write_bundle
from jetsplit.models import ModelSpec, activation_shape, build_aux_head, build_model
from jetsplit.runtimes.onnx_runtime import CPU_EP, OnnxBlock

TINY = ModelSpec("usernets:tiny_resnet", (3, 16, 16), 10)
TOKENS = ModelSpec("usernets:token_net", (3, 16, 16), 10)


@pytest.mark.parametrize(("spec", "cut", "params"), [
    (TINY, 1, 314),    # (8,16,16): channel means of a feature map
    (TINY, 6, 442),    # (16,8,8)
    (TINY, 8, 442),    # (16,1,1)
    (TINY, 9, 442),    # (16,): a vector, no pooling
    (TOKENS, 3, 314),  # (16,8): token means
    (TOKENS, 7, 442),  # (16,) inside the user's own classifier
], ids=["tiny-1", "tiny-6", "tiny-8", "tiny-9", "tokens-3", "tokens-7"])
def test_the_aux_head_exports_and_rebuilds_from_the_bundle(spec: ModelSpec, cut: int,
                                                           params: int, tmp_path: Path
                                                           ) -> None:
    report = write_bundle(spec, cut, tmp_path / "b", seed=0, aux_ratio=0.5)
    assert 0.0 <= max(report.max_abs_diff["aux"].values()) <= ONNX_ATOL
    bundle = load_bundle(tmp_path / "b")
    head = bundle.aux_module().eval()
    assert sum(p.numel() for p in head.parameters()) == params
    # The writer seeds the head with seed + 1; the rebuilt one carries the shipped weights.
    want = build_aux_head(build_model(spec, seed=0), cut, 0.5, seed=1).state_dict()
    got = head.state_dict()
    assert list(got) == list(want) == ["hidden.fc.weight", "hidden.fc.bias",
                                       "classifier.weight", "classifier.bias"]
    assert all(torch.equal(got[n], want[n]) for n in want)
    x = torch.randn(5, *activation_shape(build_model(spec, seed=0), cut)) * 3
    with torch.no_grad():
        torch_out = head(x).numpy()
    onnx_out = OnnxBlock(bundle.aux_onnx, providers=[CPU_EP]).run(x.numpy())
    assert onnx_out.shape == (5, 10)
    np.testing.assert_allclose(onnx_out, torch_out, rtol=0, atol=ONNX_ATOL)
