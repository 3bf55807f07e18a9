"""Each paper's headline comparison at EQUAL DATA PASSES, multi-seed, in one process.

Every method gets the same budget of device epochs E (passes over the clients' data):

- split methods (SplitFed V1/V2, PSL, SCALA and ablations, GAPSL, SHeRL-FL): a round is T
  iterations over all K clients (fraction 1), each iteration B samples in total (B_k ∝ |D_k|,
  or a fixed per-client batch b, B = K·b), so a round is T·B / N epochs and the run has
  rounds = ⌈E·N / (T·B)⌉;
- Ampere: N_d = E device epochs (client block + aux head), then its one forward-only
  generation pass, and E server epochs on the stored activations (`--ampere-server-epochs`
  sets N_s; server epochs cost the devices nothing and move no bytes).

Tables (one per paper; means over seeds, the spread in brackets):

1. SCALA (the SCALA paper (ICML) §5): SCALA vs CA-SFL vs LLA-SFL vs SplitFed V1/V2 under
   dirichlet:β.
   Goal: SCALA ≥ SplitFed V1 + 2 points.
2. GAPSL (the GAPSL paper §IV): GAPSL vs PSL under dirichlet:0.1 with the paper's optimiser
   (SGD momentum 0.9, client lr 0.005, server lr 0.01, 128 per client), same for PSL.
3. Ampere (the Ampere paper §5.2): bytes to reach SplitFed V1's final accuracy (ratio to the bytes
   SplitFed V1 needed to reach it), and accuracy at equal device epochs, under ampere:0.33.
   Goal: ratio ≤ 0.15.
4. SHeRL-FL (the SHeRL-FL paper): bytes per tier and accuracy vs SplitFed V1, same partition.
   Goal: ≤ 0.6× SplitFed's bytes at comparable accuracy. Two ratios: all bytes, and the
   bytes that cross to the cloud when each edge's site broker is bridged to the cloud's
   (everything but the direct client↔edge smashed data and gradients, which stay on the
   site), against SplitFed's, all of which crosses. Clients and their edge exchange smashed
   data and gradients directly on their own topics, so there is no relay leg to take out.
   `--sherl-local-steps` sets SHeRL's T (its τ2 is T: one cloud aggregation per round);
   the paper gives no τ values.

Ampere's claim rests on activations dominating SplitFed's traffic: per device and epoch
SplitFed moves 2·|D_k|·s^o_p (activations up, gradients down), Ampere 2·(s_block + s_aux)
plus s^o_p·|D_k| once (its eq. 5). Where |D_k|·s^o_p is small against the aux head (digits:
8×8 images, 1 KB per sample) no number of epochs gets Ampere below SplitFed's bytes; MNIST
at the paper's split p = 1 (12.5 KB per sample, ~10 MB per device and epoch against a
228 KB block + head) is the regime the paper measures.

Writes `bytes_to_accuracy_<dataset>_<table>.png` (seed 0's curves) into --png-dir.

    .venv/bin/python benchmarks/papers.py [--datasets digits mnist] [--seeds 0 1]
        [--epochs 2] [--png-dir benchmarks/out] [--tables scala gapsl ampere sherl]
    # one process per seed and table group, then the tables over all of them:
    .venv/bin/python benchmarks/papers.py --seeds 0 --tables scala gapsl --json a.json
    .venv/bin/python benchmarks/papers.py --merge a.json b.json ...
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jetsplit.edge_agent.edge  # noqa: F401 - loaded up front: a long run must not import
import jetsplit.edge_agent.worker  # noqa: F401 - code that changed on disk since it started
import jetsplit.export.planner  # noqa: F401
import jetsplit.profiles  # noqa: F401
import jetsplit.server.engines.seam  # noqa: F401
import jetsplit.server.training.optimisers  # noqa: F401
from jetsplit.catalog import NAMES
from jetsplit.data import load_dataset_split
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.server.methods import method_class
from jetsplit.server.run.simulate import sherl_topology, simulate
from jetsplit.server.training.settings import Settings

for _name in NAMES:  # every method's module, loaded up front as the modules above
    method_class(_name)

SCALA_METHODS = ("scala", "ca-sfl", "lla-sfl", "splitfed-v1", "splitfed-v2")
GAPSL_METHODS = ("gapsl", "psl")
TEST_FRACTION = 0.2
# SHeRL-FL tiers whose bytes cross to the cloud with a site broker bridged to it: all but the
# direct client↔edge messages (the coordinator averages each edge's client blocks on the
# edge's behalf, so `model_client_edge` crosses too).
CLOUD_TIERS = ("edge_to_cloud", "model_edge_cloud", "model_client_edge", "control")


@dataclass
class Run:
    """One simulated run: per-round accuracy and cumulative training bytes."""

    method: str
    seed: int
    accuracy: list[float] = field(default_factory=list)
    cum_bytes: list[int] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=dict)
    epochs: float = 0.0
    seconds: float = 0.0

    @property
    def final(self) -> float:
        return self.accuracy[-1]

    @property
    def total(self) -> int:
        return self.cum_bytes[-1]

    def bytes_to(self, target: float) -> int | None:
        """Training bytes up to the first round whose accuracy reaches `target`."""
        for acc, used in zip(self.accuracy, self.cum_bytes, strict=True):
            if acc >= target - 1e-12:
                return used
        return None


def simulate_run(method: str, seed: int, dataset: str, partition: str, args: argparse.Namespace,
                 n_train: int, out: Path, bundle: Path, **extra: Any) -> Run:
    """Train `method` for `args.epochs` device epochs and read its metrics rows."""
    clients = args.clients
    steps = args.sherl_local_steps if method == "sherl" and args.sherl_local_steps \
        else args.local_steps
    per_client = extra.get("client_batch")
    batch = per_client * clients if per_client else args.batch
    if method.startswith("ampere"):
        epochs_d = max(1, round(args.epochs))
        epochs_s = args.ampere_server_epochs or epochs_d
        settings = Settings(algorithm=method, rounds=epochs_d + epochs_s, batch=args.batch,
                            lr=args.lr, seed=seed, device_epochs=epochs_d,
                            patience=epochs_d, server_epochs=epochs_s, **extra)
        epochs = float(epochs_d)
    else:
        rounds = max(1, math.ceil(args.epochs * n_train / (steps * batch)))
        settings = Settings(algorithm=method, rounds=rounds, local_steps=steps, batch=batch,
                            lr=args.lr, seed=seed, **extra)
        epochs = rounds * steps * batch / n_train
    started = time.perf_counter()
    simulate(settings, model=args.model, split=args.split, dataset=dataset, clients=clients,
             partition_scheme=partition, out_dir=out, test_fraction=TEST_FRACTION,
             bundle=bundle, checkpoint=False)
    run = Run(method, seed, epochs=epochs, seconds=time.perf_counter() - started)
    used = 0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        used += int(row["bytes_up"]) + int(row["bytes_down"])
        run.accuracy.append(float(row["accuracy"] or 0.0))
        run.cum_bytes.append(used)
        for tier, n in (row.get("tier_bytes") or {}).items():
            run.tiers[tier] = run.tiers.get(tier, 0) + int(n)
    return run


def mean_sd(values: list[float]) -> str:
    if not values:
        return "n/a"
    sd = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} (±{sd:.4f})"


def mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def table_scala(runs: dict[str, list[Run]], beta: str) -> tuple[list[str], dict[str, Any]]:
    lines = [f"| method ({beta}) | accuracy | device epochs | MB total |", "|---|---|---|---|"]
    for m in SCALA_METHODS:
        rs = runs[m]
        lines.append(f"| {m} | {mean_sd([r.final for r in rs])} | {rs[0].epochs:.2f} | "
                     f"{mb(statistics.mean(r.total for r in rs))} |")
    gap = 100 * (statistics.mean(r.final for r in runs["scala"])
                 - statistics.mean(r.final for r in runs["splitfed-v1"]))
    lines.append(f"\nSCALA − SplitFed V1: {gap:+.2f} points (goal ≥ +2): "
                 f"{'MET' if gap >= 2 else 'NOT MET'}")
    return lines, {"scala_minus_splitfed_v1_points": gap}


def table_gapsl(runs: dict[str, list[Run]]) -> tuple[list[str], dict[str, Any]]:
    lines = ["| method (dirichlet:0.1, SGD m=0.9, lr 0.005/0.01, 128/client) | accuracy | "
             "device epochs |", "|---|---|---|"]
    for m in GAPSL_METHODS:
        rs = runs[m]
        lines.append(f"| {m} | {mean_sd([r.final for r in rs])} | {rs[0].epochs:.2f} |")
    gap = 100 * (statistics.mean(r.final for r in runs["gapsl"])
                 - statistics.mean(r.final for r in runs["psl"]))
    lines.append(f"\nGAPSL − PSL: {gap:+.2f} points (paper, CIFAR-10 VGG-16 non-IID: +16.0)")
    return lines, {"gapsl_minus_psl_points": gap}


def table_ampere(runs: dict[str, list[Run]]) -> tuple[list[str], dict[str, Any]]:
    lines = ["| seed | SplitFed V1 final acc | SplitFed MB to reach it | Ampere MB to reach it "
             "| ratio | Ampere final acc | Ampere MB total | SplitFed MB total |",
             "|---|---|---|---|---|---|---|---|"]
    ratios: list[float] = []
    for sf, amp in zip(runs["splitfed-v1"], runs["ampere"], strict=True):
        target = sf.final
        sf_bytes, amp_bytes = sf.bytes_to(target), amp.bytes_to(target)
        ratio = amp_bytes / sf_bytes if amp_bytes is not None and sf_bytes else None
        if ratio is not None:
            ratios.append(ratio)
        lines.append(f"| {sf.seed} | {target:.4f} | {mb(sf_bytes or 0)} | "
                     f"{'never' if amp_bytes is None else mb(amp_bytes)} | "
                     f"{'n/a' if ratio is None else f'{ratio:.3f}'} | {amp.final:.4f} | "
                     f"{mb(amp.total)} | {mb(sf.total)} |")
    reached = len(ratios) == len(runs["ampere"])
    worst = max(ratios) if ratios else None
    met = reached and worst is not None and worst <= 0.15
    lines.append(f"\nAmpere accuracy at equal device epochs: "
                 f"{mean_sd([r.final for r in runs['ampere']])} vs SplitFed V1 "
                 f"{mean_sd([r.final for r in runs['splitfed-v1']])}")
    lines.append(f"Ampere bytes to SplitFed V1's final accuracy / SplitFed's: "
                 f"{'reached in every seed' if reached else 'NOT reached in every seed'}, "
                 f"ratios {[round(r, 3) for r in ratios]} (goal ≤ 0.15): "
                 f"{'MET' if met else 'NOT MET'}")
    return lines, {"ampere_ratios": ratios, "ampere_reached_all": reached}


def table_sherl(runs: dict[str, list[Run]]) -> tuple[list[str], dict[str, Any]]:
    sf, sh = runs["splitfed-v1"], runs["sherl"]
    sf_total = statistics.mean(r.total for r in sf)
    sh_total = statistics.mean(r.total for r in sh)
    cloud = statistics.mean(sum(r.tiers.get(t, 0) for t in CLOUD_TIERS) for r in sh)
    lines = ["| method | accuracy | device epochs | MB total | MB crossing to the cloud | "
             "ratio to SplitFed V1 | cloud-link ratio |", "|---|---|---|---|---|---|---|",
             f"| splitfed-v1 | {mean_sd([r.final for r in sf])} | {sf[0].epochs:.2f} | "
             f"{mb(sf_total)} | {mb(sf_total)} | 1.000 | 1.000 |",
             f"| sherl | {mean_sd([r.final for r in sh])} | {sh[0].epochs:.2f} | "
             f"{mb(sh_total)} | {mb(cloud)} | {sh_total / sf_total:.3f} | "
             f"{cloud / sf_total:.3f} |"]
    tiers = {k: statistics.mean(r.tiers.get(k, 0) for r in sh) for k in sh[0].tiers}
    lines.append("\nSHeRL-FL MB per tier (mean): "
                 + ", ".join(f"{k} {mb(v)}" for k, v in tiers.items()))
    acc_gap = 100 * (statistics.mean(r.final for r in sh) - statistics.mean(r.final for r in sf))
    ratio = sh_total / sf_total
    comparable = acc_gap >= -2.0
    lines.append(f"SHeRL-FL − SplitFed V1 accuracy: {acc_gap:+.2f} points; bytes ratio "
                 f"{ratio:.3f} (goal ≤ 0.6 at comparable accuracy, within 2 points): "
                 f"{'MET' if ratio <= 0.6 and comparable else 'NOT MET'}; cloud-link ratio "
                 f"{cloud / sf_total:.3f}")
    return lines, {"sherl_ratio": ratio, "sherl_cloud_link_ratio": cloud / sf_total,
                   "sherl_accuracy_gap_points": acc_gap}


def plot(runs: dict[str, list[Run]], methods: tuple[str, ...], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        r = runs[m][0]
        ax.plot([b / 1e6 for b in r.cum_bytes], r.accuracy, marker=".", label=m)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no overlapping labels
    ax.set_xlabel("training MB (cumulative, all devices)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_tables(dataset: str, n_train: int, runs: dict[str, dict[str, list[Run]]],
                 args: argparse.Namespace) -> dict[str, Any]:
    """Every table whose runs are all there, and its bytes-to-accuracy PNG."""
    runs.setdefault("sherl", {}).update(
        {"splitfed-v1": runs.get("ampere", {}).get("splitfed-v1", [])})
    results: dict[str, Any] = {}
    print(f"\n## {dataset} (N_train = {n_train})")
    builders = {"scala": lambda r: table_scala(r, args.beta), "gapsl": table_gapsl,
                "ampere": table_ampere, "sherl": table_sherl}
    methods_of = {"scala": SCALA_METHODS, "gapsl": GAPSL_METHODS,
                  "ampere": ("splitfed-v1", "ampere"), "sherl": ("splitfed-v1", "sherl")}
    for table in args.tables:
        have = runs.get(table, {})
        counts = {len(have.get(m, [])) for m in methods_of[table]}
        if 0 in counts or len(counts) != 1:
            print(f"\n### {table} — {dataset}: incomplete (runs per method "
                  f"{ {m: len(have.get(m, [])) for m in methods_of[table]} })")
            continue
        lines, numbers = builders[table](have)
        print(f"\n### {table} — {dataset}\n" + "\n".join(lines), flush=True)
        results[table] = numbers
        plot(have, methods_of[table], f"{table}: {dataset}, seed "
             f"{have[methods_of[table][0]][0].seed}, E={have[methods_of[table][0]][0].epochs:g}",
             args.png_dir / f"bytes_to_accuracy_{dataset}_{table}.png")
    return results


def merge(paths: list[Path], args: argparse.Namespace) -> None:
    """Tables over the runs of several --json reports (e.g. one process per seed)."""
    combined: dict[str, dict[str, dict[str, list[Run]]]] = {}
    sizes: dict[str, int] = {}
    for path in paths:
        report = json.loads(path.read_text())
        for dataset, part in report.items():
            if not isinstance(part, dict) or "runs" not in part:
                continue
            sizes[dataset] = int(part["n_train"])
            for table, methods in part["runs"].items():
                for method, rows in methods.items():
                    combined.setdefault(dataset, {}).setdefault(table, {}).setdefault(
                        method, []).extend(Run(**row) for row in rows)
    for dataset, runs in combined.items():
        for table in runs.values():
            for rs in table.values():
                rs.sort(key=lambda r: r.seed)
        print_tables(dataset, sizes[dataset], runs, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "mnist"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=float, default=2, help="device epochs E")
    parser.add_argument("--model", default="alexnet",
                        help="mobilenetv3-small stays at chance for 2 epochs on digits")
    parser.add_argument("--split", type=int, default=2)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=100, help="B over all clients")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--beta", default="dirichlet:0.1")
    parser.add_argument("--ampere-partition", default="ampere:0.33")
    parser.add_argument("--ampere-server-epochs", type=int, default=None,
                        help="Ampere's N_s: server epochs on the stored activations (they "
                             "cost the devices nothing); default E")
    parser.add_argument("--edges", type=int, default=2)
    parser.add_argument("--sherl-local-steps", type=int, default=None,
                        help="SHeRL-FL's T (and so τ2); default --local-steps")
    parser.add_argument("--tables", nargs="+", default=["scala", "gapsl", "ampere", "sherl"])
    parser.add_argument("--png-dir", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only these methods (merge the rest from other reports)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="print the tables over these --json reports instead of running")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # two tables (4 runs) on digits, 1 seed, a tenth of an epoch, PNGs to a
        # temp dir: all four tables took 330 s on a busy 2-core machine
        args.tables, args.datasets = ["sherl", "gapsl"], ["digits"]
        args.seeds, args.epochs = [0], 0.1
        args.model, args.clients, args.local_steps, args.batch = "mobilenetv3-small", 2, 1, 32
        args.ampere_server_epochs = 1
        args.png_dir = Path(tempfile.mkdtemp(prefix="bench-papers-png-"))
    args.png_dir.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merge(args.merge, args)
        return
    started = time.perf_counter()
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    print(f"settings: {args.model} split {args.split}, {args.clients} clients (fraction 1), "
          f"T={args.local_steps}, B={args.batch}, lr {args.lr} (SGD unless the paper says "
          f"otherwise), E={args.epochs} device epochs, seeds {args.seeds}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-papers-") as tmp:
        for dataset in args.datasets:
            n_train = len(load_dataset_split(dataset, TEST_FRACTION, 0)[0])
            plan: list[tuple[str, str, str, dict[str, Any]]] = []
            if "ampere" in args.tables or "sherl" in args.tables:
                plan.append(("ampere", "splitfed-v1", args.ampere_partition, {}))
            if "ampere" in args.tables:
                plan.append(("ampere", "ampere", args.ampere_partition, {}))
            if "sherl" in args.tables:
                plan.append(("sherl", "sherl", args.ampere_partition, {
                    "edges": sherl_topology("sherl", args.edges, args.clients)}))
            if "scala" in args.tables:
                plan += [("scala", m, args.beta, {}) for m in SCALA_METHODS]
            if "gapsl" in args.tables:
                plan += [("gapsl", m, "dirichlet:0.1",
                          {"optimizer": "sgd", "momentum": 0.9, "client_lr": 0.005,
                           "server_lr": 0.01, "client_batch": 128}) for m in GAPSL_METHODS]
            runs: dict[str, dict[str, list[Run]]] = {}
            bundles = {seed: write_bundle(
                ModelSpec(args.model, load_dataset_split(dataset, TEST_FRACTION, 0)[1]
                          .input_shape, 10), args.split, Path(tmp) / f"bundle-{dataset}-{seed}",
                aux_ratio=0.5, seed=seed, tar=True).tar_path for seed in args.seeds}
            plan = [p for p in plan if args.only is None or p[1] in args.only]
            for group, method, partition, extra in plan:
                key = "ampere" if group == "sherl" and method != "sherl" else group
                for seed in args.seeds:
                    out = Path(tmp) / f"{dataset}-{group}-{method}-{seed}"
                    run = simulate_run(method, seed, dataset, partition, args, n_train, out,
                                       bundles[seed], **extra)
                    runs.setdefault(key, {}).setdefault(method, []).append(run)
                    print(f"  {dataset} {method} ({partition}) seed {seed}: acc "
                          f"{run.final:.4f}, {mb(run.total)} MB, {run.epochs:.2f} epochs, "
                          f"{run.seconds:.0f}s", flush=True)
                    report[dataset] = {"n_train": n_train, "runs": {
                        t: {m: [vars(r) for r in rs] for m, rs in g.items()}
                        for t, g in runs.items()}}
                    if args.json is not None:  # after every run: a cut-short run keeps its part
                        args.json.write_text(json.dumps(report, indent=2))
            report[dataset]["results"] = print_tables(dataset, n_train, runs, args)
    wall = time.perf_counter() - started
    print(f"\nwall time {wall:.0f}s; PNGs in {args.png_dir}")
    if args.json is not None:
        report["wall_s"] = wall
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
