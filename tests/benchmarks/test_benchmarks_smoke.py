"""Every script in benchmarks/ runs in its smoke mode (`--smoke`: tiny sizes) and prints its
table and ratio lines, so a benchmark that breaks fails the suite instead of waiting for
someone to run it. Timing is never asserted: the numbers are whatever this machine gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: script → lines (substrings) its smoke run must print: its table header and its ratios.
EXPECTED: dict[str, tuple[str, ...]] = {
    "bench_transport.py": ("# 1. codecs", "ratio MQTT / in-process per step: mean",
                           "losses: max |MQTT - in-process| over all steps = 0 ",
                           "Mosquitto / embedded throughput:"),
    "bench_server.py": ("coordinator / plain",),
    "bench_overhead.py": ("command: python benchmarks/bench_overhead.py --smoke",
                          "| run | user+sys CPU s | × plain | peak RSS MB | × plain |",
                          "| plain PyTorch loop | ", "| simulate --algorithm splitfed-v1 | ",
                          "| simulate --algorithm scala | ", "ratio splitfed-v1 / plain CPU: ",
                          "ratio scala / plain CPU: ",
                          "| plain loop, per-client models | ",
                          "| plain loop, shared server, two backwards | ",
                          "| CPU × its plain loop | RSS × its plain loop |",
                          "ratio splitfed-v1 / its plain loop (per-client models) CPU: ",
                          "| method | clients | fraction | selected | peak RSS MB |",
                          "| splitfed-v1 | 16 | 0.125 | 2 | ", "| scala | 4 | 0.5 | 2 | ",
                          "peak RSS splitfed-v1 16 / 4 clients: "),
    "fuzz_wire.py": ("unsigned: 200 frames", "device key Ed25519: 200 frames", "peak RSS +"),
    "bench_runtime.py": ("torch/ort", "layers within ±30%"),
    "accuracy.py": ("| method | final accuracy |", "| psl | "),
    "comm.py": ("| method | accuracy (mean) | MB per client | bytes / SplitFed V1 |",
                "| splitfed-v1 | ", "| sherl | "),
    "papers.py": ("wall time",),
    "bench_agent.py": ("agent training (max VmRSS)", "ratio training/bare torch"),
    "bench_data.py": ("command: python benchmarks/bench_data.py --smoke",
                      "| images | loading img/s | client step img/s | training img/s |",
                      "ratio training / client step: ", "peak RSS N=24 / N=8: "),
    "bench_emulation.py": ("ratio books", "median measured/expected: books"),
    "bench_hetero.py": ("mean round wall-time ratio per-device/common",),
    "bench_silent.py": ("command: python benchmarks/bench_silent.py",
                        "| trial | training s | trial wall s | final accuracy | benched (times) |",
                        "| silent | ", "ratio silent/clean: training ", "ratio slow/clean: ",
                        "benched in the slow trial: nobody"),
    "bench_faults.py": ("command: python benchmarks/bench_faults.py --rounds 3 --local-steps 2",
                        "| arm | training s | × clean | rounds 1+ s | × clean | trial wall s | "
                        "× clean | benched (times) | a3 missed | final accuracy | − clean |",
                        "| clean | ", "| clock-jump | ", "| restart | ",
                        "ratio clock-jump/clean: training ", "ratio restart/clean: training ",
                        "forward step deadline s per round"),
    "bench_adaptive.py": ("| round s re-plan | round s plan-once | ratio | predicted |",
                          "mean round-time ratio re-plan/plan-once after the change:"),
    "bench_defence_cost.py": ("| label check, per step | ", "| direction check, per average | ",
                              "| SCALA server step, gradient_shares = all | ",
                              "ratio label check / server step: ",
                              "ratio SCALA step all / free: ",
                              "ratio SplitFed V2 gradient bound / its step: ",
                              "| aggregator | ms | × mean | peak MiB allocated | × one upload |",
                              "| median | ", "| trimmed-mean | ", "| multi-krum | "),
    "bench_scale.py": ("| agents | register s |", "growth 2 -> 20 agents (10x):"),
    "bench_robust.py": ("command: python benchmarks/bench_robust.py --smoke",
                        "| method | attack | attackers | none | default | "
                        "default-provisioned | multi-krum |",
                        "| splitfed-v1 | size-lie:1000000000 | 1 | ",
                        "the default-provisioned defence against clean, per seed",
                        "| splitfed-v1 | scale:1000 | 1 | ", "time ratio",
                        "mean accuracy over the last 5 rounds, mean ± spread",
                        "the default defence against clean, per seed",
                        "| worst, last rounds |"),
    "gapsl_vs_psl.py": ("command: python benchmarks/gapsl_vs_psl.py --smoke",
                        "| method | lr 0.01 | lr 0.03 | chosen |",
                        "| method | lr | final test accuracy (mean ± spread) | per seed |",
                        "GAPSL - PSL: ", "the paper reports +16.0"),
    "method_matrix.py": ("command: python benchmarks/method_matrix.py --smoke", "| method | iid |",
                         "| psl | ", "| sherl | "),
}


def test_every_benchmark_has_a_smoke_run() -> None:
    """Every script, that is: `_name.py` is a module the scripts import."""
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(EXPECTED), "add the new benchmark's smoke run here"


# Their smoke runs are whole emulated trials (minutes each on 2 cores): in the slow tier,
# so that `make test` stays near 20 minutes.
SLOW_SMOKE = ("bench_faults.py", "bench_hetero.py", "bench_scale.py", "bench_silent.py")


@pytest.mark.parametrize("script", [
    pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SMOKE else s for s in sorted(EXPECTED)])
def test_benchmark_smoke_run(script: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=580)
    tail = f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"
    assert done.returncode == 0, tail
    for line in EXPECTED[script]:
        assert line in done.stdout, f"{line!r} missing\n{tail}"
    assert "DIVERGED" not in done.stdout and "nan" not in done.stdout.lower().split(), tail


def test_bench_robust_scores_the_mean_of_the_last_rounds(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven rounds (one row without an accuracy, one half-written line): the mean of the
    last five accuracies, not the final one nor all seven."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_robust import last_rounds

    from jetsplit.server.report.run_data import load_run

    rows = [f'{{"round": {i}, "accuracy": {a}}}' for i, a in
            enumerate([0.1, 0.2, 0.90, 0.94, 0.92, 0.96, 0.86])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(
        rows[:3] + ['{"round": 2.5}'] + rows[3:] + ['{"round": 7, "accu']) + "\n")
    rows = load_run(tmp_path).rows
    assert last_rounds(rows, 5) == pytest.approx((0.90 + 0.94 + 0.92 + 0.96 + 0.86) / 5)
    assert last_rounds(rows, 1) == pytest.approx(0.86)
    assert last_rounds(rows, 50) == pytest.approx(sum([0.1, 0.2, 0.90, 0.94, 0.92, 0.96,
                                                           0.86]) / 7)
