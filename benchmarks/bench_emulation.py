"""Device emulation fidelity: a trial with a Jetson Nano agent and an Orin NX agent.

Both agents get the same amount of data (IID) and the same work per round; the Nano's
per-round compute time over the Orin NX's should be about the ratio of their profiles'
speeds (effective GFLOPS). Compute time is normalised by the GFLOPs each agent ran (from
the cost model), so a difference in batch shares does not skew the ratio. Printed per
round: the emulated books (CPU time × slowdown) and what the compute really took in wall
time on this machine (sleep included), both against the expected ratio.

    .venv/bin/python benchmarks/bench_emulation.py [--rounds 4] [--model alexnet]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from jetsplit.profiles import resolve_profile
from jetsplit.server.run.trial import run_trial
from jetsplit.server.run.trial_fleet import TrialSpec

NANO, ORIN = "jetson-nano-4gb", "orin-nx-16gb"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # round 1 installs the bundle and is left out: 2 rounds, 1 step each
        args.rounds, args.local_steps = 2, 1
        args.model, args.dataset = "mobilenetv3-small", "digits"
    expected = resolve_profile(ORIN).effective_gflops() / resolve_profile(NANO).effective_gflops()
    spec = TrialSpec(train={"algorithm": "splitfed-v2", "rounds": args.rounds,
                            "local_steps": args.local_steps, "batch": 64},
                     agents=2, profiles=[NANO, ORIN], model=args.model, dataset=args.dataset,
                     partition="iid")
    with tempfile.TemporaryDirectory(prefix="bench-emulation-") as tmp:
        out = Path(tmp) / "trial"
        run_trial(spec, out, live=False)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        plan = json.loads((out / "plan.json").read_text())["emulation"]
    print(f"host {plan['host_gflops_1_thread']} GFLOPS (1 thread); compute dilation "
          f"{plan['compute_dilation']}×; slowdowns: "
          + ", ".join(f"{n} {p['compute_slowdown']:.2f}×" for n, p in plan["profiles"].items()))
    print(f"expected Nano/Orin NX compute time per GFLOP: {expected:.2f} "
          f"(profiles' effective GFLOPS ratio)")
    print("round | nano s (books) | orin s (books) | ratio books | ratio wall | expected")
    books, walls = [], []
    for row in rows[1:]:  # round 1 also installs the bundle (verification is compute too)
        a, g = row["agents"], row["device_gflops"]
        nano, orin = a["a0"], a["a1"]
        per = {k: (nano[k] / g["a0"]) / (orin[k] / g["a1"])
               for k in ("compute_s", "compute_wall_s")}
        books.append(per["compute_s"])
        walls.append(per["compute_wall_s"])
        print(f"{row['round'] + 1:5d} | {nano['compute_s']:14.2f} | {orin['compute_s']:14.2f} "
              f"| {per['compute_s']:11.2f} | {per['compute_wall_s']:10.2f} | {expected:.2f}")
    print(f"median measured/expected: books {statistics.median(books) / expected:.3f}, "
          f"wall {statistics.median(walls) / expected:.3f}")


if __name__ == "__main__":
    main()
