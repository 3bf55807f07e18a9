"""Accuracy, bytes and device FLOPs of every method on label-skewed MNIST (slow).

Defaults follow the acceptance run: MNIST-5k, SCALA's AlexNet at 1×28×28 split after its
second conv stage, 20 clients, `quantity:2` (each client holds at most two classes),
fraction 0.5, 30 rounds, 3 seeds, in-process engine. Prints mean ± std of final top-1 and
balanced accuracy, and bytes and device GFLOPs per run, and writes every run's summary to
`--out`. The papers predict SCALA > CA-SFL ≥ LLA-SFL > SplitFed V1 and GAPSL > PSL; the
table says what actually comes out here.

Run: `.venv/bin/python benchmarks/accuracy.py [--rounds 30] [--seeds 0 1 2] [--quick]`
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from method_matrix import mean_spread  # benchmarks/ is on sys.path when run as a script

from jetsplit.server.run.simulate import simulate
from jetsplit.server.training.settings import Settings

METHODS = ["fedavg", "splitfed-v1", "splitfed-v2", "psl", "scala", "ca-sfl", "lla-sfl",
           "gapsl"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--partition", default="quantity:2")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--split", type=int, default=2)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--out", type=Path, default=Path("runs/accuracy"))
    parser.add_argument("--quick", action="store_true",
                        help="2 methods, 1 seed, 2 rounds on UCI digits (a smoke run)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # 1 method x 1 round x 1 step on 2 digits clients, into a temp dir
        args.methods, args.seeds, args.rounds, args.local_steps = ["psl"], [0], 1, 1
        args.dataset, args.model, args.clients, args.partition = (
            "digits", "mobilenetv3-small", 2, "iid")
        args.fraction, args.batch = 1.0, 16
        args.out = Path(tempfile.mkdtemp(prefix="bench-accuracy-"))
    if args.quick:
        args.methods, args.seeds, args.rounds = ["psl", "scala"], [0], 2
        args.dataset, args.model, args.clients, args.local_steps = "digits", "alexnet", 4, 3

    print(f"# {args.dataset}, {args.model} split {args.split}, {args.clients} clients, "
          f"{args.partition}, fraction {args.fraction}, {args.rounds} rounds × "
          f"{args.local_steps} local steps, batch {args.batch}, lr {args.lr}, "
          f"seeds {args.seeds}", flush=True)
    results: dict[str, list[dict]] = {}
    for method in args.methods:
        for seed in args.seeds:
            out_dir = args.out / f"{method}-seed{seed}"
            settings = Settings(algorithm=method, rounds=args.rounds,
                                local_steps=args.local_steps, fraction=args.fraction,
                                batch=args.batch, lr=args.lr, seed=seed)
            started = time.perf_counter()
            summary = simulate(settings, model=args.model, split=args.split,
                               dataset=args.dataset, clients=args.clients,
                               partition_scheme=args.partition, out_dir=out_dir)
            results.setdefault(method, []).append(summary)
            print(f"{method:12s} seed {seed}: accuracy {summary['final_accuracy']:.4f} "
                  f"balanced {summary['balanced_accuracy']:.4f} bytes "
                  f"{(summary['bytes_up'] + summary['bytes_down']) / 1e6:.1f} MB "
                  f"({time.perf_counter() - started:.0f}s, peak RSS "
                  f"{summary['peak_rss_mb']:.0f} MB)", flush=True)
    print("\n| method | final accuracy | balanced accuracy | MB per run (up+down) | "
          "device GFLOPs per run |\n|---|---|---|---|---|")
    for method, runs in results.items():
        acc = [r["final_accuracy"] for r in runs]
        bal = [r["balanced_accuracy"] for r in runs]
        mb = [(r["bytes_up"] + r["bytes_down"]) / 1e6 for r in runs]
        gf = [r["device_gflops"] for r in runs]
        print(f"| {method} | {mean_spread(acc, 4)} | {mean_spread(bal, 4)} | "
              f"{statistics.mean(mb):.0f} | {statistics.mean(gf):.0f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {m: [{k: r[k] for k in ("final_accuracy", "balanced_accuracy", "bytes_up",
                                "bytes_down", "device_gflops", "seconds")} for r in runs]
         for m, runs in results.items()}, indent=2))
    return 0




if __name__ == "__main__":
    sys.exit(main())
