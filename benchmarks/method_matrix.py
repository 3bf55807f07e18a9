"""Every catalog method × partition: does each keep learning? (slow)

Defaults follow the issue's setting: MNIST-5k, AlexNet split 2 (the default model), 10
agents at fraction 0.5, `iid` and `dirichlet:0.1`, 10 rounds × 10 local steps, batch 64,
seeds 0 1 2, in-process engine, each method at its catalog defaults, its learning rate
included (0.01; PSL and GAPSL 0.003; SHeRL-FL Adam at 1e-3), SHeRL-FL with one edge
serving every agent. Prints one table, method × partition, of the mean ±
spread (population std) of the final accuracy over the seeds, with the command line that
produced it. Every method is iterated from `jetsplit.catalog.NAMES`, so a new method shows
up here without an edit. `tests/server/methods/test_method_matrix.py` is the fast check in
`make test`; this is the measurement.

Run: `.venv/bin/python benchmarks/method_matrix.py [--methods ...] [--seeds 0 1 2]
[--rounds 10] [--partitions iid dirichlet:0.1] [--dataset mnist] [--smoke]`
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jetsplit.catalog import NAMES
from jetsplit.server.run.simulate import sherl_topology, simulate
from jetsplit.server.training.divergence import Diverged
from jetsplit.server.training.settings import Settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(NAMES), choices=NAMES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--partitions", nargs="+", default=["iid", "dirichlet:0.1"])
    add_run_options(parser, reuse=True)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny: digits, 2 methods, 1 seed, 2 rounds × 1 step (seconds)")
    args = parser.parse_args()
    command = "python benchmarks/method_matrix.py " + shlex.join(sys.argv[1:])
    if args.smoke:
        args.methods, args.seeds, args.rounds, args.local_steps = ["psl", "sherl"], [0], 2, 1
        args.dataset, args.model, args.agents, args.fraction = "digits", "vgg11", 2, 1.0
        args.batch, args.partitions = 16, ["iid"]
    logging.basicConfig(level=logging.WARNING)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-matrix-"))

    print(f"# {args.dataset}, {args.model} split {args.split}, {args.agents} agents, fraction "
          f"{args.fraction}, {args.rounds} rounds × {args.local_steps} local steps, batch "
          f"{args.batch}, lr {args.lr or 'each method default'}, seeds {args.seeds}", flush=True)
    finals: dict[tuple[str, str], list[float | None]] = {}  # None: the run diverged
    for partition in args.partitions:
        for method in args.methods:
            for seed in args.seeds:
                edges = sherl_topology(method, 1 if method == "sherl" else 0, args.agents)
                settings = Settings(algorithm=method, rounds=args.rounds,
                                    local_steps=args.local_steps, fraction=args.fraction,
                                    batch=args.batch, lr=args.lr, seed=seed, edges=edges)
                run_dir = out / f"{method}-{partition.replace(':', '')}-seed{seed}"
                shape = dict(model=args.model, split=args.split, dataset=args.dataset,
                             clients=args.agents, partition_scheme=partition)
                started = time.perf_counter()
                acc = finished(run_dir, settings, shape) if args.reuse else None
                reused = acc is not None
                try:
                    if acc is None:
                        summary = simulate(settings, out_dir=run_dir, checkpoint=False, **shape)
                        acc = float(summary["final_accuracy"])
                    result = f"final accuracy {acc:.4f}" + (" (reused)" if reused else "")
                except Diverged as exc:
                    result = f"DIVERGED: {exc}"
                finals.setdefault((method, partition), []).append(acc)
                print(f"{method:24s} {partition:14s} seed {seed}: {result} "
                      f"({time.perf_counter() - started:.0f}s)", flush=True)
    print(f"\ncommand: {command}\n")
    print("| method | " + " | ".join(args.partitions) + " |")
    print("|---|" + "---|" * len(args.partitions))
    for method in args.methods:
        cells = [matrix_cell(finals[(method, p)]) for p in args.partitions]
        print(f"| {method} | " + " | ".join(cells) + " |")
    (out / "method_matrix.json").write_text(json.dumps(
        {"command": command, "final_accuracy": {f"{m} {p}": v for (m, p), v in finals.items()}},
        indent=2))
    return 0


def finished(run_dir: Path, settings: Settings, shape: dict[str, object]) -> float | None:
    """The final accuracy of an earlier run in `run_dir` made with these same settings and
    run shape (its simulation.json says), or None: anything else is run again."""
    try:
        saved = json.loads((run_dir / "simulation.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    same = (isinstance(saved, dict) and isinstance(summary, dict)
            and saved.get("settings") == json.loads(json.dumps(settings.__dict__))
            and all(saved.get(k) == v for k, v in shape.items()))
    accuracy = summary.get("final_accuracy") if same else None
    return float(accuracy) if isinstance(accuracy, int | float) else None


def matrix_cell(values: list[float | None]) -> str:
    """mean ± spread over the seeds that trained, and how many diverged."""
    trained = [v for v in values if v is not None]
    diverged = len(values) - len(trained)
    if not trained:
        return f"diverged ({diverged} of {len(values)})"
    return mean_spread(trained) + (f" ({diverged} of {len(values)} diverged)" if diverged else "")


def add_run_options(parser: argparse.ArgumentParser, *, agents: int = 10, rounds: int = 10,
                    local_steps: int = 10, batch: int = 64, lr: float | None = None,
                    model: str = "alexnet", split: int = 2, dataset: str = "mnist",
                    reuse: bool = False) -> None:
    """The options every training benchmark shares (one run's shape), with its defaults;
    `reuse` adds --reuse for a benchmark that reads its earlier runs (see `finished`)."""
    parser.add_argument("--agents", type=int, default=agents)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--local-steps", type=int, default=local_steps)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--lr", type=float, default=lr,
                        help="every method's rate (default: each method's own, "
                             "server/training/optimisers.py)" if lr is None else None)
    parser.add_argument("--model", default=model)
    parser.add_argument("--split", type=int, default=split)
    parser.add_argument("--dataset", default=dataset)
    parser.add_argument("--out", type=Path, default=None,
                        help="every run's folder goes here (default: a new temp dir)")
    if reuse:
        parser.add_argument("--reuse", action="store_true",
                            help="a run whose --out folder already holds its results, made "
                                 "with these same arguments, is read instead of run again")


def mean_spread(values: list[float], digits: int = 3) -> str:
    """`mean ± spread` (population std) over seeds; the benchmarks' one table cell."""
    spread = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
