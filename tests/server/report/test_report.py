"""`jetsplit report` and trial progress: the report renders from synthetic trial rows (with
and without the per-agent books, with gaps), from a real simulation's metrics, and without
matplotlib; progress prints one plain line per round when stdout is not a terminal."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from jetsplit.errors import ConfigError
from jetsplit.server.ops.progress import TrialProgress
from jetsplit.server.report.document import render_plan, report_command, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
AGENTS = {"a0": "orin-nano-8gb", "a1": "jetson-nano-4gb"}


def _agent(profile: str, round_: int, *, rich: bool) -> dict[str, Any]:
    """One agent's per-round books; the 'poorer' agent reports less, as other hardware may."""
    info: dict[str, Any] = {"profile": profile, "state": "online",
                            "compute_s": 1.5 + 0.1 * round_, "transfer_s": 0.4,
                            "wait_s": 0.2 * round_, "rss_mb": 900.0 + 10 * round_}
    if rich:
        info.update(available_mb=3000.0 - 50 * round_, cpu_percent=85.0,
                    temperature_c=48.5 + round_, power_mode="15W" if round_ else "MAXN",
                    estimate={"gflops": 10.0 + round_, "uplink_mbps": 48.0, "bad": 1.0,
                              "downlink_mbps": "junk"})
    else:
        info.update(available_mb=None, temperature_c=None)
    return info


def _row(round_: int, *, agents: bool, accuracy: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "round": round_, "algorithm": "psl", "selected": ["a0", "a1"],
        "missed": {"a1": "timeout"} if round_ == 2 else {},
        "train_loss": 2.3 - 0.3 * round_, "accuracy": accuracy,
        "balanced_accuracy": None if accuracy is None else accuracy - 0.02,
        "accuracy_std": None if accuracy is None else 0.03,
        "per_class_accuracy": [0.5, 0.6, None], "test_loss": 1.0,
        "bytes_up": 1_200_000, "bytes_down": 800_000,
        "bytes_by_kind": {"up": {"forward": 1_100_000, "get_weights": 100_000},
                          "down": {"backward": 700_000, "set_weights": 100_000}},
        "eval_bytes": {"up": {}, "down": {}}, "bundle_bytes": 5_000_000 if round_ == 0 else 0,
        "bytes_up_total": 1_200_000 * (round_ + 1),
        "bytes_down_total": 5_000_000 + 800_000 * (round_ + 1),
        "device_gflops": {"a0": 0.5, "a1": 0.5},
        "phases_s": {"forward": 0.5, "server": 0.3}, "seconds": 3.0 + round_,
        "tier_bytes": {"device-edge": 1_500_000, "edge-cloud": 500_000},
        "influence": {}, "activation_scale": {"a1": 1e-3} if round_ == 1 else {},
    }
    if agents:
        row["agents"] = {a: _agent(p, round_, rich=a == "a0") for a, p in AGENTS.items()}
    return row


def _synthetic_run(root: Path, *, agents: bool = True, missing_accuracy_round: int = -1,
                   rounds: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = [_row(r, agents=agents,
                 accuracy=None if r == missing_accuracy_round else 0.4 + 0.1 * r)
            for r in range(rounds)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "summary.json").write_text(json.dumps({
        "algorithm": "psl", "rounds": rounds, "run": "trial-test", "seconds": 20.5,
        "bytes_up": 1_200_000 * rounds, "bytes_down": 800_000 * rounds,
        "bundle_bytes": 5_000_000, "settings": {"algorithm": "psl", "rounds": rounds}}))
    (root / "plan.json").write_text(json.dumps({
        "model": "alexnet", "objective": "time",
        "devices": {"orin-nano-8gb": {"k": 3, "est_ms": 41.5, "bytes": 1_048_576},
                    "jetson-nano-4gb": {"k": 2, "est_ms": 97.0, "bytes": 2_097_152}}}))
    (root / "config.toml").write_text('[train]\nalgorithm = "psl"\nrounds = 4\n')
    return root


def _image_links(report: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)


def _assert_pngs(run_dir: Path, links: list[str]) -> None:
    for link in links:
        assert not Path(link).is_absolute() and "/" not in link, link
        data = (run_dir / link).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), link


