"""GAPSL against PSL at equal work, each at a learning rate chosen the same way (slow).

The GAPSL paper's headline is +16.0 points over PSL (CIFAR-10, VGG-16, non-IID). Here
both run on label-skewed MNIST with the default model, at the same rounds, local steps,
batch, fraction and seeds, each at its catalog defaults except the learning rate:

1. **Sweep.** For each method and each `--grid` learning rate, train on 80% of the
   training data and score on the held-out 20% (`simulate(validation=0.2)`): the test
   split is never seen. The score is the mean validation accuracy of the last
   `--score-rounds` rounds (one final round is noisy under `dirichlet:0.1`); ties go to
   the smaller rate.
2. **Measure.** Each method at its chosen rate, on the test split, for every `--seeds`.

Prints the sweep table, the result table (mean ± spread over seeds, and the paired
per-seed difference GAPSL − PSL in points), and writes the per-round curves to `--plot`.
`--methods` sweeps other catalog methods the same way (how a method's default rate is
chosen, jetsplit/catalog.py); the GAPSL − PSL line needs both.

Run: `.venv/bin/python benchmarks/gapsl_vs_psl.py [--grid 0.001 0.003 0.01 0.03 0.1]
[--seeds 0 1 2] [--methods psl gapsl] [--plot docs/img/gapsl_vs_psl.png] [--smoke]`
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

from method_matrix import add_run_options, finished, mean_spread  # benchmarks/ on sys.path

from jetsplit.catalog import NAMES
from jetsplit.server.run.simulate import simulate
from jetsplit.server.training.divergence import Diverged
from jetsplit.server.training.settings import Settings

METHODS = ("psl", "gapsl")
PAPER_GAIN_POINTS = 16.0  # GAPSL paper, Table II: CIFAR-10, VGG-16, non-IID


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=NAMES)
    parser.add_argument("--grid", nargs="+", type=float,
                        default=[0.001, 0.003, 0.01, 0.03, 0.1])
    parser.add_argument("--sweep-seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--score-rounds", type=int, default=3)
    parser.add_argument("--validation", type=float, default=0.2)
    parser.add_argument("--partition", default="dirichlet:0.1")
    parser.add_argument("--fraction", type=float, default=0.5)
    add_run_options(parser, reuse=True)
    parser.add_argument("--plot", type=Path, default=None,
                        help="write the per-round test-accuracy curves here (PNG)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny: digits, 2 rates, 1 seed, 1 round × 1 step (seconds)")
    args = parser.parse_args()
    command = "python benchmarks/gapsl_vs_psl.py " + shlex.join(sys.argv[1:])
    if args.smoke:
        args.grid, args.sweep_seeds, args.seeds, args.rounds = [0.01, 0.03], [0], [0], 1
        args.local_steps, args.dataset, args.model, args.agents = 1, "digits", "vgg11", 3
        args.fraction, args.batch, args.score_rounds = 1.0, 24, 1
    logging.basicConfig(level=logging.WARNING)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-gapsl-"))
    print(f"# {args.dataset} ({args.partition}), {args.model} split {args.split}, "
          f"{args.agents} agents at fraction {args.fraction}, {args.rounds} rounds × "
          f"{args.local_steps} local steps, batch {args.batch}; sweep {args.grid} on a "
          f"{args.validation:.0%} validation split, seeds {args.sweep_seeds}; measured on the "
          f"test split, seeds {args.seeds}", flush=True)

    def curve(method: str, lr: float, seed: int, validation: float) -> list[float]:
        """Per-round accuracy of one run; a run the divergence guard stops is all zeros."""
        settings = Settings(algorithm=method, rounds=args.rounds, local_steps=args.local_steps,
                            fraction=args.fraction, batch=args.batch, lr=lr, seed=seed)
        where = "val" if validation else "test"
        run_dir = out / f"{method}-lr{lr:g}-seed{seed}-{where}"
        shape = dict(model=args.model, split=args.split, dataset=args.dataset,
                     clients=args.agents, partition_scheme=args.partition, validation=validation)
        started = time.perf_counter()
        try:
            if not (args.reuse and finished(run_dir, settings, shape) is not None):
                simulate(settings, out_dir=run_dir, checkpoint=False, **shape)
            accs = round_accuracies(run_dir / "metrics.jsonl")
        except Diverged as exc:
            print(f"  {run_dir.name}: DIVERGED ({exc})", flush=True)
            accs = [0.0] * args.rounds
        print(f"{run_dir.name:36s} final {accs[-1]:.4f} ({time.perf_counter() - started:.0f}s)",
              flush=True)
        return accs

    methods = tuple(args.methods)
    scores: dict[tuple[str, float], float] = {}
    for method in methods:
        for lr in args.grid:
            tails = [statistics.mean(curve(method, lr, s, args.validation)[-args.score_rounds:])
                     for s in args.sweep_seeds]
            scores[(method, lr)] = statistics.mean(tails)
    chosen = {m: max(sorted(args.grid), key=lambda lr, m=m: (scores[(m, lr)], -lr))
              for m in methods}

    curves = {m: {s: curve(m, chosen[m], s, 0.0) for s in args.seeds} for m in methods}
    finals = {m: [c[-1] for c in curves[m].values()] for m in methods}

    print(f"\ncommand: {command}\n")
    print(f"sweep: validation accuracy, mean of the last {args.score_rounds} rounds")
    print("| method | " + " | ".join(f"lr {lr:g}" for lr in args.grid) + " | chosen |")
    print("|---|" + "---|" * (len(args.grid) + 1))
    for m in methods:
        cells = [f"{scores[(m, lr)]:.3f}" for lr in args.grid]
        print(f"| {m} | " + " | ".join(cells) + f" | {chosen[m]:g} |")
    for m in methods:  # a best rate at the grid's edge may not be the best rate
        if len(args.grid) > 1 and chosen[m] in (min(args.grid), max(args.grid)):
            edge = "smallest" if chosen[m] == min(args.grid) else "largest"
            print(f"note: {m}'s best rate is the grid's {edge}; a wider --grid may find a "
                  f"better one")
    print("\n| method | lr | final test accuracy (mean ± spread) | per seed |")
    print("|---|---|---|---|")
    for m in methods:
        per_seed = ", ".join(f"{a:.3f}" for a in finals[m])
        print(f"| {m} | {chosen[m]:g} | {mean_spread(finals[m])} | {per_seed} |")
    if set(METHODS) <= set(methods):
        print_gain(curves, args.seeds)
    (out / "gapsl_vs_psl.json").write_text(json.dumps({
        "command": command, "sweep": {f"{m} {lr:g}": v for (m, lr), v in scores.items()},
        "chosen": chosen, "curves": {m: {str(s): c for s, c in cs.items()}
                                     for m, cs in curves.items()}}, indent=2))
    if args.plot:
        plot_curves(curves, chosen, args.plot, f"{args.dataset} {args.partition}, "
                    f"{args.model}, {args.agents} agents")
        print(f"curves: {args.plot}")
    return 0


def print_gain(curves: dict[str, dict[int, list[float]]], seeds: list[int]) -> None:
    """The paired per-seed difference GAPSL − PSL in points, against the paper's."""
    gains = [100 * (curves["gapsl"][s][-1] - curves["psl"][s][-1]) for s in seeds]
    gain = statistics.mean(gains)
    spread = statistics.pstdev(gains) if len(gains) > 1 else 0.0
    verdict = ("GAPSL above PSL on every seed" if min(gains) > 0 else
               "GAPSL below PSL on every seed" if max(gains) < 0 else
               "no difference on any seed" if not any(gains) else "the seeds disagree")
    print(f"\nGAPSL - PSL: {gain:+.1f} ± {spread:.1f} points (per seed "
          f"{', '.join(f'{g:+.1f}' for g in gains)}): {verdict}; the paper reports "
          f"{PAPER_GAIN_POINTS:+.1f}")


def round_accuracies(metrics: Path) -> list[float]:
    """Each round's evaluated accuracy, in round order, from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [float(r["accuracy"]) for r in rows if r.get("accuracy") is not None]


def plot_curves(curves: dict[str, dict[int, list[float]]], chosen: dict[str, float],
                path: Path, title: str) -> None:
    """Mean test accuracy per round with the seeds' min-max band, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, by_seed in curves.items():
        runs = list(by_seed.values())
        rounds = range(1, len(runs[0]) + 1)
        columns = list(zip(*runs, strict=True))
        ax.plot(rounds, [statistics.mean(c) for c in columns],
                label=f"{method} (lr {chosen[method]:g})")
        ax.fill_between(rounds, [min(c) for c in columns], [max(c) for c in columns], alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
