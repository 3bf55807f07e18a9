"""The fault matrix as emulated trials: the clean fleet and one faulty device of four per
fault, side by side (issue 45; the same faults as tests/integration/test_fault_matrix.py).

The trials are bench_silent.py's (SCALA, 4 × orin-nx-16gb, iid, seed 0: `trial_spec`),
every message signed with a trial fleet key (`TrialSpec.signed`: the replay window
applies, so a clock jump bites). Each fault strikes from round R = 2 on (`@2`; rounds count
from 0; 1 with --smoke), once every exchange kind has been timed (edge_agent/faults.py):

* `clean`: no fault;
* `silent`: a3 answers nothing from round R on (`silent@R`);
* `every-other`: a3 answers every second command from round R on;
* `hang-upload`: a3 sends half of a chunked reply in round R, then nothing;
* `clock-jump`: a3's wall clock jumps +1 h in round R (`clock-jump:3600@R`);
* `restart`: `silent@R`, and the coordinator stopped after round R (a3 benched in it) and a
  new one resumed from its checkpoint, the broker and the agent processes up throughout
  (`run_trial(restart_after=R)`; tests/integration/test_fault_matrix.py kills the
  coordinator process mid-run).

Printed per arm: training seconds (`summary.json`; the restart arm's two parts added), the
seconds of the rounds from R on (the fault's rounds, without round 0's cold start, whose
length follows the machine's load more than any fault) and the whole trial's wall time, each
as a ratio to clean; who sat out (times) and a3's missed exchanges; the final accuracy
against clean; then per round each arm's forward step deadline (`deadlines_s` in the
metrics rows). With `--repeats N` the arms run N times, interleaved (clean, faults, clean,
faults, …), and the times are medians; the books are the first repeat's.

    JETSPLIT_ALLOW_ATTACKS=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_faults.py \
        [--rounds 6] [--local-steps 5] [--deadline-s 60] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench_silent import FAST, run_arm, trial_spec  # benchmarks/ is on sys.path as a script

from jetsplit.edge_agent.attacks import ALLOW_ENV

FAULTS = {"clean": None, "silent": "silent", "every-other": "every-other",
          "hang-upload": "hang-upload", "clock-jump": "clock-jump:3600", "restart": "silent"}
FAULT_ROUND = 2  # the faults strike from here (1 with --smoke), the restart arm stops after
# --smoke's arms beside clean (each trial is about a minute on a busy 2-core machine, and the
# smoke run has under ten): a fault that needs the signing, and the resumed trial
SMOKE_ARMS = ["clock-jump", "restart"]


def one_arm(arm: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One arm's trial (the restart arm: stopped after round `args.at`, then resumed)."""
    fault = FAULTS[arm]
    attacks = {"a3": f"{fault}@{args.at}"} if fault else {}
    out = root / arm
    return run_arm(trial_spec(args, attacks=attacks, signed=True), out,
                   restart_after=args.at if arm == "restart" else None)


def from_round(result: dict[str, Any], at: int) -> float:
    """Seconds of the rounds from `at` on (the metrics rows: a resumed run's are all there)."""
    return sum(row["seconds"] for row in result["rows"] if row["round"] >= at)


def medians(repeats: list[dict[str, Any]], at: int) -> dict[str, Any]:
    """The first repeat's books with each time the median over the repeats."""
    return {**repeats[0], "train_s": statistics.median(r["train_s"] for r in repeats),
            "wall_s": statistics.median(r["wall_s"] for r in repeats),
            "from_s": statistics.median(from_round(r, at) for r in repeats),
            "repeats": len(repeats)}


def missed(result: dict[str, Any]) -> str:
    """a3's missed exchanges by kind, e.g. `forward 2, status 1` (— when none)."""
    kinds = Counter(m["kind"] for m in result["missed"] if m["agent"] == "a3")
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "—"


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    clean = results["clean"]
    print(f"\nSCALA, {args.model}/{args.dataset}, 4 agents ({FAST}), signed, {args.rounds} "
          f"rounds × T={args.local_steps}, deadline_s {args.deadline_s:g}; a3 faulty from "
          f"round {args.at}; medians of {clean['repeats']}")
    print(f"| arm | training s | × clean | rounds {args.at}+ s | × clean | trial wall s | "
          "× clean | benched (times) | a3 missed | final accuracy | − clean |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, r in results.items():
        benched = ", ".join(f"{a} ({n})" for a, n in sorted(r["benched"].items())) or "nobody"
        print(f"| {arm} | {r['train_s']:.1f} | {r['train_s'] / clean['train_s']:.2f} | "
              f"{r['from_s']:.1f} | {r['from_s'] / clean['from_s']:.2f} | "
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
                  f"rounds {args.at}+ {r['from_s'] / clean['from_s']:.2f}, "
                  f"trial wall {r['wall_s'] / clean['wall_s']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument("--model", default="mobilenetv3-small")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--arms", nargs="+", choices=list(FAULTS)[1:], default=None,
                        help="the faults to run beside clean (default: all; --smoke: "
                             f"{' '.join(SMOKE_ARMS)})")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the arms this many times, interleaved; medians")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.at = FAULT_ROUND
    if args.smoke:  # 3 rounds × 2 steps, faults from round 1, a 20 s deadline
        args.rounds, args.local_steps, args.deadline_s, args.at = 3, 2, 20.0, 1
    args.arms = args.arms or (SMOKE_ARMS if args.smoke else list(FAULTS)[1:])
    if args.rounds <= args.at + 1:
        parser.error(f"--rounds must be over {args.at + 1} (the restart arm resumes after "
                     f"round {args.at})")
    os.environ[ALLOW_ENV] = "1"  # the faulty agent processes run their fault
    print(f"command: python benchmarks/bench_faults.py --rounds {args.rounds} --local-steps "
          f"{args.local_steps} --deadline-s {args.deadline_s:g} --repeats {args.repeats}"
          + (" (--smoke)" if args.smoke else ""))
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ["clean", *args.arms]}
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        for repeat in range(args.repeats):
            for arm in runs:
                result = one_arm(arm, args, Path(tmp) / str(repeat))
                runs[arm].append(result)
                print(f"{arm} (repeat {repeat + 1}): {result['train_s']:.1f} s training, "
                      f"rounds {args.at}+ {from_round(result, args.at):.1f} s", flush=True)
    report({arm: medians(rs, args.at) for arm, rs in runs.items()}, args)


if __name__ == "__main__":
    main()