def test_report_with_agent_books(tmp_path: Path) -> None:
    run = _synthetic_run(tmp_path / "run")
    path = write_report(run, title="Trial of PSL")
    text = path.read_text()
    assert path == run / "report.md" and text.startswith("# Trial of PSL\n")
    links = _image_links(text)
    assert set(links) == {"accuracy.png", "loss.png", "accuracy_vs_cost.png", "round_time.png",
                          "bytes.png", "tier_bytes.png", "agent_time.png", "agent_memory.png",
                          "influence.png"}
    _assert_pngs(run, links)
    assert "Skipped" not in text
    # summary paragraph: algorithm, rounds, agents with profiles, accuracy, traffic, time
    assert "**psl**, 4 rounds, 2 agents (a0 (orin-nano-8gb), a1 (jetson-nano-4gb))" in text
    assert "final accuracy 70.00% (balanced 68.00%, ± 3.00 across clients)" in text
    assert "4.80 MB up / 3.20 MB down (plus bundle 5.00 MB)" in text and "20.5 s" in text
    # per-round table (1-based rounds), agent table with summed times, plan, config
    assert "| round | selected | missed | train loss | accuracy % |" in text
    assert "| 3 | 2 | a1 | 1.7000 | 60.00 |" in text
    agent_line = next(line for line in text.splitlines() if line.startswith("| a0 |"))
    assert "| orin-nano-8gb | 4 | 0 | 6.60 | 1.60 | 1.20 | 0.91 | 2.000 |" in agent_line
    assert "mean CPU %" in text and "max °C" in text
    # the last power mode and live estimates; the poorer agent reports none
    assert "| power mode | GFLOPS (live) | up Mbit/s (live) |" in text
    assert "down Mbit/s (live)" not in text  # nobody reported a number for it
    assert agent_line.endswith("| 15W | 13.00 | 48.0 |"), agent_line
    a1_line = next(line for line in text.splitlines() if line.startswith("| a1 |"))
    assert a1_line.endswith("| — | — | — |"), a1_line
    assert "| name | k | est_ms | bytes |" in text and "| orin-nano-8gb | 3 | 41.5 |" in text
    assert '```toml\n[train]\nalgorithm = "psl"' in text


def test_report_without_agent_books_and_a_missing_accuracy(tmp_path: Path) -> None:
    run = _synthetic_run(tmp_path / "run", agents=False, missing_accuracy_round=3)
    text = write_report(run).read_text()
    assert text.startswith("# jetsplit run trial-test\n")
    links = _image_links(text)
    assert set(links) == {"accuracy.png", "loss.png", "accuracy_vs_cost.png", "round_time.png",
                          "bytes.png", "tier_bytes.png", "influence.png"}
    _assert_pngs(run, links)
    assert text.count("_Skipped: the metrics rows carry no per-agent `agents` field") == 2
    assert "no accuracy in the last round (last measured: 60.00% in round 3)" in text
    assert "| 4 | 2 | none | 1.4000 | — | — |" in text
    # the agent table still lists who took part, from `selected` and `device_gflops`
    assert re.search(r"\| a1 \| — \| 4 \| 1 \| — \| — \| — \| — \| 2\.000 \|", text)


def test_report_survives_sparse_and_torn_rows(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"round": 0}, {"round": 1, "accuracy": "bad", "agents": {"a0": None,
                                                                      "a1": {"rss_mb": None}}},
            {"round": 2, "bytes_up": 10, "selected": "a0", "missed": ["x"]}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + '\n{"round": 3')
    text = write_report(run).read_text()
    assert "1 unreadable line(s) of metrics.jsonl were skipped" in text
    assert "_Skipped: no round reports an accuracy._" in text
    assert "_No plan.json in this run folder._" in text and "No config.toml" in text
    _assert_pngs(run, _image_links(text))
    # an earlier report's plot that no longer has data is removed with its link
    (run / "agent_time.png").write_bytes(PNG_MAGIC)
    write_report(run)
    assert not (run / "agent_time.png").exists()


def test_report_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _synthetic_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    text = write_report(run).read_text()
    assert "_Plots skipped: matplotlib is not installed" in text
    assert _image_links(text) == [] and not list(run.glob("*.png"))
    assert "| round |" in text and "| agent |" in text


