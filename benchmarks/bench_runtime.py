"""Forward-only runtimes and the cost model, measured side by side on this machine.

1. ONNX Runtime vs eager PyTorch forward time of client blocks at batch 1 and 32
   (ratio = PyTorch / ONNX Runtime; > 1 means ONNX Runtime is faster). The two runtimes are
   timed in alternating rounds so drift on a noisy machine hits both alike.
2. The cost model's predicted per-layer time (FLOPs at this machine's achieved GFLOPS)
   against the measured per-layer time (goal: within ±30%).

Run: `.venv/bin/python benchmarks/bench_runtime.py [--models alexnet,resnet18] [--repeats 15]`
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from jetsplit.export.cost_model import get_costs, predict_layer_times
from jetsplit.export.onnx_export import export_onnx
from jetsplit.export.profiler import build_measured_profile, measure_layers
from jetsplit.models import build_model, split
from jetsplit.profiles import resolve_profile
from jetsplit.runtimes.onnx_runtime import CPU_EP, OnnxBlock

# Client blocks to time: SCALA's AlexNet split and comparable early splits elsewhere.
DEFAULT_BLOCKS = {"alexnet": 2, "vgg11": 3, "resnet18": 3, "mobilenetv3-small": 4,
                  "mobilenetv3-large": 4, "vit-small": 3}


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def compare_runtimes(models: dict[str, int], shape: tuple[int, int, int], repeats: int,
                     rounds: int = 3) -> list[dict]:
    """Median forward ms of each client block in PyTorch and ONNX Runtime, interleaved."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, k in models.items():
            model = build_model(name, shape, 10, seed=0).eval()
            client, _ = split(model, k)
            path = export_onnx(client, shape, Path(tmp) / f"{name}.onnx", opset=17)
            block = OnnxBlock(path, providers=[CPU_EP])
            for batch in (1, 32):
                x = torch.randn(batch, *shape)
                xn = x.numpy()
                with torch.no_grad():
                    client(x), block.run(xn)  # warm-up both
                    torch_ms, ort_ms = [], []
                    for _ in range(rounds):
                        torch_ms.append(_median_ms(lambda: client(x), repeats))  # noqa: B023
                        ort_ms.append(_median_ms(lambda: block.run(xn), repeats))  # noqa: B023
                t, o = statistics.median(torch_ms), statistics.median(ort_ms)
                rows.append({"model": name, "split": k, "batch": batch, "torch_ms": t,
                             "ort_ms": o, "ratio": t / o})
    return rows


def cost_model_accuracy(calibrate: str, targets: list[str], shape: tuple[int, int, int],
                        batch: int, repeats: int) -> tuple[float, list[dict]]:
    """Per-layer training time (fwd+bwd) predicted two ways against a fresh measurement:
    `flops` — counted FLOPs at the GFLOPS achieved on another model (what a vendor-peak or
    other-model profile gives); `profiled` — a measured profile of the same model taken in an
    earlier, independent run (what `jetsplit profile` gives the planner)."""
    base = resolve_profile("x86-cpu")
    cal_layers = measure_layers(build_model(calibrate, shape, 10, seed=0), batch, repeats,
                                device="cpu")
    cal_profile = build_measured_profile("bench-host", get_costs(calibrate, shape, 10),
                                         cal_layers, batch, base)
    rows = []
    for name in targets:
        costs = get_costs(name, shape, 10)
        model = build_model(name, shape, 10, seed=0)
        own = build_measured_profile(f"bench-{name}", costs,
                                     measure_layers(model, batch, repeats, device="cpu"),
                                     batch, base)
        by_flops = predict_layer_times(costs, cal_profile, batch)
        by_profile = predict_layer_times(costs, own, batch)
        measured = measure_layers(model, batch, repeats, device="cpu")
        for i, (f, p, m) in enumerate(zip(by_flops, by_profile, measured, strict=True)):
            actual = max(m.fwd_ms + m.bwd_ms, 1e-9)
            rows.append({"model": name, "layer": m.name, "measured_ms": actual,
                         "flops_ms": f.train_ms(input_grad=i > 0),
                         "profiled_ms": p.train_ms(input_grad=i > 0)})
    assert cal_profile.measured is not None
    return cal_profile.measured.achieved_gflops, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_BLOCKS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--calibrate", default="resnet18",
                        help="model whose measured GFLOPS calibrates the cost model")
    parser.add_argument("--cost-models", default="alexnet,vgg11,resnet18,mobilenetv3-small",
                        help="models whose per-layer times are predicted and measured")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # one small model on each side, 2 repeats
        args.models = args.calibrate = args.cost_models = "mobilenetv3-small"
        args.repeats, args.batch = 2, 4
    torch.set_num_threads(args.threads)
    models = {m: DEFAULT_BLOCKS.get(m, 2) for m in args.models.split(",")}
    shape = (3, 32, 32)

    print(f"# ONNX Runtime vs PyTorch, client blocks, input {shape}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'model':<20}{'split':>6}{'batch':>7}{'torch ms':>11}{'ort ms':>10}{'torch/ort':>11}")
    for r in compare_runtimes(models, shape, args.repeats):
        print(f"{r['model']:<20}{r['split']:>6}{r['batch']:>7}{r['torch_ms']:>11.2f}"
              f"{r['ort_ms']:>10.2f}{r['ratio']:>11.2f}")

    targets = [m for m in args.cost_models.split(",") if m]
    gflops, rows = cost_model_accuracy(args.calibrate, targets, shape, args.batch, args.repeats)
    print(f"\n# cost model: predicted / measured per-layer training time (fwd+bwd), batch "
          f"{args.batch}; flops = counted FLOPs at {gflops:.1f} GFLOPS achieved on "
          f"{args.calibrate}; profiled = measured profile of the same model, earlier run")
    print(f"{'model':<19}{'layer':<10}{'meas ms':>9}{'flops/meas':>12}{'profiled/meas':>15}")
    for r in rows:
        print(f"{r['model']:<19}{r['layer']:<10}{r['measured_ms']:>9.2f}"
              f"{r['flops_ms'] / r['measured_ms']:>12.2f}"
              f"{r['profiled_ms'] / r['measured_ms']:>15.2f}")
    print(f"\n{'model':<19}{'path':<10}{'layers within ±30%':>20}{'median':>8}{'block':>8}")
    for name in targets:
        mine = [r for r in rows if r["model"] == name]
        for path in ("flops", "profiled"):
            ratios = [r[f"{path}_ms"] / r["measured_ms"] for r in mine]
            within = sum(0.7 <= q <= 1.3 for q in ratios)
            block = sum(r[f"{path}_ms"] for r in mine) / sum(r["measured_ms"] for r in mine)
            print(f"{name:<19}{path:<10}{f'{within}/{len(mine)}':>20}"
                  f"{statistics.median(ratios):>8.2f}{block:>8.2f}")

if __name__ == "__main__":
    main()
