"""The example configs shipped beside the systemd units (systemd/agent.toml, server.toml)
stay valid for the agent and the coordinator, and agree with each other."""

from __future__ import annotations

from pathlib import Path


def test_example_configs_stay_valid() -> None:
    from jetsplit.edge_agent.config import load_agent_config
    from jetsplit.server.run.config import load_server_config

    root = Path(__file__).resolve().parents[2] / "systemd"
    agent = load_agent_config(root / "agent.toml")
    server = load_server_config(root / "server.toml")
    assert agent.mqtt.address().tls and agent.mqtt.address().username == "nano-01"
    assert server.fleet == agent.fleet and server.train.deadline_s == 60