def test_report_command_and_missing_folder(tmp_path: Path) -> None:
    run = _synthetic_run(tmp_path / "run", rounds=3)
    app = typer.Typer()
    app.command()(report_command)
    result = CliRunner().invoke(app, [str(run), "--title", "CLI report"])
    assert result.exit_code == 0, result.output
    assert "report.md" in result.output
    assert (run / "report.md").read_text().startswith("# CLI report\n")
    with pytest.raises(ConfigError, match="metrics.jsonl"):
        write_report(tmp_path / "nowhere")


def test_render_plan_handles_nested_planner_output() -> None:
    plan = {"model": "alexnet", "chosen": {"orin": 3, "nano": 2},
            "devices": [{"profile": "orin", "best_k": 3,
                         "rows": [{"k": 2, "total_ms": 12.5, "memory": {"peak_mb": 300}}]}]}
    text = "\n".join(render_plan(plan))
    assert "| model | alexnet |" in text and "**chosen**" in text and "| orin | 3 |" in text
    assert "| profile | best_k |" in text and "**devices[orin].rows**" in text
    assert "| k | total_ms | memory.peak_mb |" in text and "| 2 | 12.5 | 300 |" in text


def test_progress_prints_one_line_per_round_without_a_tty(tmp_path: Path) -> None:
    out = io.StringIO()
    rows = [_row(r, agents=r == 0, accuracy=0.5 + 0.1 * r) for r in range(3)]
    rows[1]["replan"] = {"moved": {"a0": [1, 2]}}  # server/cuts/replanning.py switched after it
    with TrialProgress(3, file=out) as progress:
        assert not progress.live  # a StringIO is not a terminal
        progress.agent_states({"a0": "online", "a1": "busy"})
        for row in rows:
            progress.update(row)
            progress.agent_states({"a1": "offline"})  # shows in the next round's line
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("trial psl: round 1/3; accuracy 50.00%")
    assert "round 3/3" in lines[2] and "up 3.60 MB, down 7.40 MB so far" in lines[2]
    assert "offline" not in lines[0] and all("offline: a1" in line for line in lines[1:])
    assert [("re-planned a0 1→2" in line) for line in lines] == [False, True, False]


def test_progress_live_display_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=150)
    with TrialProgress(2, title="demo", console=console) as progress:
        assert progress.live
        progress.update(_row(0, agents=True, accuracy=None))
        progress.agent_states({"a1": "offline", "a2": "busy"})
        progress.update({"round": 1, "accuracy": 0.7})
    shown = out.getvalue()
    assert "round 2/2" in shown and "accuracy 70.00%" in shown
    assert "orin-nano-8gb" in shown and "a2" in shown and "offline" in shown


def test_report_of_a_real_simulation(tmp_path: Path) -> None:
    from jetsplit.server.run.simulate import simulate
    from jetsplit.server.training.settings import Settings

    run = tmp_path / "sim"
    simulate(Settings(algorithm="splitfed-v1", rounds=2, local_steps=2, batch=16),
             model="alexnet", split=2, dataset="digits", clients=2, partition_scheme="iid",
             out_dir=run)
    text = write_report(run).read_text()
    links = _image_links(text)
    assert {"accuracy.png", "bytes.png"} <= set(links)
    _assert_pngs(run, links)
    assert "**splitfed-v1**, 2 rounds, 2 agents (a0, a1)" in text
    assert "| 1 | 2 | none |" in text and "| 2 | 2 | none |" in text
    assert re.search(r"\| a0 \| — \| 2 \| 0 \|.*\| online \|", text)
    assert "settings from summary.json" in text and '"algorithm": "splitfed-v1"' in text


def _planned_run(root: Path) -> Path:
    """A synthetic trial with a planner-shaped plan.json (per-device rows, fleet costs,
    emulation), as `jetsplit trial` writes it."""
    _synthetic_run(root)
    device_rows = [{"k": k, "cut": f"layer{k}", "device_gflops": 0.1 * k,
                    "budget_bytes": 2_576_980_377, "bytes_round": 4_000_000 / k,
                    "memory": {"total": 316_033_024 + k}, "fits": True, "total_ms": 300.0 + k}
                   for k in (1, 2, 3)]
    (root / "plan.json").write_text(json.dumps({
        "model": "alexnet", "algorithm": "psl", "chosen_k": 2, "used_split": 2,
        "planned_as": "psl", "settings": {"rounds": 4, "local_steps": 10},
        "devices": [{"profile": p, "rows": device_rows} for p in AGENTS.values()],
        "fleet": [{"k": k, "value": 500.0 + k, "fits": True} for k in (1, 2, 3)],
        "emulation": {"compute_dilation": 68.8, "profiles": {
            p: {"profile": p, "compute_slowdown": 2.0, "uplink_mbps": 50.0,
                "downlink_mbps": 50.0} for p in AGENTS.values()}}}))
    return root


