"""What `simulate` costs over the plain computation it wraps: every catalog method against a
plain PyTorch loop, side by side in one run.

The limit a simulator approaches is a plain training loop: the same model (built by
`jetsplit.models.build_model`, same seed), SGD, the same number of steps of the same batch
drawn from the same training samples, and the same number of test-set evaluations (one per
round). SplitFed V1, FedAvg, SCALA and PSL do more work than that loop by their own design
(a model per client, two backward passes, an evaluation per client block), so each is also
held against its own plain loop (benchmarks/_plain_loops.py): a method's ratio to
the plain loop is its cost, its ratio to its own loop is the framework's. Each run — the
plain loops, then `simulate` of each method — is its own subprocess
with one torch thread (`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`), so its user+sys CPU
seconds and peak RSS are that run's alone (`os.wait4`'s rusage of the child); CPU time, not
wall time, because wall time on a shared machine measures the neighbours. The runs are
interleaved (plain, method 1, method 2, …, then again) and the medians over the repeats are
printed with the ratios to the plain loop's.

Default workload (issue 43): AlexNet split 2 on MNIST-5k, 4 agents, fraction 1,
dirichlet:0.5 (the CLI's default), 5 rounds × 10 local steps × batch 64, seed 0, with the
CLI's per-round checkpoint. Each process's imports and data loading are included on both
sides: they are what a researcher pays per run.

With `--fleets 100:0.2,1000:0.02` it then runs SplitFed V1 and SCALA (`--scale-methods`)
on fleets of those sizes at those fractions, each in its own subprocess, and prints peak
RSS and seconds per round: a simulation's memory must grow with the clients a round
selects, not with the fleet (simulated clients that are not selected hold only their
shard).

Where torch sees CUDA, it then runs benchmarks/bench_server.py: the coordinator's server
step on the GPU against the plain forward and two backwards of the same block on the same
batch, and against the copies of the step's bytes (the ratios in results.md's "On a GPU").

Run: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_overhead.py [--methods ...]
[--repeats 3] [--rounds 5] [--local-steps 10] [--fleets 100:0.2,1000:0.02] [--smoke]`
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# benchmarks/ is on sys.path when run as a script
from _plain_loops import LOOPS, PLAIN, REFERENCES, SHAPES, run_reference

SMOKE_METHODS = ["splitfed-v1", "scala"]


def run_method(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """`jetsplit simulate --algorithm method` with this shape (SHeRL-FL: one edge)."""
    from jetsplit.server.run.simulate import sherl_topology, simulate
    from jetsplit.server.training.settings import Settings

    edges = sherl_topology(method, 1 if method == "sherl" else 0, args.agents)
    settings = Settings(algorithm=method, rounds=args.rounds, local_steps=args.local_steps,
                        batch=args.batch, fraction=args.fraction, seed=args.seed, edges=edges,
                        device="cpu")
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as out:
        summary = simulate(settings, model=args.model, split=args.split, dataset=args.dataset,
                           clients=args.agents, partition_scheme=args.partition,
                           out_dir=Path(out) / "run")
        rows = [json.loads(line) for line in
                (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"final_accuracy": summary["final_accuracy"],
            "round_seconds": [r["seconds"] for r in rows],
            "selected": statistics.mean(len(r["selected"]) for r in rows)}


def child(args: argparse.Namespace) -> None:
    """One run in this (child) process; its result is the last stdout line."""
    import logging

    import torch

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    result = run_reference(args, args.child) if args.child in LOOPS \
        else run_method(args, args.child)
    print(json.dumps(result), flush=True)


def measure(args: argparse.Namespace, run: str) -> dict[str, Any]:
    """Run `run` in a fresh subprocess; its own user, sys CPU seconds and peak RSS."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", run,
               *shlex.split(shape_flags(args))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"error: {run} failed:\n{err.read()[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return {"user": usage.ru_utime, "sys": usage.ru_stime, "cpu": usage.ru_utime + usage.ru_stime,
            "rss_mb": usage.ru_maxrss / 1024, "wall": wall,
            "accuracy": float(result["final_accuracy"] or 0.0),
            "round_seconds": result.get("round_seconds", []),
            "selected": result.get("selected", args.agents)}


def shape_flags(args: argparse.Namespace) -> str:
    return (f"--model {args.model} --split {args.split} --dataset {args.dataset} "
            f"--agents {args.agents} --fraction {args.fraction} --partition {args.partition} "
            f"--rounds {args.rounds} --local-steps {args.local_steps} --batch {args.batch} "
            f"--seed {args.seed}")


def parse_fleets(text: str) -> list[tuple[int, float]]:
    """`100:0.2,1000:0.02` as [(clients, fraction)]; a malformed one is one error line."""
    fleets = []
    for item in filter(None, text.split(",")):
        try:
            clients, fraction = item.split(":")
            fleets.append((int(clients), float(fraction)))
        except ValueError:
            raise SystemExit(f"error: --fleets {item!r}: want CLIENTS:FRACTION") from None
        if not (1 <= fleets[-1][0] <= 100_000 and 0 < fleets[-1][1] <= 1):
            raise SystemExit(f"error: --fleets {item!r}: 1..100000 clients, fraction in (0, 1]")
    return fleets


