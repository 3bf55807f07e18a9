"""Measure this machine: per-layer training latency and memory of a zoo model, ONNX Runtime
forward latency, achieved GFLOPS — and write it as a measured device profile.

Datasheet peaks × a guessed efficiency are a poor predictor of layer time (norms,
activations and pooling cost time but no FLOPs); per-layer measurements on the device
itself are what Neurosurgeon-style planning needs, so the planner prefers them.
"""

from __future__ import annotations

import copy
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

from jetsplit.errors import JetsplitError
from jetsplit.export.cost_model import ModelCosts, get_costs
from jetsplit.export.torch_compat import storage_of
from jetsplit.profiles import DeviceProfile, profile_from_dict

if TYPE_CHECKING:
    import torch

    from jetsplit.models import LayeredModel

MIB = 2**20
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")
PLACEHOLDER_MBPS = 100.0  # a host profile's link when no base profile says better


@dataclass(frozen=True)
class LayerMeasurement:
    """One layer at one batch: medians over repeats, milliseconds per batch."""

    name: str
    fwd_ms: float
    bwd_ms: float  # layer 0 without an input gradient (as a block trains), others with one
    saved_mb: float  # unique storages autograd saved for backward (no parameters)
    peak_mem_mb: float  # saved + weights + grads + output and its gradient
    ort_fwd_ms: Optional[float] = None


@dataclass
class ProfileRun:
    """What ``profile_machine`` measured and wrote."""

    profile: DeviceProfile
    layers: List[LayerMeasurement]
    achieved_gflops: float
    peak_rss_mb: Optional[float]
    notes: List[str] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_mb() -> float | None:
    """Peak resident set size of this process so far (Linux/macOS), MiB."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (MIB if platform.system() == "Darwin" else 1024)


def pick_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA when torch sees a GPU (a Jetson with NVIDIA's wheel), else CPU."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise JetsplitError(f"--device must be auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        from jetsplit.errors import BackendUnavailable

        raise BackendUnavailable("--device cuda: torch sees no CUDA device here")
    return torch.device(name)


def measure_layers(model: LayeredModel, batch: int, repeats: int = 5, *, warmup: int = 2,
                   device: str = "auto", on_layer: Callable[[str], None] | None = None
                   ) -> list[LayerMeasurement]:
    """Forward and backward latency of every layer, in training mode, as a client block
    trains (the model input needs no gradient, later inputs do); medians after warm-up.
    Works on a copy: the caller's weights and batch-norm statistics are untouched."""
    import torch

    if batch < 1 or repeats < 1 or warmup < 0:
        raise JetsplitError("batch and repeats must be ≥ 1 and warmup ≥ 0")
    dev = pick_device(device)
    work = copy.deepcopy(model).to(dev).train()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *model.spec.input_shape, generator=generator).to(dev)
    out_list = []
    for i, (name, layer) in enumerate(work.named_children()):
        if on_layer is not None:
            on_layer(name)
        fwd, bwd = [], []
        saved: dict[int, int] = {}
        state = {storage_of(t)[0] for t in list(layer.parameters()) + list(layer.buffers())}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved, state: set[int] = state
                 ) -> torch.Tensor:
            ptr, nbytes = storage_of(t)
            if ptr not in state:
                saved[ptr] = nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # untimed pass
            out = layer(x.detach().requires_grad_(i > 0))
        grad = torch.randn(out.shape, generator=generator).to(dev)
        out.backward(grad)
        layer.zero_grad(set_to_none=True)
        for rep in range(warmup + repeats):
            inp = x.detach().requires_grad_(i > 0)
            _sync(dev)
            t0 = time.perf_counter()
            out = layer(inp)
            _sync(dev)
            t1 = time.perf_counter()
            out.backward(grad)
            _sync(dev)
            t2 = time.perf_counter()
            layer.zero_grad(set_to_none=True)
            if rep >= warmup:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
        io_bytes = out.numel() * out.element_size() * 2  # output and its gradient
        saved_bytes = sum(saved.values())
        out_list.append(LayerMeasurement(
            name=name, fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd),
            saved_mb=saved_bytes / MIB,
            peak_mem_mb=(saved_bytes + 2 * params + buffers + io_bytes) / MIB))
        x = out.detach()
    return out_list


