"""Cost model: FLOPs match the analytic formulas, memory is measured and linear in batch,
codecs size activations right, the cache is fast, torch-free and survives corruption."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from jetsplit.errors import ConfigError
from jetsplit.export.cost_model import (
    CODEC_BYTES,
    INT8_PARAM_BYTES,
    OPTIMIZER_STATE,
    activation_bytes,
    aux_block,
    cache_path,
    client_block,
    count_costs,
    flop_counter,
    get_costs,
    predict_layer_times,
    runtime_context_bytes,
    server_block,
    training_memory,
    zoo_fingerprint,
)
from jetsplit.models import MODEL_NAMES, ZOO_VERSION, build_aux_head, build_model, split
from jetsplit.profiles import resolve_profile

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cost cache per test session, shared by every module that plans."""
    return tmp_path_factory.getbasetemp() / "jetsplit-cache" / "costs"


def costs_of(cache_dir: Path, name: str, shape: tuple[int, int, int] = (3, 32, 32)):
    return get_costs(name, shape, 10, cache_dir=cache_dir)


def _analytic(module: nn.Module, in_shape: list[int]) -> float:
    """2·Cin/groups·Cout·k²·Hout·Wout for a conv, 2·in·out for a linear (no bias term)."""
    if isinstance(module, nn.Conv2d):
        _, h, w = in_shape
        (kh, kw), (sh, sw), (ph, pw) = module.kernel_size, module.stride, module.padding
        hout, wout = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        return 2 * module.in_channels // module.groups * module.out_channels * kh * kw * hout * wout
    assert isinstance(module, nn.Linear)
    return 2 * module.in_features * module.out_features


@pytest.mark.parametrize("name", ["alexnet", "vgg11", "vgg16"])
def test_forward_flops_match_analytic_counts(cache_dir: Path, name: str) -> None:
    model = build_model(name, seed=0)
    costs = costs_of(cache_dir, name)
    for layer, cost in zip(model.children(), costs.layers, strict=True):
        inner = layer.conv if hasattr(layer, "conv") else layer.fc
        assert cost.fwd_flops == _analytic(inner, cost.in_shape), cost.name
        # backward = input gradient + weight gradient, each a forward's worth
        assert cost.bwd_flops == 2 * cost.fwd_flops
        first_has_no_input_grad = cost.bwd_flops_no_input_grad == cost.fwd_flops
        assert first_has_no_input_grad