def test_report_reads_in_a_minute(tmp_path: Path) -> None:
    """Headline first (with the plan's prediction), the plan as a per-device table in GiB,
    emulation stated, and every PNG opens as a non-blank image."""
    from matplotlib.image import imread

    run = _planned_run(tmp_path / "run")
    text = write_report(run).read_text()
    head = text.split("## Plots")[0]
    assert "## Headline" in head and "| final test accuracy | 70.00% (best 70.00%)" in head
    # 4 rounds × 2 devices × 2 MB per round at k = 2, and 502 ms × 10 steps × 4 rounds
    assert "| training traffic | 8.00 MB | 16.00 MB |" in head
    assert "20.1 s at the profiles' speed (compute ×68.8 here)" in head
    assert "all traffic (with bundle 5.00 MB" in head
    # a common cut: every device at the plan's k = 2, memory and MB from its row there
    plan = text.split("## Split plan")[1]
    assert "Every device at k = 2 (after layer2); planned as psl" in plan
    assert ("| a1 | jetson-nano-4gb | layer2 (2) | — | 1.65 | — | 0.40 | 0.29 | 0.91 | 2.40 | "
            "yes | 2.00 |") in plan
    assert ("- every device (a0, a1): k = 2 (after layer2) — the plan's cut: the fleet's "
            "predicted time per iteration") in plan and "the least is k = 1 at 501 ms" in plan
    assert "| ms | 501 | **502** | 503 |" in plan
    assert "budget_bytes" not in text and "memory.context" not in text
    assert "compute runs ×68.8 slower" in text and "50/50 Mbit/s" in text
    pngs = sorted(run.glob("*.png"))
    assert {p.name for p in pngs} >= {"accuracy.png", "loss.png", "accuracy_vs_cost.png",
                                     "round_time.png", "bytes.png", "agent_memory.png"}
    for png in pngs:
        assert f"]({png.name})" in text
        pixels = imread(png)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert float(pixels[..., :3].std()) > 0.02, f"{png.name} is blank"


def test_report_compare_overlays_runs(tmp_path: Path) -> None:
    from matplotlib.image import imread

    a, b = _planned_run(tmp_path / "a"), _synthetic_run(tmp_path / "b", rounds=2)
    app = typer.Typer()
    app.command()(report_command)
    result = CliRunner().invoke(app, [str(a), "--compare", str(b)])
    assert result.exit_code == 0, result.output
    assert float(imread(a / "compare.png")[..., :3].std()) > 0.02


# A fleet planned with a cut per device (numbers chosen so the fleet's choice differs from
# one device's own best): per profile and cut k, compute / transfer / server ms per
# iteration. Nano: k = 1 is its own best, k = 3 does not fit. Orin: its own best is k = 2,
# but at k = 3 it stays under the Nano's pace (78 < 80 ms) and saves the server 5 ms, so
# the planner puts it at 3: 80 + 300 + 245 = 625 ms per iteration against 630 at (1, 2).
PER_DEVICE_MS = {
    "jetson-nano-4gb": {1: (20.0, 60.0, 300.0), 2: (200.0, 40.0, 250.0),
                        3: (500.0, 30.0, 200.0)},
    "orin-nx-16gb": {1: (5.0, 60.0, 300.0), 2: (30.0, 40.0, 250.0), 3: (48.0, 30.0, 245.0)},
}
PER_DEVICE_AGENTS = {"a0": ("jetson-nano-4gb", 1), "a1": ("orin-nx-16gb", 3),
                     "a2": ("jetson-nano-4gb", 1)}


