"""`jetsplit trial --trace AGENT=TRACE`: that agent's agent.toml carries the trace's rows in
its [emulation], which the agent's config loader accepts; a bad agent, a fleet host, a
missing or malformed trace are one line, before any broker or agent starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.edge_agent.config import load_agent_config
from jetsplit.edge_agent.emulation import DeviceClock, EmulationSection
from jetsplit.server.run.trial_fleet import TrialSpec, agent_config, trial_traces

pytestmark = pytest.mark.fast


def test_the_traced_agent_config_carries_its_trace(tmp_path: Path) -> None:
    spec = TrialSpec(agents=2, traces={"a1": "power-mode-drop"})
    traces = trial_traces(spec)
    assert list(traces) == ["a1"]
    base = EmulationSection(profile="orin-nx-16gb", compute_slowdown=3.0, uplink_mbps=50.0)
    path = tmp_path / "a1.toml"
    path.write_text(agent_config(spec, "a1", "mqtt://127.0.0.1:1883", tmp_path,
                                 base.model_copy(update={"trace": traces["a1"]})))
    emulation = load_agent_config(path).emulation
    assert emulation is not None and emulation.trace == traces["a1"]
    clock = DeviceClock(emulation)
    clock.enter_round(4)
    assert clock.slowdown == 3.0
    clock.enter_round(5)  # the power mode drops to 10 W: half the speed
    assert clock.slowdown == 6.0 and clock.snapshot()["power_mode"] == "10W"


@pytest.mark.parametrize(("argv", "needle"), [
    (["--trace", "a9=power-mode-drop"], "--trace a9=power-mode-drop: no trial agent 'a9'"),
    (["--trace", "a1=power-mode-drop", "--agents-per-process", "2"], "one agent per process"),
    (["--trace", "a1=nope"], "trace nope: no such file or bundled trace"),
    (["--trace", "a1"], "--trace 'a1': write AGENT=TRACE (e.g. a0=link-drop-recover)"),
    (["--trace", "a1=BAD"], "row 2: compute: input should be greater than 0"),
])
def test_trial_trace_is_checked_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        needle: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[at]]\nround = 0\n[[at]]\nround = 2\ncompute = 0.0\n")
    argv = [a.replace("BAD", str(bad)) for a in argv]
    code = main(["trial", "--agents", "4", "--out", str(tmp_path / "t"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert needle in err
    assert not (tmp_path / "t" / "agents").exists()  # no agent was configured or started
