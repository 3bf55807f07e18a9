"""Per-device cuts against the best common cut, side by side in one run.

Two emulated trials per fleet and seed (SCALA, AlexNet on MNIST, dirichlet:0.5, same seed
and rounds): one where the fleet planner gives every device its own cut, one at the
planner's best common cut (`--common-split`). Printed: the mean round wall time of each
(round 1 is left out: it installs the bundles) and their ratio, the final accuracy of each,
and per device the planner's predicted compute + transfer seconds per round (a trial
plans the fleet it emulates: compute dilated like the emulated agents') against the
measured ones. Fleets: 2 × jetson-nano-4gb + 2 × orin-nx-16gb, and the three-clock Nano
fleet (921 / 640 / 320 MHz).

    .venv/bin/python benchmarks/bench_hetero.py [--rounds 6] [--seeds 0 1 2] [--fleet demo]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from jetsplit.server.run.trial import run_trial
from jetsplit.server.run.trial_fleet import TrialSpec

FLEETS = {
    "demo": ["jetson-nano-4gb", "orin-nx-16gb"],  # cycled over 4 agents: 2 + 2
    "nano-clocks": ["jetson-nano-4gb-921mhz", "jetson-nano-4gb-640mhz",
                    "jetson-nano-4gb-320mhz"],
}
AGENTS = {"demo": 4, "nano-clocks": 3}


def one_trial(fleet: str, seed: int, rounds: int, local_steps: int, common: bool,
              root: Path, model: str = "alexnet", dataset: str = "mnist") -> dict[str, Any]:
    spec = TrialSpec(train={"algorithm": "scala", "rounds": rounds,
                            "local_steps": local_steps, "batch": 64},
                     agents=AGENTS[fleet], profiles=FLEETS[fleet], model=model, dataset=dataset,
                     partition="dirichlet:0.5", seed=seed, common_split=common)
    out = root / f"{fleet}-{seed}-{'common' if common else 'per-device'}"
    summary = run_trial(spec, out, live=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((out / "plan.json").read_text())
    timed = rows[1:] or rows
    devices = {}
    for agent, info in sorted(plan["agents"].items()):
        measured = [r["agents"][agent].get("compute_s", 0) + r["agents"][agent].get(
            "transfer_s", 0) for r in timed if agent in r.get("agents", {})]
        predicted = info.get("predicted_compute_s", 0) + info.get("predicted_transfer_s", 0)
        devices[agent] = {"profile": info["profile"], "cut": info["cut"],
                          "predicted_s": predicted,
                          "measured_s": statistics.mean(measured) if measured else None}
    return {"round_s": statistics.mean(r["seconds"] for r in timed),
            "accuracy": summary["final_accuracy"], "devices": devices,
            "server_cut": plan["used_split"],
            "predicted_round_s": (plan["value"] or 0) * local_steps / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--fleet", choices=[*FLEETS, "all"], default="all")
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # one 3-agent fleet, one seed, 2 rounds x 1 step (round 1 is left out)
        args.fleet, args.seeds, args.rounds, args.local_steps = "nano-clocks", [0], 2, 1
        args.model, args.dataset = "mobilenetv3-small", "digits"
    fleets = list(FLEETS) if args.fleet == "all" else [args.fleet]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-hetero-") as tmp:
        for fleet in fleets:
            results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for seed in args.seeds:
                for common in (False, True):
                    results[common].append(one_trial(fleet, seed, args.rounds,
                                                     args.local_steps, common, Path(tmp),
                                                     args.model, args.dataset))
            print(f"\n== {fleet}: SCALA, {args.model}/{args.dataset}, dirichlet:0.5, "
                  f"{args.rounds} rounds x T={args.local_steps}, seeds {args.seeds}")
            print("seed | cuts per-device | cut common | round s per-dev | round s common "
                  "| ratio | predicted ratio | acc per-dev | acc common | Δacc (points)")
            ratios, deltas = [], []
            for seed, per, com in zip(args.seeds, results[False], results[True], strict=True):
                cuts = ",".join(str(d["cut"]) for d in per["devices"].values())
                ratio = per["round_s"] / com["round_s"]
                delta = 100 * (per["accuracy"] - com["accuracy"])
                ratios.append(ratio)
                deltas.append(delta)
                predicted = per["predicted_round_s"] / com["predicted_round_s"]
                print(f"{seed:4d} | {cuts:15s} | {com['server_cut']:10d} | "
                      f"{per['round_s']:15.2f} | {com['round_s']:14.2f} | {ratio:5.3f} | "
                      f"{predicted:15.3f} | {per['accuracy']:11.4f} | {com['accuracy']:10.4f} | "
                      f"{delta:+.2f}")
            print(f"mean round wall-time ratio per-device/common: {statistics.mean(ratios):.3f}"
                  f" (goal <= 0.75); mean accuracy difference {statistics.mean(deltas):+.2f} "
                  f"points (goal within 1.5)")
            print("device | profile | mode | cut | predicted s/round | measured s/round "
                  "(compute+transfer, seed " f"{args.seeds[0]})")
            for mode, result in (("per-device", results[False][0]),
                                 ("common", results[True][0])):
                for agent, d in result["devices"].items():
                    measured = "n/a" if d["measured_s"] is None else f"{d['measured_s']:.2f}"
                    print(f"{agent} | {d['profile']} | {mode} | {d['cut']} | "
                          f"{d['predicted_s']:.2f} | {measured}")
    print(f"\nbench wall time {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
