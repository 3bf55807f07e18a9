"""The portable FLOP counter gives torch 2.13's FlopCounterMode numbers (with the grouped-conv
weight-gradient fix) for every op of every zoo layer, forward and backward; the cost model's
numbers did not move when it switched counters; the zoo is found from the installed package."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, conv_backward_flop

from jetsplit.export.cost_model import get_costs, models_dir, zoo_fingerprint
from jetsplit.export.flop_count import FlopCounter
from jetsplit.export.torch_compat import storage_of
from jetsplit.models import MODEL_NAMES, build_model

REPO = Path(__file__).resolve().parents[2]


def _grouped_conv_backward_flop(grad_out_shape: Any, x_shape: Any, w_shape: Any, bias: Any,
                                stride: Any, padding: Any, dilation: Any, transposed: bool,
                                output_padding: Any, groups: int, output_mask: list[bool],
                                out_shape: Any = None, **kwargs: Any) -> int:
    """The cost model's mapping before the portable counter (the reference)."""
    args = (grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed,
            output_padding, groups)
    total = conv_backward_flop(*args, output_mask, out_val=out_shape)
    if groups > 1 and output_mask[1]:
        weight = conv_backward_flop(*args, [False, True, False], out_val=out_shape)
        total -= weight - weight // groups
    return int(total)


def reference() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten.convolution_backward: _grouped_conv_backward_flop})


def both_counts(run: Callable[[], None]) -> tuple[dict[str, int], dict[str, int]]:
    """Per-op counts of ``run`` from the portable counter and from the reference, each on
    its own run (nonzero entries, keyed by aten op name)."""
    with FlopCounter() as ours:
        run()
    with reference() as ref:
        run()
    theirs = {str(op).split(".")[-1]: n
              for op, n in ref.get_flop_counts().get("Global", {}).items() if n}
    return {k: v for k, v in ours.by_op.items() if v}, theirs


def _layer_counts(layer: nn.Module, x: torch.Tensor, input_grad: bool
                  ) -> tuple[tuple[dict[str, int], dict[str, int]], ...]:
    """(ours, reference) for one forward and for the backward of one more forward."""
    inp = x.detach().requires_grad_(input_grad)
    fwd = both_counts(lambda: layer(inp))
    out = layer(inp)
    grad = torch.ones_like(out)
    bwd = both_counts(lambda: torch.autograd.backward(out, grad, retain_graph=True))
    layer.zero_grad(set_to_none=True)
    return fwd, bwd


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_zoo_layer_counts_as_torch_does(name: str) -> None:
    model = build_model(name, (3, 32, 32), 10, seed=0).train()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ops: set[str] = set()
    for i, layer in enumerate(model.children()):
        for input_grad in (False, True):
            fwd, bwd = _layer_counts(layer, x, input_grad)
            assert fwd[0] == fwd[1], (name, i, "forward", input_grad)
            assert bwd[0] == bwd[1], (name, i, "backward", input_grad)
            ops |= set(fwd[0]) | set(bwd[0])
        with torch.no_grad():
            x = layer(x)
    assert "convolution" in ops and "convolution_backward" in ops and "addmm" in ops


OPS: dict[str, Callable[[], torch.Tensor]] = {
    "linear_3d": lambda: F.linear(torch.randn(2, 5, 8, requires_grad=True),
                                  torch.randn(6, 8, requires_grad=True), torch.randn(6)),
    "addmm": lambda: torch.addmm(torch.randn(3, 4), torch.randn(3, 5, requires_grad=True),
                                 torch.randn(5, 4, requires_grad=True)),
    "baddbmm": lambda: torch.baddbmm(torch.randn(2, 3, 4), torch.randn(2, 3, 5),
                                     torch.randn(2, 5, 4, requires_grad=True)),
    "matmul_4d": lambda: torch.randn(2, 3, 4, 5, requires_grad=True) @ torch.randn(2, 3, 5, 6),
    "conv1d_grouped": lambda: F.conv1d(torch.randn(2, 4, 9, requires_grad=True),
                                       torch.randn(6, 2, 3, requires_grad=True), groups=2),
    "conv2d_depthwise_strided": lambda: F.conv2d(
        torch.randn(2, 8, 9, 9), torch.randn(8, 1, 5, 5, requires_grad=True), stride=2,
        padding=2, groups=8),
    "conv_transpose2d_grouped": lambda: F.conv_transpose2d(
        torch.randn(2, 4, 5, 5, requires_grad=True), torch.randn(4, 3, 3, 3, requires_grad=True),
        stride=2, groups=2),
    "conv3d": lambda: F.conv3d(torch.randn(1, 2, 4, 4, 4, requires_grad=True),
                               torch.randn(3, 2, 2, 2, 2, requires_grad=True)),
}


