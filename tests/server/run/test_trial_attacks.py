"""`jetsplit trial --attack AGENT=SPEC` makes that agent process misbehave (its agent.toml
gets an [attack] section), for tests and benchmarks only: refused in one line, before any
broker or agent starts, unless JETSPLIT_ALLOW_ATTACKS=1."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.edge_agent.attacks import ALLOW_ENV
from jetsplit.edge_agent.config import load_agent_config
from jetsplit.edge_agent.emulation import EmulationSection
from jetsplit.errors import ConfigError
from jetsplit.server.run.trial_fleet import TrialSpec, agent_config


def test_the_attacker_config_carries_its_attack(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    spec = TrialSpec(agents=4, attacks={"a3": "scale:1000"})
    emulation = EmulationSection(profile="jetson-nano-4gb")
    honest, attacker = tmp_path / "a0.toml", tmp_path / "a3.toml"
    honest.write_text(agent_config(spec, "a0", "mqtt://127.0.0.1:1883", tmp_path, emulation))
    attacker.write_text(agent_config(spec, "a3", "mqtt://127.0.0.1:1883", tmp_path, emulation))
    assert "[attack]" not in honest.read_text()
    monkeypatch.setenv(ALLOW_ENV, "1")
    cfg = load_agent_config(attacker)
    assert cfg.attack is not None and cfg.attack.kind == "scale:1000"
    monkeypatch.delenv(ALLOW_ENV)
    with pytest.raises(ConfigError, match="attacks are for tests and benchmarks only"):
        load_agent_config(attacker)
    assert load_agent_config(honest).attack is None


@pytest.mark.parametrize(("argv", "needle"), [
    (["--attack", "a3=scale:1000"], "attacks are for tests and benchmarks only"),
    (["--attack", "a9=scale:1000"], "no trial agent 'a9'"),
    (["--attack", "a1=scale:1000", "--agents-per-process", "2"], "one agent per process"),
])
def test_trial_attack_is_checked_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str], needle: str) -> None:
    if "a3" in argv[1]:
        monkeypatch.delenv(ALLOW_ENV, raising=False)
    else:
        monkeypatch.setenv(ALLOW_ENV, "1")
    code = main(["trial", "--agents", "4", "--out", str(tmp_path / "t"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert needle in err
    assert not (tmp_path / "t" / "agents").exists()  # no agent was configured or started


def test_provisioned_sizes_are_each_trial_agents_own_shard(tmp_path: Path) -> None:
    """`--provision-sizes`: the sizes the coordinator is given are exactly the shards the
    agents cut from the `[data]` their configs carry (unequal under dirichlet), and they
    reach the server.toml a trial writes for reuse."""
    from jetsplit.data import load_dataset_split
    from jetsplit.edge_agent.worker_factory import local_dataset
    from jetsplit.server.run.config import (
        ModelSection,
        ServerConfig,
        TrainSection,
        load_server_config,
    )
    from jetsplit.server.run.trial import _server_toml
    from jetsplit.server.run.trial_fleet import trial_shard_sizes

    spec = TrialSpec(agents=4, dataset="digits", partition="dirichlet:0.5", seed=3,
                     provision_sizes=True)
    emulation = EmulationSection(profile="jetson-nano-4gb")
    own = {}
    for agent in ("a0", "a1", "a2", "a3"):
        path = tmp_path / f"{agent}.toml"
        path.write_text(agent_config(spec, agent, "mqtt://127.0.0.1:1883", tmp_path, emulation))
        own[agent] = len(local_dataset(load_agent_config(path)))
    train, _ = load_dataset_split(spec.dataset, spec.test_fraction, spec.seed)
    assert trial_shard_sizes(spec, train) == own and len(set(own.values())) == 4
    cfg = ServerConfig(fleet="trial", model=ModelSection(),
                       train=TrainSection(provisioned_sizes=own))
    (tmp_path / "server.toml").write_text(_server_toml(cfg, "mqtt://127.0.0.1:1883"))
    assert load_server_config(tmp_path / "server.toml").train.provisioned_sizes == own


def test_a_signed_trial_gives_every_agent_its_fleet_key(tmp_path: Path) -> None:
    """`TrialSpec.signed` (bench_faults.py: a clock jump only bites where messages are
    signed): one key per trial, in every agent's [mqtt], the same after a resume."""
    from jetsplit.server.run.trial_fleet import trial_fleet_key, write_agent_configs

    emulation = {"orin-nx-16gb": EmulationSection(profile="orin-nx-16gb")}
    spec = TrialSpec(agents=2, profiles=["orin-nx-16gb"], signed=True)
    agents = tmp_path / "agents"
    configs, _ = write_agent_configs(spec, "mqtt://127.0.0.1:1883", agents, emulation, {})
    key = trial_fleet_key(spec, agents)
    assert key is not None and len(key) == 64
    assert [load_agent_config(p).mqtt.endpoint_options().fleet_key for p in configs] == [key] * 2
    write_agent_configs(spec, "mqtt://127.0.0.1:1883", agents, emulation, {})  # a resume
    assert trial_fleet_key(spec, agents) == key
    unsigned = TrialSpec(agents=2, profiles=["orin-nx-16gb"])
    configs, _ = write_agent_configs(unsigned, "mqtt://127.0.0.1:1883", tmp_path / "u",
                                     emulation, {})
    assert trial_fleet_key(unsigned, tmp_path / "u") is None
    assert all(load_agent_config(p).mqtt.endpoint_options().fleet_key is None for p in configs)


@pytest.mark.parametrize("after", [-1, 2, 3])
def test_a_coordinator_restart_needs_rounds_on_both_sides(tmp_path: Path, after: int) -> None:
    """`run_trial(restart_after=R)` (bench_faults.py's restart arm) refuses, before any broker
    or agent starts, a round the resumed coordinator would have nothing after (3 rounds:
    0 and 1 only)."""
    from jetsplit.server.run.trial import run_trial

    spec = TrialSpec(agents=2, train={"rounds": 3})
    with pytest.raises(ConfigError, match=r"restart_after .* must lie in 0\.\.1 "):
        run_trial(spec, tmp_path / "run", restart_after=after)
    assert not (tmp_path / "run").exists()
