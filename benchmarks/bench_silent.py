"""A device that goes quiet, and one that is merely slow, against the clean fleet, side by side
in one run.

Three emulated trials over MQTT (SCALA, 4 agents, same seed and rounds): `clean`; `silent`,
where a3 runs the `silent` fault (edge_agent/attacks.py: it installs its bundle, then
answers nothing while its connection stays up); `slow`, where a3 is a Jetson Nano whose
link is 2 Mbit/s both ways, trained at cut 1. Printed per trial: the training seconds
(`summary.json`), the whole trial's wall time, who sat out and how often, the probes, and
per round its seconds and step deadline (`deadlines_s`: the forwards'); then the ratios
silent/clean and slow/clean. The step deadlines follow the fleet
(server/defences/step_deadlines.py), the rest of an exchange is cut off once the others
answered (server/engines/cutoff.py), an agent that missed a step sits out until it answers
a probe (server/training/rejoin.py), and a benched agent must answer a probe before it is
selected again (server/defences/sitting_out.py); the probes a round's row shows were booked
at its start.

    JETSPLIT_ALLOW_ATTACKS=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_silent.py \
        [--rounds 10] [--local-steps 10] [--deadline-s 60]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from jetsplit.edge_agent.attacks import ALLOW_ENV
from jetsplit.profiles import bundled_profiles_dir
from jetsplit.server.run.trial import run_trial
from jetsplit.server.run.trial_fleet import TrialSpec

FAST = "orin-nx-16gb"
SLOW_BASE = "jetson-nano-4gb"
SLOW_MBPS = 2.0


def slow_profile(root: Path) -> Path:
    """The Nano profile with a 2 Mbit/s link both ways (its name says so)."""
    text = (bundled_profiles_dir() / f"{SLOW_BASE}.toml").read_text()
    text = text.replace(f'name = "{SLOW_BASE}"', f'name = "{SLOW_BASE}-2mbit"')
    text = re.sub(r"(?m)^(uplink_mbps|downlink_mbps) = .*$", rf"\1 = {SLOW_MBPS}", text)
    path = root / f"{SLOW_BASE}-2mbit.toml"
    path.write_text(text)
    return path


def trial_spec(args: argparse.Namespace, *, profiles: list[str] | None = None,
               attacks: dict[str, str] | None = None, cuts: dict[str, int] | None = None,
               rounds: int | None = None, signed: bool = False) -> TrialSpec:
    """The benchmarks' fleet: SCALA, 4 agents, iid, seed 0, `args`' sizes (bench_faults.py
    shares it, so its arms and these are the same trial but for the fault)."""
    return TrialSpec(train={"algorithm": "scala", "rounds": rounds or args.rounds,
                            "local_steps": args.local_steps, "batch": 48,
                            "deadline_s": args.deadline_s},
                     agents=4, profiles=profiles or [FAST] * 4, model=args.model,
                     dataset=args.dataset, partition="iid", seed=0, attacks=attacks or {},
                     cuts=cuts, signed=signed)


def run_arm(spec: TrialSpec, out: Path, *, restart_after: int | None = None
            ) -> dict[str, Any]:
    """Run one trial into `out` (`restart_after`: its coordinator restarted after that
    round): its training seconds (both coordinators'), wall seconds, metrics rows, who sat
    out how often, the missed steps and the final accuracy."""
    started = time.perf_counter()
    summary = run_trial(spec, out, live=False, restart_after=restart_after)
    wall = time.perf_counter() - started
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = summary.get("restarted", {}).get("first_seconds", 0.0)
    return {"train_s": first + summary["seconds"], "wall_s": wall, "rows": rows,
            "benched": summary.get("benched", {}), "missed": summary.get("missed", []),
            "accuracy": summary["final_accuracy"]}


def one_trial(arm: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    if arm == "silent":
        spec = trial_spec(args, attacks={"a3": "silent"})
    elif arm == "slow":
        spec = trial_spec(args, profiles=[FAST, FAST, FAST, str(slow_profile(root))],
                          cuts={"a3": 1})
    else:
        spec = trial_spec(args)
    return run_arm(spec, root / arm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument("--model", default="mobilenetv3-small")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # 2 rounds × 2 steps, a 30 s deadline (the silent arm waits it once)
        args.rounds, args.local_steps, args.deadline_s = 2, 2, 30.0
    os.environ[ALLOW_ENV] = "1"  # the silent arm's agent process runs the fault
    print(f"command: python benchmarks/bench_silent.py --rounds {args.rounds} --local-steps "
          f"{args.local_steps} --deadline-s {args.deadline_s:g}"
          + (" (--smoke)" if args.smoke else ""))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-silent-") as tmp:
        for arm in ("clean", "silent", "slow"):
            results[arm] = one_trial(arm, args, Path(tmp))
    print(f"\nSCALA, {args.model}/{args.dataset}, 4 agents ({FAST}; slow: a3 {SLOW_BASE} at "
          f"{SLOW_MBPS:g} Mbit/s, cut 1), {args.rounds} rounds × T={args.local_steps}, "
          f"deadline_s {args.deadline_s:g}")
    print("| trial | training s | trial wall s | final accuracy | benched (times) |")
    print("|---|---|---|---|---|")
    for arm, r in results.items():
        benched = ", ".join(f"{a} ({n})" for a, n in sorted(r["benched"].items())) or "nobody"
        print(f"| {arm} | {r['train_s']:.1f} | {r['wall_s']:.1f} | {r['accuracy']:.4f} | "
              f"{benched} |")
    print("\n| round | " + " | ".join(f"{a} s | {a} step deadline s" for a in results) +
          " | silent: probes |")
    print("|---|" + "---|---|" * len(results) + "---|")
    for i in range(args.rounds):
        cells = []
        for r in results.values():
            row = r["rows"][i]
            forward = row.get("deadlines_s", {}).get("forward")
            cells += [f"{row['seconds']:.1f}", "—" if forward is None else f"{forward:.1f}"]
        probes = results["silent"]["rows"][i].get("probes") or {}
        print(f"| {i + 1} | " + " | ".join(cells) + f" | {json.dumps(probes) if probes else '—'} |")
    slow = ", ".join(sorted(results["slow"]["benched"])) or "nobody"
    print(f"benched in the slow trial: {slow} (a slow honest device must never be)")
    clean = results["clean"]
    for arm in ("silent", "slow"):
        print(f"ratio {arm}/clean: training {results[arm]['train_s'] / clean['train_s']:.2f}, "
              f"trial wall {results[arm]['wall_s'] / clean['wall_s']:.2f}")


if __name__ == "__main__":
    main()
