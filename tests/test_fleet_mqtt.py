"""The MQTT runtime against a real Mosquitto the tests start: agent processes register, take
a 20 MB bundle in 1 MiB chunks, train for 100 steps while one is SIGKILLed and the broker
restarts; and the MQTT engine matches the in-process engine bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from edge_agent.config import load_agent_config
from edge_agent.setup import build_worker
from server.brokers import MosquittoProcess
from server.config import ModelSection, ServerConfig, TrainSection, load_server_config
from server.coordinator import prepare_bundle, run_split_training
from server.engine import InProcessEngine
from server.mqtt_engine import MqttEngine


def _weights(run_dir: Path) -> dict[str, np.ndarray]:
    out = {f"server:{k}": v for k, v in load_file(str(run_dir / "server.safetensors")).items()}
    for path in sorted((run_dir / "clients").glob("*.safetensors")):
        out.update({f"{path.stem}:{k}": v for k, v in load_file(str(path)).items()})
    return out


def test_mqtt_and_in_process_engines_give_bit_identical_weights(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet = agent_fleet(url, "ident", 3).start()
    config = tmp_path / "server.toml"
    config.write_text(
        f'fleet = "ident"\nagents = 3\nwait_s = 120\nout = "{tmp_path / "runs"}"\nrun = "mqtt"\n'
        '[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\nsplit = 2\n'
        "[train]\nsteps = 20\nbatch = 16\ndeadline_s = 60\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # same threads as the in-process run below
    done = subprocess.run([sys.executable, "-m", "jetsplit.cli", "server", "run",
                           "--config", str(config), "--broker", url],
                          capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "20 steps with 3 agents" in done.stdout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workers = {a: build_worker(load_agent_config(p)) for a, p in fleet.configs.items()}
        cfg = load_server_config(config)
        engine = InProcessEngine(workers, run_id="local")
        archive = prepare_bundle(cfg, tmp_path / "local-bundle")
        run_split_training(engine, archive, cfg, tmp_path / "runs" / "local")
    finally:
        torch.set_num_threads(threads)

    mqtt_run, local_run = tmp_path / "runs" / "mqtt", tmp_path / "runs" / "local"
    a, b = _weights(mqtt_run), _weights(local_run)
    assert set(a) == set(b) and len(a) > 50
    assert sum(1 for k in a if k.startswith("a2:")) > 5
    differing = [k for k in a if a[k].tobytes() != b[k].tobytes()]
    assert differing == []
    losses = [[json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()]
              for run in (mqtt_run, local_run)]
    assert losses[0] == losses[1] and len(losses[0]) == 20
    mqtt_summary = json.loads((mqtt_run / "summary.json").read_text())
    local_summary = json.loads((local_run / "summary.json").read_text())
    assert mqtt_summary["bundle_sha256"] == local_summary["bundle_sha256"]
    assert mqtt_summary["missed"] == []


def test_fleet_survives_sigkill_and_broker_restart(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet = agent_fleet(url, "faults", 8).start()
    engine = MqttEngine(mosquitto.address, "faults", run_id="faults", retry_s=5).start()
    try:
        assert engine.wait_for_agents(8, 180) == [f"a{i}" for i in range(8)]
        cfg = ServerConfig(
            fleet="faults", agents=8,
            model=ModelSection(name="mobilenetv3-large", input_shape=[1, 8, 8], classes=1000,
                               split=2),
            train=TrainSection(steps=100, batch=8, deadline_s=15, bundle_deadline_s=180))
        archive = prepare_bundle(cfg, tmp_path / "bundle")
        size = archive.stat().st_size
        assert size > 20_000_000  # 20 chunks of 1 MiB and a bit

        events: dict[str, int] = {}

        def chaos(row: dict[str, Any]) -> None:
            if row["step"] == 29:
                fleet.processes["a7"].send_signal(signal.SIGKILL)
                events["killed"] = 29
            if row["step"] == 59:
                mosquitto.restart()
                events["restarted"] = 59

        summary = run_split_training(engine, archive, cfg, tmp_path / "run", on_step=chaos)
    finally:
        engine.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert events == {"killed": 29, "restarted": 59}
    assert summary["steps"] == 100 and len(rows) == 100

    # Every agent received the whole bundle, chunked.
    for i in range(8):
        assert summary["bytes"][f"a{i}"]["down"]["bundle"] >= size
    # Before the kill all eight trained; the killed one is marked offline by its last will
    # and the step that expected it completes without it.
    assert all(len(r["agents"]) == 8 for r in rows[:30])
    after_kill = rows[30]
    assert "a7" not in after_kill["agents"] and len(after_kill["agents"]) == 7
    record = {a["agent"]: a for a in summary["agents"]}["a7"]
    assert record["state"] == "offline" and record["offline_events"] >= 1
    assert all("a7" not in r["agents"] for r in rows[30:])
    # The broker restart: both sides reconnect and the run goes on to the end with the
    # seven survivors.
    assert engine.endpoint.connects >= 2
    assert all(len(r["agents"]) == 7 and r["loss"] is not None for r in rows[-20:])
    assert all(np.isfinite(r["loss"]) for r in rows)
    for agent in (f"a{i}" for i in range(7)):
        assert "connected to" in fleet.log(agent)
        assert fleet.log(agent).count("connected to") >= 2, agent


@pytest.mark.parametrize("bad", [b"", b"JSPL", b"not a message at all", bytes(range(256)) * 9])
def test_agents_shrug_off_garbage(mosquitto: MosquittoProcess, agent_fleet: Any,
                                   tmp_path: Path, bad: bytes) -> None:
    import paho.mqtt.client as mqtt

    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet = agent_fleet(url, "junk", 1).start()
    engine = MqttEngine(mosquitto.address, "junk", run_id="junk").start()
    try:
        assert engine.wait_for_agents(1, 120) == ["a0"]
        vandal = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="vandal")
        vandal.connect("127.0.0.1", mosquitto.port)
        vandal.loop_start()
        for topic in ("jetsplit/v1/junk/down/a0", "jetsplit/v1/junk/down/all",
                      "jetsplit/v1/junk/up/a0", "jetsplit/v1/junk/presence/a0"):
            vandal.publish(topic, bad, qos=1).wait_for_publish(5)
        vandal.loop_stop()
        vandal.disconnect()
        from server.engine import Command

        out = engine.send_and_receive({"a0": Command("status")}, deadline_s=30)
        assert out.agents == ["a0"], out.missed
        assert sum(engine.endpoint.rejected.values()) >= 2  # up/ and presence/ junk
    finally:
        engine.close()
    assert fleet.processes["a0"].poll() is None
    assert "rejected message" in fleet.log("a0")