def test_depthwise_backward_is_not_overcounted() -> None:
    """torch's formula ignores groups in the weight gradient; ours must not."""
    conv = nn.Conv2d(64, 64, 3, 1, 1, groups=64, bias=False)
    x = torch.randn(2, 64, 16, 16, requires_grad=True)
    with flop_counter() as fwd:
        y = conv(x)
    with flop_counter() as bwd:
        y.backward(torch.ones_like(y))
    assert fwd.get_total_flops() == 2 * 2 * 64 * 9 * 16 * 16
    assert bwd.get_total_flops() == 2 * fwd.get_total_flops()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_training_step_is_about_three_forwards(cache_dir: Path, name: str) -> None:
    costs = costs_of(cache_dir, name)
    whole = client_block(costs, costs.num_layers)
    assert 2.85 <= whole.train_flops / whole.fwd_flops <= 3.0
    for k in costs.split_candidates():  # a server block returns the input gradient: exactly 3×
        server = server_block(costs, k)
        if server.fwd_flops:
            assert server.train_flops == pytest.approx(3 * server.fwd_flops, rel=1e-6)


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv3-small", "vit-small"])
def test_saved_bytes_equal_a_whole_block_measurement(cache_dir: Path, name: str) -> None:
    """Prefix/suffix sums of per-layer saved storage equal what autograd saves for the real
    client and server blocks, measured independently at another batch."""
    costs = costs_of(cache_dir, name)
    model = build_model(name, seed=0).train()
    state = {t.untyped_storage().data_ptr() for t in list(model.parameters())
             + list(model.buffers())}
    batch = 5
    for k in (1, costs.num_layers // 2, costs.num_layers - 1):
        client, server = split(model, k)
        for block, est, needs_grad in (
            (client, client_block(costs, k), False),
            (server, server_block(costs, k), True),
        ):
            seen: dict[int, int] = {}
            keep = []

            def pack(t: torch.Tensor, seen: dict[int, int] = seen, keep: list = keep):
                s = t.untyped_storage()
                if s.data_ptr() not in state:
                    seen[s.data_ptr()] = s.nbytes()
                keep.append(t)
                return t

            shape = model.spec.input_shape if block is client else costs.layers[k].in_shape
            x = torch.randn(batch, *shape, requires_grad=needs_grad)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                block(x)
            expected = batch * est.saved_bytes + est.saved_const
            assert sum(seen.values()) == pytest.approx(expected, rel=1e-9, abs=8), (name, k)


def test_memory_grows_linearly_in_batch_and_counts_optimizer_state(cache_dir: Path) -> None:
    costs = costs_of(cache_dir, "resnet18")
    block = client_block(costs, 5)
    totals = [training_memory(block, b, "sgd").total for b in (1, 2, 4, 8, 16)]
    steps = [b - a for a, b in zip(totals, totals[1:], strict=False)]
    per_sample = steps[0]
    assert per_sample > 0
    for i, step in enumerate(steps):
        assert step == pytest.approx(per_sample * 2**i, abs=2)
    sgd, mom, adam = (training_memory(block, 8, opt) for opt in OPTIMIZER_STATE)
    assert mom.total - sgd.total == block.param_bytes
    assert adam.total - sgd.total == 2 * block.param_bytes
    assert sgd.grads == block.param_bytes and sgd.weights >= block.param_bytes
    with pytest.raises(ConfigError):
        training_memory(block, 8, "lbfgs")


def test_runtime_context_defaults_by_device_kind() -> None:
    nano, cpu = resolve_profile("jetson-nano-4gb"), resolve_profile("x86-cpu")
    assert runtime_context_bytes(nano) == 300 * 2**20
    assert runtime_context_bytes(cpu) == 250 * 2**20
    assert runtime_context_bytes(nano, 123) == 123 * 2**20


def test_activation_bytes_per_codec(cache_dir: Path) -> None:
    import jetsplit.wire.codecs as wire

    assert set(CODEC_BYTES) == set(wire.CODECS)
    costs = costs_of(cache_dir, "vgg11")
    k, batch = 2, 8
    numel = math.prod(costs.layers[k - 1].out_shape)
    channels = costs.layers[k - 1].out_shape[0]
    assert activation_bytes(costs, k, "fp32", batch) == 4 * numel * batch
    assert activation_bytes(costs, k, "fp16", batch) == 2 * numel * batch
    assert activation_bytes(costs, k, "bf16", batch) == 2 * numel * batch
    assert activation_bytes(costs, k, "int8", batch) == numel * batch + INT8_PARAM_BYTES * channels
    flat = costs.num_layers - 1  # a vector activation: one range per tensor
    assert activation_bytes(costs, flat, "int8", 1) == costs.layers[flat - 1].out_numel + 16
    with pytest.raises(ConfigError):
        activation_bytes(costs, k, "fp8")


@pytest.mark.parametrize("name", ["alexnet", "resnet18", "mobilenetv3-large", "vit-small"])
def test_aux_head_costs_match_the_real_head(cache_dir: Path, name: str) -> None:
    costs = costs_of(cache_dir, name)
    model = build_model(name, seed=0)
    for k in (1, costs.num_layers - 1):
        head = build_aux_head(model, k)
        aux = aux_block(costs, k)
        assert aux.params == sum(p.numel() for p in head.parameters())
        assert aux.fwd_flops > 0 and aux.bwd_flops >= aux.fwd_flops
        with_aux = client_block(costs, k) + aux
        assert with_aux.train_flops > client_block(costs, k).train_flops


def test_cache_round_trip_corruption_and_no_torch_on_hit(tmp_path: Path) -> None:
    first = get_costs("mobilenetv3-small", (3, 32, 32), 10, cache_dir=tmp_path)
    path = cache_path("mobilenetv3-small", (3, 32, 32), 10, cache_dir=tmp_path)
    assert path.is_file() and path.name.endswith(f"-zoo{ZOO_VERSION}.json")
    assert get_costs("mobilenetv3-small", (3, 32, 32), 10, cache_dir=tmp_path) == first
    code = ("import sys; from pathlib import Path; "
            "from jetsplit.export.cost_model import get_costs; "
            f"get_costs('mobilenetv3-small', (3, 32, 32), 10, cache_dir=Path({str(tmp_path)!r}))"
            "; assert 'torch' not in sys.modules, 'torch imported on a cache hit'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    for garbage in ("{not json", json.dumps({"format": 1}), ""):
        path.write_text(garbage)
        assert get_costs("mobilenetv3-small", (3, 32, 32), 10, cache_dir=tmp_path) == first
    assert json.loads(path.read_text())["name"] == "mobilenetv3-small"  # rewritten
    other = cache_path("mobilenetv3-small", (1, 28, 28), 10, cache_dir=tmp_path)
    assert other != path


def test_fingerprint_reads_the_zoo_version() -> None:
    version, fingerprint = zoo_fingerprint()
    assert version == ZOO_VERSION and len(fingerprint) == 16


def test_count_costs_leaves_the_model_untouched() -> None:
    model = build_model("mobilenetv3-small", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    count_costs(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_predicted_times_from_peak(cache_dir: Path) -> None:
    costs = costs_of(cache_dir, "resnet18")
    nano = resolve_profile("jetson-nano-4gb")
    times = predict_layer_times(costs, nano, 32)
    rate = nano.compute.peak_fp32_gflops * nano.compute.efficiency * 1e9
    for t, la in zip(times, costs.layers, strict=True):
        assert t.source == "peak"
        assert t.fwd_ms == pytest.approx(32 * la.fwd_flops / rate * 1e3)
        assert t.bwd_no_input_grad_ms <= t.bwd_ms
