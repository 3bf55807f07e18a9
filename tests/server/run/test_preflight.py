"""Fail fast: options are checked before expensive work, errors name the flag, and a trial
agent that dies during start-up ends the wait at once with its log's error line."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.edge_agent.emulation import EmulationSection
from jetsplit.errors import ConfigError
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.run.config import TrainSection
from jetsplit.server.run.preflight import first_error_line, validate_options, wait_for_fleet
from jetsplit.server.run.trial_fleet import AgentProcesses, TrialSpec, agent_config
from jetsplit.transport.mqtt import EndpointOptions


def test_errors_name_the_flag_and_reject_nan() -> None:
    with pytest.raises(ConfigError, match=r"^--local-steps: input should be greater"):
        validate_options(TrainSection, {"local_steps": 0}, {})
    with pytest.raises(ConfigError, match=r"^--lr: input should be a finite number"):
        validate_options(TrainSection, {"lr": float("nan")}, {})
    assert validate_options(TrainSection, {"lr": 0.5}, {}).lr == 0.5


@pytest.mark.parametrize("argv, needle", [
    (["trial", "--split", "42", "--dataset", "digits"], "--split: 42 is out of range"),
    (["trial", "--metrics-port", "99999"], "--metrics-port: 99999 is not a TCP port"),
    (["trial", "--partition", "dirichlet:-1"], "--partition: unknown partition scheme"),
    (["trial", "--lr", "nan"], "--lr: input should be a finite number"),
])
def test_trial_rejects_options_before_starting(argv: list[str], needle: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert not (out / "agents").exists()  # nothing was started


def test_first_error_line(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_text("2026 jetsplit.agent INFO starting\nerror: agent config a0.toml: bad\n")
    assert first_error_line(log) == "error: agent config a0.toml: bad"
    log.write_text("Traceback (most recent call last):\n  File x\nValueError: boom\n")
    assert first_error_line(log) == "ValueError: boom"
    log.write_text("all good\n")
    assert first_error_line(log) is None


def test_dead_agent_ends_the_wait_with_its_error(mosquitto, tmp_path: Path) -> None:
    """A trial agent whose config the agent rejects (a negative Dirichlet β) exits; the
    coordinator stops waiting at once and names the agent and its error line."""
    spec = TrialSpec(agents=2, dataset="digits", partition="dirichlet:-1")
    config = tmp_path / "a0.toml"
    config.write_text(agent_config(spec, "a0", mosquitto.address.url(), tmp_path / "state",
                                   EmulationSection(profile="x86-cpu")))
    agents = AgentProcesses([config]).start()
    engine = MqttEngine(mosquitto.address, "trial", run_id="t",
                        options=EndpointOptions()).start(10.0)
    try:
        with pytest.raises(ConfigError) as caught:
            wait_for_fleet(engine.wait_for_agents, 1, 300.0, agents.dead,
                           lambda name: tmp_path / f"{name}.log")
    finally:
        engine.close()
        agents.stop()
    message = str(caught.value)
    # No timing bound: had it waited out the 300 s it would return, not raise.
    assert message.startswith("agent a0 exited during start-up: error:")
    assert "unknown partition scheme 'dirichlet:-1'" in message and "a0.log" in message
