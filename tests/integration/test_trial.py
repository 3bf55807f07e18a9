"""`jetsplit trial`: a short field trial (embedded broker, 2 emulated agent processes,
2 rounds) writes its report with non-empty PNG plots; the emulation it plans keeps the
profiles' speed ratios; the agent configs it writes load; bad options are one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jetsplit.edge_agent.emulation import EmulationSection
from jetsplit.profiles import resolve_profile
from jetsplit.server.run.trial import emulations
from jetsplit.server.run.trial_fleet import TrialSpec, agent_config

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def test_short_trial_writes_report_with_plots(tmp_path: Path) -> None:
    out = tmp_path / "trial"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trace = tmp_path / "drop.csv"  # a1's device drops to a 10 W mode from round 1
    trace.write_text("round,compute,power_mode\n1,0.5,10W\n")
    done = subprocess.run(
        [sys.executable, "-m", "jetsplit.cli", "trial", "--agents", "2", "--rounds", "2",
         "--local-steps", "3", "--model", "mobilenetv3-small", "--dataset", "digits",
         "--batch", "32", "--out", str(out), "--trace", f"a1={trace}"],
        capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"report: {out / 'report.md'}" in done.stdout
    report = (out / "report.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert {"accuracy.png", "bytes.png", "agent_time.png", "agent_memory.png"} <= set(images)
    for name in images:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 1000, name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    for row in rows:
        assert set(row["agents"]) == {"a0", "a1"}
        for info in row["agents"].values():
            assert info["compute_s"] > 0 and info["rss_mb"] > 0 and info["state"] == "online"
            assert info["estimate"]["gflops"] > 0  # the live estimate of its speed
    assert [r["agents"]["a1"]["power_mode"] for r in rows] == ["unknown", "10W"]
    assert [r["agents"]["a0"]["power_mode"] for r in rows] == ["unknown", "unknown"]
    assert rows[0]["agents"]["a0"]["profile"] == "jetson-nano-4gb"
    assert rows[0]["agents"]["a1"]["profile"] == "orin-nx-16gb"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["used_split"] >= 1 and plan["emulation"]["host_gflops_1_thread"] > 0
    assert plan["emulation"]["traces"] == {"a1": str(trace)}
    assert json.loads((out / "trial.json").read_text())["agents"] == 2
    assert (out / "config.toml").is_file() and (out / "checkpoint" / "state.json").is_file()


def test_emulation_keeps_profile_speed_ratios() -> None:
    nano, orin = resolve_profile("jetson-nano-4gb"), resolve_profile("orin-nx-16gb")
    sections, dilation = emulations({"n": nano, "o": orin}, host=10.0, enabled=True,
                                    headroom=2.0)
    ratio = orin.effective_gflops() / nano.effective_gflops()
    assert sections["o"].compute_slowdown == pytest.approx(2.0)  # fastest: half this machine
    assert sections["n"].compute_slowdown == pytest.approx(2.0 * ratio)
    assert dilation == pytest.approx(2.0 * orin.effective_gflops() / 10.0)
    assert sections["n"].uplink_mbps == nano.network.uplink_mbps
    fast_host, _ = emulations({"n": nano}, host=1e4, enabled=True, headroom=1.0)
    assert fast_host["n"].compute_slowdown == pytest.approx(1e4 / nano.effective_gflops())
    off, _ = emulations({"n": nano}, host=10.0, enabled=False)
    assert off["n"].compute_slowdown == 1.0 and off["n"].uplink_mbps is None


def test_agent_config_is_valid_toml_for_the_agent(tmp_path: Path) -> None:
    from jetsplit.edge_agent.config import load_agent_config

    spec = TrialSpec(agents=3, partition="quantity:2")
    path = tmp_path / "a1.toml"
    path.write_text(agent_config(spec, "a1", "mqtt://127.0.0.1:1883", tmp_path / "state",
                                 EmulationSection(profile="orin-nx-16gb", compute_slowdown=2.5,
                                                  uplink_mbps=100.0)))
    cfg = load_agent_config(path)
    assert cfg.agent == "a1" and cfg.data.index == 1 and cfg.data.clients == 3
    assert cfg.data.partition == "quantity:2" and cfg.threads == 1
    assert cfg.emulation is not None and cfg.emulation.compute_slowdown == 2.5
    assert cfg.mqtt.protocol == "3.1.1"  # the embedded broker speaks 3.1.1 only


@pytest.mark.parametrize("args, message", [
    (["--algorithm", "bogus"], "--algorithm: unknown algorithm 'bogus'; choose one of fedavg"),
    (["--codec", "fp8"], "--codec: input should be"),
    (["--agents", "0"], "--agents must be at least 1"),
    (["--profiles", "nope"], "profile nope: no such file"),
    (["--resume", "/nonexistent/run"], "no trial.json there"),
])
def test_bad_trial_options_fail_in_one_line(args: list[str], message: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from jetsplit.cli import main

    assert main(["trial", *args, "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
