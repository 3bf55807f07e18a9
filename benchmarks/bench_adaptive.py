"""Live re-planning against the same per-device cuts planned once, side by side (slow).

A 4-device emulated fleet (2 × jetson-nano-4gb, 2 × orin-nx-16gb; PSL, VGG-11 on MNIST,
dirichlet:0.5). After round 4, a0 (a Nano) loses most of its uplink (50 → 2 Mbit/s,
downlink 20) and a1 (an Orin NX) drops to a 10 W mode (compute halved). Two emulated
trials per seed, identical but for `replan`: on (server/cuts/replanning.py) and off (the cuts
planned before round 1 throughout). Printed per seed, then the mean:

- the mean training round wall time from the change on, for each, and their ratio (goal
  ≤ 0.7): a row's `seconds` less its `evaluate` phase (the coordinator's reporting: PSL
  pulls every device's block each round to score it, which no plan can shorten); the mean
  with evaluation is printed beside it;
- the planner's prediction for the new conditions (the first switch's predicted round
  time at the planned cuts ÷ at the new ones: the scenario should make it ≥ 1.5) and how
  far the measured ratio is from it (goal: within 15%);
- the rounds from the change to the first switch, and the bytes the switches shipped;
- the final accuracy of each (goal: within 1 point).

`--recover` uses a trace where a0's link comes back after round 9, to show the cut return.
`--replan-clock model` re-plans on the conditions each emulated agent states (its trace's
row) instead of measured times: the decision no longer waits for the medians to turn or
depends on this machine's load; round times are measured either way.
Traces are written per run as TOML (edge_agent/traces.py). Emulated compute is dilated to
this machine's speed (server/run/trial.py), so the plan, and which scenario pays, depend on the
machine: the printed prediction says what this one expects.

    .venv/bin/python benchmarks/bench_adaptive.py [--rounds 12] [--seeds 0 1 2] [--recover]
        [--replan-clock measured|model]
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

PROFILES = ["jetson-nano-4gb", "orin-nx-16gb"]  # cycled over 4 agents
CHANGE = 5  # the first round under the new conditions (0-based: "after round 4")


def traces(root: Path, change: int, recover: int | None) -> dict[str, str]:
    """a0: a Nano's uplink falls (and maybe recovers); a1: an Orin NX's power mode drops."""
    link = root / "nano-uplink.toml"
    rows = ["[[at]]\nround = 0\nuplink_mbps = 50.0\ndownlink_mbps = 50.0\n",
            f"[[at]]\nround = {change}\nuplink_mbps = 2.0\ndownlink_mbps = 20.0\n"]
    if recover is not None:
        rows.append(f"[[at]]\nround = {recover}\nuplink_mbps = 50.0\ndownlink_mbps = 50.0\n")
    link.write_text("\n".join(rows))
    orin = root / "orin-10w.toml"
    orin.write_text(f'[[at]]\nround = 0\npower_mode = "MAXN"\n\n'
                    f'[[at]]\nround = {change}\ncompute = 0.5\npower_mode = "10W"\n')
    return {"a0": str(link), "a1": str(orin)}


def one_trial(seed: int, args: argparse.Namespace, replan: str, root: Path,
              cuts: dict[str, int] | None = None) -> dict[str, Any]:
    """One emulated trial; `cuts` fixes the plan (the plan-once run takes the cuts the
    re-planning run was planned with: each trial measures this machine and plans anew,
    and a busier machine dilates compute more, which can plan other cuts)."""
    out = root / f"seed{seed}-replan-{replan}"
    out.mkdir(parents=True)
    spec = TrialSpec(train={"algorithm": args.method, "rounds": args.rounds,
                            "local_steps": args.local_steps, "batch": args.batch,
                            "replan": replan, "replan_clock": args.replan_clock},
                     agents=args.agents, profiles=PROFILES, model=args.model,
                     dataset=args.dataset, partition="dirichlet:0.5", seed=seed, cuts=cuts,
                     traces=traces(out, args.change, args.recover))
    summary = run_trial(spec, out / "run", live=False)
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((out / "run" / "plan.json").read_text())
    later = [r for r in rows if r["round"] >= args.change]
    after = [train_seconds(r) for r in later]
    switches = [r for r in rows if isinstance(r.get("replan"), dict)]
    first = switches[0]["replan"] if switches else None
    return {
        "round_s": statistics.mean(after) if after else float("nan"),
        "with_eval_s": statistics.mean(r["seconds"] for r in later) if later else float("nan"),
        "accuracy": summary["final_accuracy"],
        "first_switch": switches[0]["round"] if switches else None,
        "switch_bytes": sum(sum(s["replan"]["switch_bytes"].values()) for s in switches),
        "predicted": (first["predicted_before_s"] / first["predicted_after_s"]
                      if first and first["predicted_after_s"] else None),
        "planned": {a: info["cut"] for a, info in plan["agents"].items()},
        "per_round": {r["round"]: train_seconds(r) for r in rows},
        "dilation": plan["emulation"]["compute_dilation"],
        "moves": [f"r{s['round']}: {s['replan']['reason']}" for s in switches],
    }


def train_seconds(row: dict[str, Any]) -> float:
    """A round's wall time less its evaluation phase (the coordinator's reporting)."""
    return float(row["seconds"]) - float(row.get("phases_s", {}).get("evaluate", 0.0))


def settled(on: dict[str, Any], off: dict[str, Any]) -> float | None:
    """Re-plan / plan-once over the rounds after the first switch's shipping round (the
    new cuts in steady state), or None without a switch or such rounds."""
    if on["first_switch"] is None:
        return None
    rounds = [r for r in on["per_round"] if r >= on["first_switch"] + 2 and r in off["per_round"]]
    if not rounds:
        return None
    return (statistics.mean(on["per_round"][r] for r in rounds)
            / statistics.mean(off["per_round"][r] for r in rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--method", default="psl")
    parser.add_argument("--model", default="vgg11")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--recover", action="store_true",
                        help="a0's link comes back after round 9")
    parser.add_argument("--replan-clock", choices=("measured", "model"), default="measured",
                        help="what re-planning reads: measured times (default), or the "
                        "conditions the emulated agents state (no detection lag, no noise)")
    parser.add_argument("--out", type=Path, default=None,
                        help="keep every trial's folder here (default: a temp dir, removed)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny: digits, 2 agents, 4 rounds x 1 step, change at round 1")
    args = parser.parse_args()
    args.change = CHANGE
    if args.smoke:
        args.seeds, args.rounds, args.local_steps, args.agents = [0], 4, 1, 2
        args.dataset, args.batch, args.change = "digits", 32, 1
    args.recover = (args.change + 5 if not args.smoke else 3) if args.recover else None
    started = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="bench-adaptive-") as tmp:
        root = args.out or Path(tmp)
        for seed in args.seeds:
            on = one_trial(seed, args, "on", root)
            results["on"].append(on)
            results["off"].append(one_trial(seed, args, "off", root, cuts=on["planned"]))
    print(f"\n== {args.method}, {args.model}/{args.dataset}, {args.agents} agents "
          f"({', '.join(PROFILES)} cycled), {args.rounds} rounds x T={args.local_steps}, batch "
          f"{args.batch}; re-plan clock {args.replan_clock}; from round {args.change}: "
          f"a0 uplink 50 -> 2 Mbit/s, a1 compute x0.5 (10 W)"
          + (f", back at round {args.recover}" if args.recover else "")
          + f"; seeds {args.seeds}")
    print("seed | round s re-plan | round s plan-once | ratio | predicted | measured/predicted "
          "| first switch | switch MB | acc re-plan | acc plan-once | Δacc (points) | "
          "with eval s re-plan, plan-once")
    ratios, deltas, fits = [], [], []
    for seed, on, off in zip(args.seeds, results["on"], results["off"], strict=True):
        ratio = on["round_s"] / off["round_s"]
        delta = 100 * (on["accuracy"] - off["accuracy"])
        predicted = on["predicted"]
        fit = None if predicted is None else ratio * predicted
        ratios.append(ratio)
        deltas.append(delta)
        if fit is not None:
            fits.append(fit)
        lag = "none" if on["first_switch"] is None else \
            f"round {on['first_switch']} (+{on['first_switch'] - args.change + 1})"
        print(f"{seed:4d} | {on['round_s']:15.2f} | {off['round_s']:17.2f} | {ratio:5.3f} | "
              f"{'n/a' if predicted is None else f'{predicted:.2f}x':>9} | "
              f"{'n/a' if fit is None else f'{fit:.2f}':>18} | {lag:>12} | "
              f"{on['switch_bytes'] / 1e6:9.2f} | {on['accuracy']:11.4f} | "
              f"{off['accuracy']:13.4f} | {delta:+.2f} | {on['with_eval_s']:.2f}, "
              f"{off['with_eval_s']:.2f}")
        print(f"     planned cuts {on['planned']}; compute dilation {on['dilation']} "
              f"(re-plan), {off['dilation']} (plan-once)")
        for move in on["moves"]:
            print(f"     {move}")
        steady = settled(on, off)
        if steady is not None:
            print(f"     after the switch's shipping round: ratio {steady:.3f} "
                  f"(predicted {1 / predicted:.3f})" if predicted else
                  f"     after the switch's shipping round: ratio {steady:.3f}")
    print(f"mean round-time ratio re-plan/plan-once after the change: "
          f"{statistics.mean(ratios):.3f} (goal <= 0.7); mean accuracy difference "
          f"{statistics.mean(deltas):+.2f} points (goal within 1)")
    if fits:
        print(f"measured ratio x predicted speed-up: mean {statistics.mean(fits):.2f} "
              f"(1.00 = exactly as predicted; goal within 0.85-1.15)")
    print(f"\nbench wall time {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