@pytest.mark.parametrize("op", OPS)
def test_ops_beyond_the_zoo_count_as_torch_does(op: str) -> None:
    """Forward + backward together, with inputs that do and do not need a gradient."""
    def run() -> None:
        torch.manual_seed(0)
        out = OPS[op]()
        out.sum().backward()

    ours, theirs = both_counts(run)
    assert ours == theirs and ours


def test_hand_counts_for_a_linear_and_a_depthwise_conv() -> None:
    fc = nn.Linear(8, 6)
    x = torch.randn(3, 8, requires_grad=True)
    with FlopCounter() as counter:
        fc(x).sum().backward()
    # forward 2·3·8·6; backward: input grad and weight grad, a forward's worth each
    assert counter.by_op == {"addmm": 2 * 3 * 8 * 6, "mm": 2 * 2 * 3 * 8 * 6}
    dw = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
    with FlopCounter() as counter:
        dw(torch.randn(2, 4, 6, 6)).sum().backward()  # no input gradient: weight grad only
    forward = 2 * 2 * 4 * 9 * 6 * 6
    assert counter.by_op == {"convolution": forward, "convolution_backward": forward}


# Totals from the cost model before the portable counter (FlopCounterMode + grouped fix),
# 10 classes: (Σ fwd, Σ bwd, Σ bwd without input grad, Σ aux fwd + bwd) per sample.
BEFORE = {
    ("mobilenetv3-small", (3, 32, 32)): (11005440.0, 22010880.0, 15959040.0, 13654848.0),
    ("alexnet", (1, 28, 28)): (85283328.0, 170566656.0, 85283328.0, 127865004.0),
}


@pytest.mark.parametrize(("name", "shape"), BEFORE)
def test_cost_model_flops_are_unchanged(name: str, shape: tuple[int, int, int],
                                        tmp_path: Path) -> None:
    costs = get_costs(name, shape, 10, cache_dir=tmp_path, use_cache=False)
    got = (sum(la.fwd_flops for la in costs.layers), sum(la.bwd_flops for la in costs.layers),
           sum(la.bwd_flops_no_input_grad for la in costs.layers),
           sum(a.fwd_flops + a.bwd_flops for a in costs.aux))
    assert got == BEFORE[(name, shape)]


def test_zoo_is_found_from_the_installed_package() -> None:
    spec = importlib.util.find_spec("jetsplit.models")
    assert spec is not None and spec.submodule_search_locations
    expected = Path(list(spec.submodule_search_locations)[0]).resolve()
    assert models_dir() == expected and (expected / "zoo.py").is_file()


def test_fingerprint_works_in_a_wheel_layout(tmp_path: Path) -> None:
    """As a wheel installs it: site/jetsplit/{models,export}, no repository around it."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "jetsplit", site / "jetsplit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "export", site / "jetsplit" / "export",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("from jetsplit.export.cost_model import models_dir, zoo_fingerprint; "
            "print(models_dir()); print(zoo_fingerprint()[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(site)}, timeout=120, check=True)
    where, version = out.stdout.split()
    assert Path(where) == (site / "jetsplit" / "models").resolve()
    assert int(version) == zoo_fingerprint()[0]


def test_storage_of_sees_one_storage_through_views() -> None:
    base = torch.zeros(4, 6)
    assert storage_of(base.t()) == storage_of(base[1:]) == (base.data_ptr(), 4 * 6 * 4)

    class Old:  # torch 1.13: no untyped_storage, only storage()
        def storage(self) -> Any:
            return base.untyped_storage()

    assert storage_of(Old()) == storage_of(base)