def scale(args: argparse.Namespace, fleets: list[tuple[int, float]]) -> list[str]:
    """Peak RSS and seconds per round (after the first: bundle installs) per fleet size."""
    lines = ["| method | clients | fraction | selected | peak RSS MB | user+sys CPU s "
             "| wall s per round (after the first) |", "|---|---|---|---|---|---|---|"]
    rss: dict[str, list[float]] = {}
    for method in args.scale_methods:
        for clients, fraction in fleets:
            shape = argparse.Namespace(**{**vars(args), "agents": clients, "fraction": fraction})
            m = measure(shape, method)
            later = m["round_seconds"][1:] or m["round_seconds"]
            lines.append(f"| {method} | {clients} | {fraction:g} | {m['selected']:.0f} | "
                         f"{m['rss_mb']:.0f} | {m['cpu']:.1f} | {statistics.mean(later):.2f} |")
            rss.setdefault(method, []).append(m["rss_mb"])
    for method, values in rss.items():
        lines.append(f"peak RSS {method} {fleets[-1][0]} / {fleets[0][0]} clients: "
                     f"{values[-1] / values[0]:.2f}")
    return lines


def table(runs: list[str], results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Medians per run, their ratios to the plain loop's, and a method's CPU and RSS ratios
    to its own plain loop's where it has one (same repeat count each)."""
    med = {r: {k: statistics.median(m[k] for m in results[r])
               for k in ("cpu", "sys", "rss_mb", "wall", "accuracy")} for r in runs}
    base = med[PLAIN]
    lines = ["| run | user+sys CPU s | × plain | peak RSS MB | × plain | sys s | × plain "
             "| wall s | final accuracy | CPU × its plain loop | RSS × its plain loop |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m, own = med[r], med.get(REFERENCES.get(r, ""))
        mine = (f"{m['cpu'] / own['cpu']:.2f} | {m['rss_mb'] / own['rss_mb']:.2f}"
                if own else "— | —")
        lines.append(f"| {run_name(r)} | {m['cpu']:.1f} | {m['cpu'] / base['cpu']:.2f} | "
                     f"{m['rss_mb']:.0f} | {m['rss_mb'] / base['rss_mb']:.2f} | {m['sys']:.1f} | "
                     f"{m['sys'] / max(base['sys'], 1e-3):.2f} | {m['wall']:.1f} | "
                     f"{m['accuracy']:.4f} | {mine} |")
    return lines


def run_name(run: str) -> str:
    if run == PLAIN:
        return "plain PyTorch loop"
    if run in SHAPES:
        return f"plain loop, {SHAPES[run].name}"
    return f"simulate --algorithm {run}"


def main() -> int:
    from jetsplit.catalog import NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(NAMES), choices=NAMES)
    parser.add_argument("--repeats", type=int, default=3, help="0: only the --fleets table")
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--split", type=int, default=2)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--partition", default="dirichlet:0.5")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fleets", default="",
                        help="CLIENTS:FRACTION,...: also the scale table (e.g. 100:0.2,1000:0.02)")
    parser.add_argument("--scale-methods", nargs="+", default=SMOKE_METHODS, choices=NAMES)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny: digits, 2 methods, 1 repeat, 2 rounds × 2 steps, fleets "
                             "of 4 and 16 (seconds)")
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    command = "python benchmarks/bench_overhead.py " + shlex.join(sys.argv[1:])
    if args.smoke:
        args.methods, args.repeats, args.rounds, args.local_steps = SMOKE_METHODS, 1, 2, 2
        args.dataset, args.model, args.agents, args.batch = "digits", "vgg11", 2, 16
        args.fleets = "4:0.5,16:0.125"
    fleets = parse_fleets(args.fleets)
    own = [REFERENCES[m] for m in args.methods if m in REFERENCES]
    runs = [PLAIN, *dict.fromkeys(own), *args.methods]  # each method's own loop once
    print(f"# {shape_flags(args)}, {args.repeats} repeats, one torch thread each", flush=True)
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in runs}
    for repeat in range(args.repeats):
        for run in runs:  # interleaved: a busy minute hits every run alike
            m = measure(args, run)
            results[run].append(m)
            print(f"repeat {repeat} {run}: cpu {m['cpu']:.1f}s (sys {m['sys']:.1f}s), "
                  f"peak RSS {m['rss_mb']:.0f} MB, wall {m['wall']:.1f}s", flush=True)
    print(f"\ncommand: {command}\n")
    if args.repeats > 0:  # 0: the scale table alone
        print("\n".join(table(runs, results)))
        base = statistics.median(m["cpu"] for m in results[PLAIN])
        for r in args.methods:
            cpu = statistics.median(m["cpu"] for m in results[r])
            print(f"ratio {r} / plain CPU: {cpu / base:.2f}")
        for r in (m for m in args.methods if m in REFERENCES):
            cpu, ref = (statistics.median(m["cpu"] for m in results[x])
                        for x in (r, REFERENCES[r]))
            print(f"ratio {r} / its plain loop ({SHAPES[REFERENCES[r]].name}) CPU: "
                  f"{cpu / ref:.2f}")
    if fleets:
        print(f"\n# scale: {args.rounds} rounds × {args.local_steps} steps, batch {args.batch}")
        print("\n".join(scale(args, fleets)))
    gpu_step(args.smoke)
    return 0


def gpu_step(smoke: bool) -> None:
    """On a CUDA machine, the server step against its plain computation (bench_server.py,
    its own process so that this one never initialises CUDA)."""
    import torch

    if not torch.cuda.is_available():
        print("\nno CUDA here: the server step on a GPU is benchmarks/bench_server.py's")
        return
    print("\n# the server step on the GPU (benchmarks/bench_server.py --no-cpu)", flush=True)
    bench = Path(__file__).resolve().parent / "bench_server.py"
    subprocess.run([sys.executable, str(bench), "--no-cpu", *(["--smoke"] if smoke else [])],
                   check=True)


if __name__ == "__main__":
    sys.exit(main())