def _per_device_plan() -> dict[str, Any]:
    budgets = {"jetson-nano-4gb": 2_576_980_377, "orin-nx-16gb": 12_884_901_888}
    devices = []
    for profile, by_k in PER_DEVICE_MS.items():
        rows = [{"k": k, "cut": f"conv{k}", "compute_ms": c, "transfer_ms": t, "server_ms": s,
                 "total_ms": c + t + s, "budget_bytes": budgets[profile],
                 "memory": {"total": 300 * 2**20 + k * 2**20},
                 "fits": not (profile == "jetson-nano-4gb" and k == 3),
                 "bytes_round": 4_000_000 / k, "bytes_amortised": 4_000_000 / k,
                 "device_gflops": 0.1 * k}
                for k, (c, t, s) in by_k.items()]
        best = {"jetson-nano-4gb": 1, "orin-nx-16gb": 2}[profile]
        devices.append({"profile": profile, "time_source": "peak", "best_k": best, "rows": rows})
    return {
        "model": "alexnet", "algorithm": "scala", "objective": "time", "planned_as": "scala",
        "settings": {"algorithm": "scala", "batch": 16, "local_steps": 10, "rounds": 4,
                     "dataset_size": 1000},
        "common_split": False, "chosen": {"jetson-nano-4gb": 1, "orin-nx-16gb": 3},
        "chosen_k": None, "server_cut": 3, "used_split": 3, "value": 625.0,
        "best_common_k": 1, "best_common_value": 680.0, "devices": devices,
        "fleet": [{"k": 1, "value": 680.0, "fits": True}, {"k": 2, "value": 740.0, "fits": True},
                  {"k": 3, "value": 975.0, "fits": False}],
        "agents": {a: {"profile": p, "cut": k} for a, (p, k) in PER_DEVICE_AGENTS.items()},
        "emulation": {"compute_dilation": 50.0, "profiles": {}}}


def _per_device_run(root: Path, *, trial: dict[str, Any] | None = None) -> Path:
    """A trial whose devices trained at different cuts (Nanos at 1, the Orin at 3; the
    server cut is 3), as `jetsplit trial` records it."""
    rows = []
    for r in range(4):
        row = _row(r, agents=False, accuracy=0.4 + 0.1 * r)
        row["selected"] = list(PER_DEVICE_AGENTS)
        row["missed"] = {}
        row["cuts"] = {a: k for a, (_, k) in PER_DEVICE_AGENTS.items()}
        row["agents"] = {a: {"profile": p, "cut": k, "state": "online",
                             "compute_s": 2.0 if k == 1 else 0.5 + 0.1 * r,
                             "transfer_s": 0.7, "wait_s": 1.0, "rss_mb": 512.0 + 100 * (k == 3)}
                         for a, (p, k) in PER_DEVICE_AGENTS.items()}
        rows.append(row)
    root.mkdir(parents=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "summary.json").write_text(json.dumps({"algorithm": "scala", "rounds": 4,
                                                   "seconds": 30.0}))
    (root / "plan.json").write_text(json.dumps(_per_device_plan()))
    if trial is not None:
        (root / "trial.json").write_text(json.dumps(trial))
    return root


def _section(text: str) -> str:
    return text.split("## Split plan")[1].split("## Configuration")[0]


