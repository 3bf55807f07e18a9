"""Fleet scale on a real Mosquitto: one `jetsplit agent host` process registers 100 agents
and trains 2 rounds with 10 selected; a presence storm (50 hosted agents drop and come back
during a round) loses no round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.config import load_agent_config
from jetsplit.edge_agent.host import FleetHost, hosted_indices
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.server.run.assembly import RunSpec, execute, prepare_bundle
from jetsplit.server.run.config import load_server_config


def _agent_toml(root: Path, url: str, fleet: str, clients: int) -> Path:
    path = root / "agent.toml"
    path.write_text(f'fleet = "{fleet}"\nagent = "a"\nstate_dir = "{root / "state"}"\n'
                    'threads = 1\nlog_level = "warning"\n'
                    f'[mqtt]\nbroker = "{url}"\n'
                    f'[data]\ndataset = "digits"\npartition = "iid"\nclients = {clients}\n')
    return path


def _server_toml(root: Path, fleet: str, agents: int, rounds: int, fraction: float) -> Path:
    path = root / "server.toml"
    path.write_text(
        f'fleet = "{fleet}"\nagents = {agents}\nout = "{root / "runs"}"\nrun = "scale"\n'
        '[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\nsplit = 2\n'
        '[data]\ndataset = "digits"\n'
        f'[train]\nalgorithm = "splitfed-v2"\nrounds = {rounds}\nlocal_steps = 1\n'
        f"batch = 40\nlr = 0.05\nfraction = {fraction}\ndeadline_s = 300\n")
    return path


@pytest.fixture()
def engine(mosquitto: MosquittoProcess) -> Iterator[MqttEngine]:
    eng = MqttEngine(mosquitto.address, "scale", run_id="scale").start(10.0)
    try:
        yield eng
    finally:
        eng.close()


def _train(engine: MqttEngine, root: Path, agents: int, rounds: int, fraction: float,
           on_round: Callable[[dict[str, Any]], None] | None = None
           ) -> list[dict[str, object]]:
    cfg = load_server_config(_server_toml(root, "scale", agents, rounds, fraction))
    _, test = load_dataset_split("digits", 0.2, 0)
    archive = prepare_bundle(cfg, root / "bundle")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the coordinator shares 2 cores with the hosted fleet
    try:
        execute(engine, RunSpec(cfg.settings(), archive, test, root / "runs" / "scale",
                                on_round=[on_round]))
    finally:
        torch.set_num_threads(threads)
    return [json.loads(line) for line in (root / "runs" / "scale" / "metrics.jsonl").open()]


def test_one_fleet_host_registers_100_agents_and_trains_2_rounds_with_10_selected(
        mosquitto: MosquittoProcess, engine: MqttEngine, tmp_path: Path) -> None:
    config = _agent_toml(tmp_path, f"mqtt://127.0.0.1:{mosquitto.port}", "scale", 100)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "host.log").open("wb")
    host = subprocess.Popen([sys.executable, "-m", "jetsplit.cli", "agent", "host",
                             "--config", str(config), "--count", "100"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        online = engine.wait_for_agents(100, 60)
        assert online == sorted(f"a{i}" for i in range(100)), \
            (tmp_path / "host.log").read_text()[-2000:]
        sizes = {int(engine.registry.registration(a)["dataset"]["size"]) for a in online}
        assert sizes <= {14, 15}  # each its own iid shard of digits' 1437 training images
        rows = _train(engine, tmp_path, 100, 2, 0.1)
    finally:
        host.terminate()
        host.wait(timeout=30)
    assert [r["round"] for r in rows] == [0, 1]
    for row in rows:
        assert len(row["selected"]) == 10 and not row["missed"]
        assert set(row["device_gflops"]) == set(row["selected"])
    assert rows[0]["selected"] != rows[1]["selected"]
    # Every hosted agent published its last `offline` on the way out.
    deadline = time.monotonic() + 60
    while engine.registry.online_count() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.registry.online_count() == 0


def test_presence_storm_during_a_round_loses_no_round(
        mosquitto: MosquittoProcess, engine: MqttEngine, tmp_path: Path) -> None:
    """Round 1's first command goes out just as 50 of 60 hosted agents lose their
    connection at once (the broker fires their last wills) and reconnect: every round
    completes, only dropped agents can miss a step (as `offline`), and all 60 are back for
    round 2, which runs with its full selection and no miss."""
    config = load_agent_config(_agent_toml(tmp_path, f"mqtt://127.0.0.1:{mosquitto.port}",
                                           "scale", 60))
    host = FleetHost(config, hosted_indices(60)).build()
    stop = threading.Event()
    host.start(stop)
    dropped = {d.agent for d in host.daemons[:50]}
    send = engine.send_and_receive
    storms: list[int] = []

    def storm_then_send(commands, **kwargs):  # noqa: ANN001, ANN202 - wraps the engine call
        if kwargs.get("round") == 1 and not storms:
            storms.append(len(commands))
            for daemon in host.daemons[:50]:  # drop the sockets under paho's feet
                client = daemon.endpoint._client
                sock = None if client is None else client.socket()
                if sock is not None:
                    sock.shutdown(2)
        return send(commands, **kwargs)

    def back_online(row: dict[str, object]) -> None:
        if row["round"] == 1:
            assert len(engine.wait_for_agents(60, 120)) == 60

    engine.send_and_receive = storm_then_send  # type: ignore[method-assign]
    try:
        assert len(engine.wait_for_agents(60, 60)) == 60
        rows = _train(engine, tmp_path, 60, 3, 0.2, on_round=back_online)
        offline = {r["agent"]: r["offline_events"] for r in engine.registry.snapshot()}
    finally:
        stop.set()
        host.join()
    assert len(storms) == 1  # the storm hit round 1's first exchange
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(len(r["selected"]) == 12 for r in rows)
    assert not rows[0]["missed"] and not rows[2]["missed"]
    assert set(rows[1]["missed"]) <= dropped & set(rows[1]["selected"])
    assert set(rows[1]["missed"].values()) <= {"offline"}
    assert {a for a, n in offline.items() if n} == dropped  # the wills came, from them only


def test_trial_hosts_clients_by_profile_in_processes_of_at_most_n(tmp_path: Path) -> None:
    """`--agents-per-process`: each host runs one profile's clients (a profile's agents are
    len(profiles) apart), at most N; every client is hosted exactly once, and a host's base
    config gives agent n the id, shard and seed its own process would have had."""
    from jetsplit.edge_agent.emulation import EmulationSection
    from jetsplit.edge_agent.host import hosted_config
    from jetsplit.server.run.trial_fleet import TrialSpec, agent_config

    spec = TrialSpec(agents=11, agents_per_process=3, profiles=["p", "q"], seed=7)
    groups = spec.host_groups()
    hosted = [(profile, first + k * stride) for profile, first, stride, count in groups
              for k in range(count)]
    assert sorted(n for _, n in hosted) == list(range(11))
    assert all(profile == spec.profiles[n % 2] for profile, n in hosted)
    assert max(count for *_, count in groups) == 3 and len(groups) == 4
    base_path = tmp_path / "host.toml"
    base_path.write_text(agent_config(spec, "a", "mqtt://127.0.0.1:1883", tmp_path,
                                      EmulationSection(profile="q"), index=0))
    own_path = tmp_path / "a5.toml"
    own_path.write_text(agent_config(spec, "a5", "mqtt://127.0.0.1:1883", tmp_path,
                                     EmulationSection(profile="q")))
    assert hosted_config(load_agent_config(base_path), 5) == load_agent_config(own_path)


def test_fleet_host_options_fail_in_one_line(tmp_path: Path) -> None:
    from jetsplit.edge_agent.host import hosted_config
    from jetsplit.errors import ConfigError

    config = _agent_toml(tmp_path, "mqtt://127.0.0.1:1", "scale", 10)
    with pytest.raises(ConfigError, match="--stride >= 1"):
        hosted_indices(2, 0, 0)
    with pytest.raises(ConfigError, match="shard 10 but data.clients is 10"):
        hosted_config(load_agent_config(config), 10)
    done = subprocess.run([sys.executable, "-m", "jetsplit.cli", "agent", "host",
                           "--config", str(config), "--count", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--count must be 1..10000" in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
