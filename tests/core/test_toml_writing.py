"""Configs a trial writes are TOML written by tomli-w: any string survives the round trip."""

from __future__ import annotations

from pathlib import Path

from jetsplit.config_io import tomllib
from jetsplit.edge_agent.config import AgentConfig
from jetsplit.edge_agent.emulation import EmulationSection
from jetsplit.server.run.trial_fleet import TrialSpec, agent_config

AWKWARD = 'npz:/data/🚀 "quoted" C:\\temp\\x\u0007.npz'


def test_awkward_value_round_trips(tmp_path: Path) -> None:
    spec = TrialSpec(agents=2, dataset=AWKWARD)
    text = agent_config(spec, "a1", "mqtt://127.0.0.1:1883", tmp_path / "st\\ate \"😀\"",
                        EmulationSection(profile="x86-cpu", compute_slowdown=2.5))
    doc = tomllib.loads(text)
    assert doc["data"]["dataset"] == AWKWARD
    assert doc["state_dir"] == str(tmp_path / "st\\ate \"😀\"")
    assert doc["emulation"]["compute_slowdown"] == 2.5
    config = AgentConfig.model_validate(doc)  # and the agent accepts what the trial wrote
    assert config.agent == "a1" and config.data.index == 1
