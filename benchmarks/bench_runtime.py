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

import numpy as np
import torch

from export.onnx_export import export_onnx
from jetsplit.models import build_model, split
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_BLOCKS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {m: DEFAULT_BLOCKS.get(m, 2) for m in args.models.split(",")}
    shape = (3, 32, 32)

    print(f"# ONNX Runtime vs PyTorch, client blocks, input {shape}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'model':<20}{'split':>6}{'batch':>7}{'torch ms':>11}{'ort ms':>10}{'torch/ort':>11}")
    for r in compare_runtimes(models, shape, args.repeats):
        print(f"{r['model']:<20}{r['split']:>6}{r['batch']:>7}{r['torch_ms']:>11.2f}"
              f"{r['ort_ms']:>10.2f}{r['ratio']:>11.2f}")
    np.set_printoptions(precision=2)


if __name__ == "__main__":
    main()
