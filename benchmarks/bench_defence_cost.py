"""What the coordinator's per-step and per-average defences cost, side by side in one process.

The label check (server/defences/label_check.py) runs at every split step: a projection, sums
per label, a median per class and the verdicts. It is timed against the server step it rides
on (forward, backward and update of the server block on every device's activations). The
direction check (server/defences/update_direction.py) runs at every average of uploads: each
device's update against the coordinate-wise median update. It is timed against the average
itself (`aggregators.aggregate` under `mean` with the outlier bound, the default), and that
average against the mean alone (`none`). The
gradient bound's shares, where a method does not compute them anyway (`[train]
gradient_shares = "all"`: one backward per device), are timed as SCALA's server step
with and without them; SplitFed V2's per-step norm against its one-device step. Each robust
aggregator (`[train] aggregator`) is timed against the mean on the same uploads, with the
most memory it allocates beyond them (tracemalloc, which sees numpy's buffers): a rule that
copies every upload shows it here. Inputs are random tensors of the real shapes: cost does
not depend on their values. One torch thread.

Run: `.venv/bin/python benchmarks/bench_defence_cost.py [--model alexnet --split 2
--devices 10 --batch 64 --repeats 30 --aggregator-repeats 5] [--smoke]`
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
import torch

from jetsplit.models.split import split
from jetsplit.models.weights import to_arrays
from jetsplit.models.zoo import build_model
from jetsplit.server.defences.aggregators import AGGREGATORS, DEFAULT_OUTLIER_BOUND, aggregate
from jetsplit.server.defences.label_check import LabelConsistency
from jetsplit.server.defences.step_bounds import gradient_norm, share_norms
from jetsplit.server.defences.update_direction import UpdateDirection
from jetsplit.server.methods.scala_math import (
    concatenated_forward,
    concatenated_update,
    server_params,
)


def timed(pairs: list[tuple[Callable[[], object], list[float]]], repeats: int) -> None:
    """Each callable once to warm up, then `repeats` times interleaved (a drift in the
    machine's speed lands on both)."""
    for run, _ in pairs:
        run()
    for _ in range(repeats):
        for run, out in pairs:
            started = time.perf_counter()
            run()
            out.append(time.perf_counter() - started)


def peak_allocation(run: Callable[[], object]) -> int:
    """The most bytes `run` holds allocated at once, over what was allocated before it
    (tracemalloc: numpy registers its array buffers with it)."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--split", type=int, default=2)
    parser.add_argument("--input", default="1,28,28", help="C,H,W (MNIST by default)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="B, shared by the devices")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--aggregator-repeats", type=int, default=5,
                        help="each aggregator rule (seconds per call on AlexNet)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny: mobilenetv3-small on 8×8 inputs, 3 repeats (seconds)")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.input, args.repeats, args.aggregator_repeats = (
            "mobilenetv3-small", "1,8,8", 3, 1)
    torch.set_num_threads(1)
    command = "python benchmarks/bench_defence_cost.py " + shlex.join(sys.argv[1:])
    shape = tuple(int(v) for v in args.input.split(","))
    model = build_model(args.model, shape, args.classes, seed=0)  # type: ignore[arg-type]
    client, server = split(model, args.split)
    generator = torch.Generator().manual_seed(0)
    # unequal shares of B, as dirichlet partitions give them
    weights = torch.rand(args.devices, generator=generator) + 0.2
    shares = [max(2, round(args.batch * float(w / weights.sum()))) for w in weights]
    with torch.no_grad():
        acts = [client(torch.randn(n, *shape, generator=generator)) for n in shares]
    labels = [torch.randint(0, args.classes, (n,), generator=generator) for n in shares]
    agents = [f"a{i}" for i in range(args.devices)]
    optimizer = torch.optim.SGD(server.parameters(), lr=0.01)
    check = LabelConsistency(args.classes, seed=0)

    def server_step() -> None:
        leaf = torch.cat(acts).requires_grad_()
        loss = torch.nn.functional.cross_entropy(server(leaf), torch.cat(labels))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    step_s: list[float] = []
    label_s: list[float] = []
    timed([(server_step, step_s), (lambda: check.observe(agents, acts, labels), label_s)],
          args.repeats)

    def scala_step(shares: bool) -> None:  # shares: measured, nobody clipped
        step = concatenated_forward(server, acts, labels, args.classes, adjust=True)
        terms = step.terms(None) if shares else None
        if terms is not None:
            share_norms(terms, server_params(server))
        concatenated_update(server, optimizer, step, terms=terms)

    def split_v2_step() -> None:  # SplitFed V2 serves one device per step
        leaf = acts[0].clone().requires_grad_()
        loss = torch.nn.functional.cross_entropy(server(leaf), labels[0])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def split_v2_norm() -> None:  # and bounds that step's server-gradient norm
        gradient_norm([p.grad for p in server.parameters() if p.grad is not None])

    scala_s: list[float] = []
    shares_s: list[float] = []
    v2_s: list[float] = []
    norm_s: list[float] = []
    timed([(lambda: scala_step(False), scala_s), (lambda: scala_step(True), shares_s),
           (split_v2_step, v2_s),
           (split_v2_norm, norm_s)], args.repeats)

    start = to_arrays(model, "model")
    rng = np.random.default_rng(0)
    uploads = {a: {n: (v + rng.normal(0, 1e-2, v.shape)).astype(v.dtype)
                   if v.dtype.kind == "f" else v for n, v in start.items()} for a in agents}
    sizes = {a: float(n) for a, n in zip(agents, shares, strict=True)}
    direction = UpdateDirection()

    def average(bound: float = DEFAULT_OUTLIER_BOUND) -> None:
        aggregate(uploads, sizes, "mean", reference=start, outlier_bound=bound)

    average_s: list[float] = []
    plain_s: list[float] = []
    direction_s: list[float] = []
    timed([(average, average_s), (lambda: average(0.0), plain_s),
           (lambda: direction.observe("model", uploads, start), direction_s)], args.repeats)

    def rule_run(rule: str) -> Callable[[], object]:
        return lambda: aggregate(uploads, sizes, rule, reference=start)

    peaks = {rule: peak_allocation(rule_run(rule)) for rule in AGGREGATORS}
    rules: dict[str, list[float]] = {rule: [] for rule in AGGREGATORS}
    timed([(rule_run(rule), rules[rule]) for rule in AGGREGATORS], args.aggregator_repeats)

    params = sum(v.size for v in start.values() if v.dtype.kind == "f")
    upload_mb = sum(v.nbytes for v in start.values()) / 2**20
    print(f"command: {command}")
    print(f"# {args.model} split {args.split}, input {shape}, {args.devices} devices, "
          f"B = {args.batch} ({shares}), activations {tuple(acts[0].shape[1:])}, "
          f"{params:,} float parameters, median of {args.repeats}, one thread\n")
    print("| what | ms | defence / what it rides on |")
    print("|---|---|---|")
    step, label = statistics.median(step_s), statistics.median(label_s)
    avg, cosine = statistics.median(average_s), statistics.median(direction_s)
    print(f"| server step (all devices' activations) | {1e3 * step:.2f} | |")
    print(f"| label check, per step | {1e3 * label:.2f} | {label / step:.3f} |")
    scala, shares_every = statistics.median(scala_s), statistics.median(shares_s)
    v2, norm = statistics.median(v2_s), statistics.median(norm_s)
    print(f"| SCALA server step | {1e3 * scala:.2f} | |")
    print(f"| SCALA server step, gradient_shares = all | {1e3 * shares_every:.2f} | "
          f"{shares_every / scala:.3f} |")
    print(f"| SplitFed V2 server step (one device's {shares[0]} samples) | {1e3 * v2:.2f} | |")
    print(f"| SplitFed V2's gradient bound, per step | {1e3 * norm:.2f} | {norm / v2:.3f} |")
    plain = statistics.median(plain_s)
    print(f"| average of the uploads (mean, outlier bound) | {1e3 * avg:.2f} | |")
    print(f"| average of the uploads, mean only (`none`) | {1e3 * plain:.2f} | |")
    print(f"| outlier bound, per average | {1e3 * (avg - plain):.2f} | "
          f"{(avg - plain) / plain:.3f} of the mean |")
    print(f"| direction check, per average | {1e3 * cosine:.2f} | {cosine / avg:.3f} |")
    print(f"\neach aggregator on the {args.devices} uploads ({upload_mb:.0f} MiB each; median of "
          f"{args.aggregator_repeats}), against the mean; peak MiB it allocates beyond them\n")
    print("| aggregator | ms | × mean | peak MiB allocated | × one upload |")
    print("|---|---|---|---|---|")
    mean = statistics.median(rules["mean"])
    for rule, times in rules.items():
        took = statistics.median(times)
        print(f"| {rule} | {1e3 * took:.1f} | {took / mean:.2f} | {peaks[rule] / 2**20:.0f} | "
              f"{peaks[rule] / 2**20 / upload_mb:.2f} |")
    print(f"\nratio label check / server step: {label / step:.3f}; "
          f"ratio direction check / average: {cosine / avg:.3f}; "
          f"ratio average with / without the outlier bound: {avg / plain:.3f}; "
          f"ratio SCALA step all / free: {shares_every / scala:.3f}; "
          f"ratio SplitFed V2 gradient bound / its step: {norm / v2:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