def test_plan_section_shows_each_device_at_its_own_cut(tmp_path: Path) -> None:
    """Per agent: the cut it trained at (not the server cut), the planner's per-round
    prediction from its own profile's row at that cut beside the measured means, and the
    choice in words (the device's own best, or the fleet's when that differs)."""
    text = write_report(_per_device_run(tmp_path / "run"), title="t").read_text()
    plan = _section(text)
    assert ("the coordinator completes the shallower ones to the server cut k = 3: a0, a2 "
            "(jetson-nano-4gb) at k = 1 (after conv1); a1 (orin-nx-16gb) at k = 3 "
            "(after conv3)") in plan
    # the Nanos trained at 1: 20 and 60 ms/iteration × 10 iterations, measured 2.00 and
    # 0.70 s per round; memory 301 MiB predicted against 512 MiB RSS; 4 MB per round
    assert ("| a0 | jetson-nano-4gb | conv1 (1) | 0.20 | 2.00 | 0.60 | 0.70 | 0.29 | 0.50 | "
            "2.40 | yes | 4.00 |") in plan
    assert plan.count("| conv1 (1) |") == 2
    # the Orin at 3: 48 and 30 ms; measured compute 0.5, 0.6, 0.7, 0.8 → 0.65 s per round
    assert ("| a1 | orin-nx-16gb | conv3 (3) | 0.48 | 0.65 | 0.30 | 0.70 | 0.30 | 0.60 | "
            "12.00 | yes | 1.33 |") in plan
    assert "Split used" not in text and "planner's choice: None" not in text
    assert ("- a0, a2 (jetson-nano-4gb): k = 1 (after conv1) — the planner chose the "
            "shallowest cut because it minimised this device's predicted round time: 3.80 s "
            "per round") in plan
    assert "against 4.90 s at k = 2, the next best; k = 3 would not fit its 2.40 GiB." in plan
    assert ("- a1 (orin-nx-16gb): k = 3 (after conv3) — the planner chose the deepest cut, "
            "deeper than its own fastest k = 2: its compute + transfer goes from 70 to 78 ms "
            "per iteration and the server's work for it from 250 to 245 ms, so the fleet's "
            "iteration takes 625 ms against 630 ms with this device at k = 2") in plan
    assert ("625 ms per iteration (the slowest device's compute + transfer plus the server's "
            "work for every device), 6.25 s per round of 10 iterations, against 680 ms "
            "(6.80 s) with every device at the best common cut k = 1") in plan
    # the common cuts' costs, the best common one in bold, the one that does not fit marked
    assert "| ms | **680** | 740 | 975 ✗ |" in plan
    # headline: each device's MB per round at its own cut (4 + 1.33 + 4) × 4 rounds, and
    # the fleet's 625 ms × 10 iterations × 4 rounds
    head = text.split("## Plots")[0]
    assert "| training traffic | 8.00 MB | 37.33 MB |" in head
    assert "25.0 s at the profiles' speed" in head


def test_plan_section_names_cuts_set_by_hand_and_reasons_the_plan_gives(tmp_path: Path
                                                                        ) -> None:
    text = write_report(_per_device_run(tmp_path / "hand", trial={"cuts": {"a1": 3}})
                        ).read_text()
    assert ("- a1 (orin-nx-16gb): k = 3 (after conv3) — set by hand (--cut a1=3), which is "
            "also the planner's choice: the deepest cut, deeper than its own fastest") in text
    run = _per_device_run(tmp_path / "why")
    plan = json.loads((run / "plan.json").read_text())
    plan["chosen"]["orin-nx-16gb"] = 2  # the run's cut is no longer the planner's
    plan["agents"]["a0"]["reason"] = "the smallest activation that fits the uplink"
    (run / "plan.json").write_text(json.dumps(plan))
    text = _section(write_report(run).read_text())
    assert "- a1 (orin-nx-16gb): k = 3 (after conv3) — not the planner's choice (k = 2)." in text
    assert ("- a0, a2 (jetson-nano-4gb): k = 1 (after conv1) — the smallest activation that "
            "fits the uplink.") in text


def test_per_class_accuracy_by_the_runs_class_names_and_skipped_images(tmp_path: Path) -> None:
    run = _synthetic_run(tmp_path / "run", rounds=3)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for round_, row in enumerate(rows):  # cumulative counts: the last one is the run's
        row["agents"]["a1"]["images_skipped"] = 2 * round_
        row["agents"]["a0"]["images_skipped"] = "junk"
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary,
                                                  "classes": ["cat", "dog|x", "fox"]}))
    text = write_report(run).read_text()
    assert "Per-class accuracy in the last round (%): cat: 50.00, dog\\|x: 60.00, fox: —." \
        in text
    header = next(line for line in text.splitlines() if line.startswith("| agent |"))
    column = header.split(" | ").index("images skipped")
    cells = {line.split(" | ")[0]: line.split(" | ")[column]
             for line in text.splitlines() if line.startswith(("| a0 |", "| a1 |"))}
    assert cells == {"| a0": "—", "| a1": "4"}


def test_per_class_accuracy_falls_back_to_indices(tmp_path: Path) -> None:
    run = _synthetic_run(tmp_path / "run", rounds=2)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "classes": ["cat", "dog"]}))
    text = write_report(run).read_text()  # two names for three classes: not the run's
    assert "Per-class accuracy in the last round (%): 0: 50.00, 1: 60.00, 2: —." in text
    assert "images skipped" not in text
