"""Communication vs accuracy: SplitFed V1, SCALA, Ampere and SHeRL-FL on the same model,
split and data (MNIST-5k, 20 clients, Ampere's Dir(α/(1−α)) label skew with α = 0.33).

Prints per method the final test accuracy, the training bytes (up + down, bundle
installation excluded, Ampere's phase-2 bundle of trained weights included) per client
device, and the ratio to SplitFed V1's bytes; then the papers' claims to compare against:
Ampere uses 0.9–11.7% of SplitFed's bytes at equal or better accuracy (the Ampere paper), SHeRL-FL
about 44% of SplitFed's (the SHeRL-FL paper). In-process engine: bytes are exactly what the wire
format would carry.

    .venv/bin/python benchmarks/comm.py [--rounds 20] [--seeds 0] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from jetsplit.server.run.simulate import sherl_topology, simulate
from jetsplit.server.training.settings import Settings

METHODS = ("splitfed-v1", "scala", "ampere", "sherl")
CLAIMS = {"ampere": "0.9–11.7% of SplitFed's bytes, accuracy equal or better",
          "sherl": "about 44% of SplitFed's bytes"}


def run(method: str, args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if method == "sherl":
        extra["edges"] = sherl_topology("sherl", args.edges, args.clients)
        extra["edge_split"] = args.edge_split
    settings = Settings(algorithm=method, rounds=args.rounds, local_steps=args.local_steps,
                        fraction=args.fraction, batch=args.batch, lr=args.lr, seed=seed,
                        **extra)
    started = time.perf_counter()
    summary = simulate(settings, model=args.model, split=args.split, dataset=args.dataset,
                       clients=args.clients, partition_scheme=args.partition, out_dir=out)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tiers: dict[str, int] = {}
    for row in rows:
        for name, n in (row.get("tier_bytes") or {}).items():
            tiers[name] = tiers.get(name, 0) + int(n)
    total = summary["bytes_up"] + summary["bytes_down"]
    return {"accuracy": summary["final_accuracy"], "bytes": total,
            "per_client_mb": total / args.clients / 1e6, "tiers": tiers,
            "rounds_run": len(rows), "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--split", type=int, default=2)
    parser.add_argument("--edge-split", type=int, default=None,
                        help="SHeRL-FL's first cloud layer (default: the planner's)")
    parser.add_argument("--edges", type=int, default=2)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--partition", default="ampere:0.33")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds, 10 clients")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # the baseline and one tiered method, 2 rounds x 1 step, 4 digits clients
        args.methods = ["splitfed-v1", "sherl"]  # Ampere's device epoch alone takes minutes
        args.dataset, args.model, args.clients, args.fraction = (
            "digits", "mobilenetv3-small", 4, 1.0)
        args.rounds, args.local_steps, args.batch = 2, 1, 16
    if args.quick:
        args.rounds, args.clients = 5, 10
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as tmp:
        for method in args.methods:
            for seed in args.seeds:
                result = run(method, args, seed, Path(tmp) / f"{method}-{seed}")
                results.setdefault(method, []).append(result)
                print(f"{method} seed {seed}: accuracy {result['accuracy']:.4f}, "
                      f"{result['per_client_mb']:.2f} MB per client, "
                      f"{result['seconds']:.0f}s", flush=True)
    base = statistics.mean(r["bytes"] for r in results.get("splitfed-v1", [])) \
        if "splitfed-v1" in results else None
    print(f"\n{args.model} split {args.split}, {args.dataset}, {args.clients} clients, "
          f"{args.partition}, fraction {args.fraction}, {args.rounds} rounds × "
          f"{args.local_steps} steps, B={args.batch}, seeds {args.seeds}")
    print("| method | accuracy (mean) | MB per client | bytes / SplitFed V1 | paper claim |")
    print("|---|---|---|---|---|")
    for method, runs in results.items():
        acc = statistics.mean(r["accuracy"] for r in runs)
        total = statistics.mean(r["bytes"] for r in runs)
        ratio = f"{total / base:.3f}" if base else "n/a"
        print(f"| {method} | {acc:.4f} | {total / args.clients / 1e6:.2f} | {ratio} | "
              f"{CLAIMS.get(method, '')} |")
        tiers = runs[0]["tiers"]
        if tiers:
            print("|  tiers | " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in tiers.items())
                  + " | | | |")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
