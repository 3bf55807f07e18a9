"""The fault matrix as emulated trials: the clean fleet and one faulty device of four per
fault, side by side (issue 45; the same faults as tests/integration/test_fault_matrix.py).

The trials are bench_silent.py's (SCALA, 4 × orin-nx-16gb, iid, seed 0: `trial_spec`),
every message signed with a trial fleet key (`TrialSpec.signed`: the replay window
applies, so a clock jump bites). The arms (edge_agent/faults.py; rounds count from 0):

* `clean`: no fault;
* `silent`: a3 answers nothing from round 1 on (`silent:1`);
* `every-other`: a3 answers every second command from round 1 on;
* `hang-upload`: a3 sends half of a chunked reply in round 1, then nothing;
* `clock-jump`: a3's wall clock jumps +1 h in round 1 (`clock-jump:3600`);
* `restart`: `silent:1`, and the trial stopped after round 1 (a3 benched) and resumed from
  its checkpoint (`jetsplit trial --resume`: a new coordinator, broker and agent
  processes; the test restarts the coordinator alone).

Printed per arm: training seconds (`summary.json`; the restart arm's two parts added) and
the whole trial's wall time, both as ratios to clean; who sat out (times) and a3's missed
exchanges; the final accuracy against clean; then per round each arm's forward step
deadline (`deadlines_s` in the metrics rows).

    JETSPLIT_ALLOW_ATTACKS=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_faults.py \
        [--rounds 6] [--local-steps 5] [--deadline-s 60]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench_silent import FAST, run_arm, trial_spec  # benchmarks/ is on sys.path as a script

from jetsplit.edge_agent.attacks import ALLOW_ENV

FAULTS = {"clean": None, "silent": "silent:1", "every-other": "every-other",
          "hang-upload": "hang-upload", "clock-jump": "clock-jump:3600", "restart": "silent:1"}
STOP_AFTER = 1  # the restart arm's first part ends after this round (a3 benched in it)


def one_arm(arm: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One arm's trial (the restart arm: stopped after `STOP_AFTER`, then resumed)."""
    fault = FAULTS[arm]
    attacks = {"a3": fault} if fault else {}
    out = root / arm
    if arm != "restart":
        return run_arm(trial_spec(args, attacks=attacks, signed=True), out)
    first = run_arm(trial_spec(args, attacks=attacks, signed=True, rounds=STOP_AFTER + 1), out)
    rest = run_arm(trial_spec(args, attacks=attacks, signed=True), out, resume=True)
    return {**rest, "train_s": first["train_s"] + rest["train_s"],
            "wall_s": first["wall_s"] + rest["wall_s"]}


def missed(result: dict[str, Any]) -> str:
    """a3's missed exchanges by kind, e.g. `forward 2, status 1` (— when none)."""
    kinds = Counter(m["kind"] for m in result["missed"] if m["agent"] == "a3")
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "—"


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    clean = results["clean"]
    print(f"\nSCALA, {args.model}/{args.dataset}, 4 agents ({FAST}), signed, {args.rounds} "
          f"rounds × T={args.local_steps}, deadline_s {args.deadline_s:g}; a3 faulty")
    print("| arm | training s | × clean | trial wall s | × clean | benched (times) | "
          "a3 missed | final accuracy | − clean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm, r in results.items():
        benched = ", ".join(f"{a} ({n})" for a, n in sorted(r["benched"].items())) or "nobody"
        print(f"| {arm} | {r['train_s']:.1f} | {r['train_s'] / clean['train_s']:.2f} | "
              f"{r['wall_s']:.1f} | {r['wall_s'] / clean['wall_s']:.2f} | {benched} | "
              f"{missed(r)} | {r['accuracy']:.4f} | {r['accuracy'] - clean['accuracy']:+.4f} |")
    print("\nforward step deadline s per round (`deadlines_s`; round seconds in brackets)")
    print("| round | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for i in range(args.rounds):
        cells = []
        for r in results.values():
            row = r["rows"][i]
            forward = row.get("deadlines_s", {}).get("forward")
            cells.append(("—" if forward is None else f"{forward:.1f}")
                         + f" ({row['seconds']:.1f})")
        print(f"| {i} | " + " | ".join(cells) + " |")
    for arm, r in results.items():
        if arm != "clean":
            print(f"ratio {arm}/clean: training {r['train_s'] / clean['train_s']:.2f}, "
                  f"trial wall {r['wall_s'] / clean['wall_s']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument("--model", default="mobilenetv3-small")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # 3 rounds × 2 steps (the restart arm stops after round 1), 20 s deadline
        args.rounds, args.local_steps, args.deadline_s = 3, 2, 20.0
    if args.rounds <= STOP_AFTER + 1:
        parser.error(f"--rounds must be over {STOP_AFTER + 1} (the restart arm resumes after "
                     f"round {STOP_AFTER})")
    os.environ[ALLOW_ENV] = "1"  # the faulty agent processes run their fault
    print(f"command: python benchmarks/bench_faults.py --rounds {args.rounds} --local-steps "
          f"{args.local_steps} --deadline-s {args.deadline_s:g}"
          + (" (--smoke)" if args.smoke else ""))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        for arm in FAULTS:
            results[arm] = one_arm(arm, args, Path(tmp))
            print(f"{arm}: {results[arm]['train_s']:.1f} s training", flush=True)
    report(results, args)


if __name__ == "__main__":
    main()