def measure_ort_layers(model: LayeredModel, batch: int, repeats: int = 5,
                       workdir: Path | None = None) -> tuple[list[float | None], list[str]]:
    """Forward latency of every layer in ONNX Runtime (each layer exported alone, opset 17),
    and notes for what could not be measured. Missing ONNX tooling → all None, one note."""
    import numpy as np
    import torch

    try:
        from jetsplit.export.onnx_export import export_onnx
        from jetsplit.runtimes.onnx_runtime import ORT_MISSING, OnnxBlock, onnxruntime_available
    except ImportError as exc:
        return [None] * len(model), [f"ONNX Runtime timing skipped: {exc}"]
    if onnxruntime_available() is None:  # one note, and no layer exported for nothing
        return [None] * len(model), [f"ONNX Runtime timing skipped: {ORT_MISSING}"]
    times: list[float | None] = []
    notes: list[str] = []
    work = copy.deepcopy(model).eval()
    x = torch.randn(batch, *model.spec.input_shape, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for i, (name, layer) in enumerate(work.named_children()):
            try:
                path = export_onnx(layer, tuple(x.shape[1:]), Path(tmp) / f"{i}.onnx")
                block = OnnxBlock(path)
                times.append(block.latency_ms(x.numpy().astype(np.float32), repeats=repeats))
            except JetsplitError as exc:
                if not notes or "ONNX Runtime is not installed" not in notes[-1]:
                    notes.append(f"ONNX Runtime timing of {name} skipped: {exc}")
                times.append(None)
            with torch.no_grad():
                x = layer(x)
    return times, notes


def achieved_gflops(costs: ModelCosts, layers: list[LayerMeasurement], batch: int) -> float:
    """Counted training FLOPs / measured training time, as the layers were timed (layer 0
    without an input gradient)."""
    flops = sum(la.fwd_flops + (la.bwd_flops_no_input_grad if i == 0 else la.bwd_flops)
                for i, la in enumerate(costs.layers)) * batch
    seconds = sum(m.fwd_ms + m.bwd_ms for m in layers) / 1e3
    return flops / seconds / 1e9 if seconds > 0 else 0.0


def host_sgemm_gflops(size: int = 1024, repeats: int = 3) -> float:
    """Best-of-``repeats`` fp32 matmul throughput here: a host profile's "peak" (as
    profiles/x86-cpu.toml)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def host_memory_bandwidth_gbps(mib: int = 64) -> float:
    """Best-of-3 copy bandwidth (read + write) of a ``mib`` MiB buffer, GB/s."""
    import numpy as np

    src = np.ones(mib * MIB // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def _host_sections(name: str, achieved: float) -> dict[str, object]:
    """[device] [memory] [compute] [network] [software] for this host, from measurement
    where it can be measured and labelled placeholders where it cannot."""
    import psutil

    vm = psutil.virtual_memory()
    peak = max(host_sgemm_gflops(), achieved)
    cores = os.cpu_count() or 1
    machine = platform.machine() or "unknown"
    return {
        "device": {
            "name": name, "module": platform.processor() or machine, "kind": "cpu",
            "source": (f"measured by jetsplit profile on {platform.node() or 'this host'}: "
                       "sgemm peak, copy bandwidth, MemAvailable share; network is a "
                       f"placeholder ({PLACEHOLDER_MBPS:g} Mbit/s) — set it or use --bandwidth"),
            "cpu": f"{cores}x {machine}",
        },
        "memory": {"total_mb": round(vm.total / MIB, 1),
                   "usable_fraction": round(min(0.9, max(0.05, vm.available / vm.total)), 3),
                   "bandwidth_gbps": round(host_memory_bandwidth_gbps(), 2)},
        "compute": {"peak_fp32_gflops": round(peak, 2),
                    "efficiency": round(min(1.0, max(0.001, achieved / peak)), 4),
                    "cpu_cores": cores},
        "network": {"uplink_mbps": PLACEHOLDER_MBPS, "downlink_mbps": PLACEHOLDER_MBPS},
        "software": {"python": platform.python_version()},
    }


def profile_name(out: Path | None, base: DeviceProfile | None, model: str) -> str:
    """The measured profile's name: the output file's stem when it is a valid name."""
    if out is not None and _NAME_OK.match(out.stem):
        return out.stem
    host = re.sub(r"[^A-Za-z0-9._-]", "-", platform.node() or "host").strip("-") or "host"
    return f"{base.name if base else host}-{model}-measured"


def cpu_sections(data: dict[str, Any], achieved: float) -> str:
    """Turn a GPU profile's dump into the CPU's that was measured: a Jetson whose torch has
    no CUDA (a stock JetPack 4 Nano) trains on its CPU, and a profile keeping the GPU's
    cores and peaks would tell the planner otherwise. Returns a note saying so."""
    was = data["device"]["name"]
    data["device"]["kind"] = "cpu"
    data["device"].pop("gpu", None)
    data["device"]["source"] += ("; compute measured on the CPU by jetsplit profile (torch "
                                 "has no CUDA here): sgemm peak, achieved GFLOPS")
    compute = data["compute"]
    for key in ("cuda_cores", "gpu_clock_mhz", "peak_fp16_gflops"):
        compute.pop(key, None)
    peak = max(host_sgemm_gflops(), achieved)
    compute["peak_fp32_gflops"] = round(peak, 2)
    compute["efficiency"] = round(min(1.0, max(0.001, achieved / peak)), 4)
    compute["cpu_cores"] = os.cpu_count() or 1
    data.setdefault("software", {})["python"] = platform.python_version()
    return (f"measured on the CPU (torch has no CUDA here): the GPU fields of {was} were "
            "replaced by the CPU's (kind cpu, sgemm peak)")


def build_measured_profile(name: str, costs: ModelCosts, layers: list[LayerMeasurement],
                           batch: int, base: DeviceProfile | None, on_cpu: bool = False,
                           notes: list[str] | None = None) -> DeviceProfile:
    """A profile with a [measured] section; device fields from ``base`` or this host (the
    CPU's compute fields where ``on_cpu`` and ``base`` describes a GPU)."""
    achieved = achieved_gflops(costs, layers, batch)
    if achieved <= 0:
        raise JetsplitError("measured times are zero: cannot compute achieved GFLOPS")
    if base is not None:
        data = base.model_dump(mode="python", exclude_none=True)
        data.pop("measured", None)
        data["device"]["name"] = name
        if on_cpu and base.device.kind != "cpu":
            note = cpu_sections(data, achieved)
            if notes is not None:
                notes.append(note)
    else:
        data = _host_sections(name, achieved)
    data["measured"] = {
        "model": costs.name, "input_shape": list(costs.input_shape), "batch": batch,
        "achieved_gflops": round(achieved, 4),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "layers": [{k: v for k, v in {
            "name": m.name, "fwd_ms": round(m.fwd_ms, 4), "bwd_ms": round(m.bwd_ms, 4),
            "peak_mem_mb": round(m.peak_mem_mb, 3),
            "ort_fwd_ms": None if m.ort_fwd_ms is None else round(m.ort_fwd_ms, 4),
        }.items() if v is not None} for m in layers],
    }
    return profile_from_dict(data, source=f"measured profile {name}")


def profile_machine(model_name: str, input_shape: tuple[int, int, int], num_classes: int,
                    batch: int, repeats: int, *, base: DeviceProfile | None = None,
                    out: Path | None = None, ort: bool = True, warmup: int = 2,
                    device: str = "auto", on_layer: Callable[[str], None] | None = None
                    ) -> ProfileRun:
    """Measure ``model_name`` here and build (not write) the measured profile."""
    from jetsplit.models import build_model

    model = build_model(model_name, input_shape, num_classes, seed=0)
    costs = get_costs(model_name, input_shape, num_classes)
    layers = measure_layers(model, batch, repeats, warmup=warmup, device=device,
                            on_layer=on_layer)
    notes: list[str] = []
    if ort:
        ort_times, notes = measure_ort_layers(model, batch, repeats)
        assert len(ort_times) == len(layers)  # one per layer, None where not measured
        layers = [LayerMeasurement(m.name, m.fwd_ms, m.bwd_ms, m.saved_mb, m.peak_mem_mb, t)
                  for m, t in zip(layers, ort_times)]
    else:
        notes.append("ONNX Runtime timing skipped (--no-ort)")
    name = profile_name(out, base, model_name)
    on_cpu = pick_device(device).type == "cpu"
    profile = build_measured_profile(name, costs, layers, batch, base, on_cpu, notes)
    assert profile.measured is not None
    return ProfileRun(profile, layers, profile.measured.achieved_gflops, peak_rss_mb(), notes)
