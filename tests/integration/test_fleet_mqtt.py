"""The MQTT runtime against a real Mosquitto the tests start: agent processes register, take
a 20 MB bundle in 1 MiB chunks, train for 100 steps while one is SIGKILLed and the broker
restarts; and the MQTT engine matches the in-process engine bit for bit."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_process, run_weights, server_run

from jetsplit.data import load_dataset_split
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.server.run.assembly import RunSpec, execute, prepare_bundle
from jetsplit.server.run.config import ModelSection, ServerConfig
from jetsplit.server.training.settings import Settings


@pytest.mark.parametrize(("algorithm", "agents", "rounds", "steps"),
                         [("psl", 3, 1, 20), ("scala", 5, 3, 7)])
def test_mqtt_and_in_process_engines_give_bit_identical_runs(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path, algorithm: str,
        agents: int, rounds: int, steps: int) -> None:
    """Same seed and config, fp32: the fleet over MQTT (agent processes, `jetsplit server
    run`) and in one process end with the same weights, bit for bit, and the same per-round
    accuracy, although this process runs torch with a different thread count (3) than the
    agent processes (1, their config) and the coordinator process (its default): each
    engine runs agent compute under the agents' threads and server compute under
    `[server] threads`."""
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet = agent_fleet(url, "ident", agents).start()
    config = tmp_path / "server.toml"
    config.write_text(
        f'fleet = "ident"\nagents = {agents}\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
        'run = "mqtt"\n[server]\nthreads = 1\n'
        '[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\n'
        'split = 2\n[data]\ndataset = "digits"\n[train]\ndeadline_s = 300\n'
        f'algorithm = "{algorithm}"\n'
        f"rounds = {rounds}\nlocal_steps = {steps}\nbatch = 48\nlr = 0.05\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",
                                                             "MKL_NUM_THREADS")}
    done = server_run(config, url, env=env)
    assert f"{rounds} rounds with {agents} agents" in done.stdout
    run_in_process(fleet, config, tmp_path / "runs" / "local", threads=3)  # agents run 1

    mqtt_run, local_run = tmp_path / "runs" / "mqtt", tmp_path / "runs" / "local"
    a, b = run_weights(mqtt_run), run_weights(local_run)
    assert set(a) == set(b) and len(a) > 50
    differing = [k for k in a if a[k].tobytes() != b[k].tobytes()]
    assert differing == []
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").open()]
            for run in (mqtt_run, local_run)]
    assert len(rows[0]) == rounds
    for key in ("train_loss", "accuracy", "balanced_accuracy", "per_class_accuracy"):
        assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]], key
    assert [r["bytes_by_kind"] for r in rows[0]] != []
    mqtt_summary = json.loads((mqtt_run / "summary.json").read_text())
    assert mqtt_summary["missed"] == []
    assert rows[0][-1]["train_loss"] < rows[0][0]["train_loss"] or rounds == 1


FAULTS_AGENTS = 4  # agent processes; the last is SIGKILLed
KILLED = f"a{FAULTS_AGENTS - 1}"


@pytest.mark.timeout(1800)  # a ceiling for a busy machine, not a measure
def test_fleet_survives_sigkill_and_broker_restart(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path) -> None:
    """An agent SIGKILLed after round 3 and the broker restarted after round 6 of 10: the
    run completes, the killed agent is dropped by its last will, the rest reconnect and
    keep training. Asserted on behaviour, not speed: on a busy machine a slow step may
    miss its deadline (a `deadline` miss, which the design allows), but every agent
    answers steps before the kill and every survivor after the restart."""
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet = agent_fleet(url, "faults", FAULTS_AGENTS).start()
    engine = MqttEngine(mosquitto.address, "faults", run_id="faults", retry_s=5).start()
    try:
        everyone = [f"a{i}" for i in range(FAULTS_AGENTS)]
        survivors = everyone[:-1]
        assert engine.wait_for_agents(FAULTS_AGENTS, 300) == everyone
        cfg = ServerConfig(
            fleet="faults", agents=FAULTS_AGENTS,
            model=ModelSection(name="mobilenetv3-large", input_shape=[1, 8, 8], classes=1000,
                               split=2))
        archive = prepare_bundle(cfg, tmp_path / "bundle")
        size = archive.stat().st_size
        assert size > 20_000_000  # 20 chunks of 1 MiB and a bit
        steps = 5
        settings = Settings(algorithm="psl", rounds=10, local_steps=steps, batch=32,
                            deadline_s=60, bundle_deadline_s=300)
        _, test = load_dataset_split("digits", 0.2, 0)
        events: dict[str, int] = {}

        def chaos(row: dict[str, Any]) -> None:
            if row["round"] == 2:  # after 3 rounds
                fleet.processes[KILLED].send_signal(signal.SIGKILL)
                events["killed"] = 3 * steps
            if row["round"] == 5:  # after 6 rounds
                mosquitto.restart()
                events["restarted"] = 6 * steps

        summary = execute(engine, RunSpec(settings, archive, test, tmp_path / "run",
                                          on_round=[chaos]))
    finally:
        engine.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert events == {"killed": 15, "restarted": 30}
    assert summary["rounds"] == 10 and len(rows) == 10

    # Every agent received its client block (offer + parts), never the 20 MB server block.
    client = sum((tmp_path / "bundle" / "bundle" / name).stat().st_size
                 for name in ("client.safetensors", "client.onnx"))
    for agent in everyone:
        down = summary["bytes"][agent]["down"]
        assert client <= down["bundle"] + down["bundle_part"] < size / 10
    # Before the kill all eight are selected and none is offline or in error; each answered
    # steps (a `deadline` miss is a slow step on a busy machine, not a fault).
    assert all(r["selected"] == everyone for r in rows[:3])
    assert all(set(r["missed"].values()) <= {"deadline"} for r in rows[:3])
    answered(summary, range(0, 3), everyone, steps)
    # The killed one is marked offline by its last will, its step completes without it,
    # and it is not selected again.
    record = {a["agent"]: a for a in summary["agents"]}[KILLED]
    assert record["state"] == "offline" and record["offline_events"] >= 1
    missed = [m for m in summary["missed"] if m["agent"] == KILLED]
    # Dropped by its last will, never by waiting out the (300 s) deadline; selected once
    # more only if the will lands after the next round's selection (a race either way).
    assert {m["reason"] for m in missed} <= {"offline"}
    assert missed or KILLED not in rows[3]["selected"]
    assert all(KILLED not in r["selected"] for r in rows[4:])
    # The broker restart: both sides reconnect and the run goes on to the end with the
    # survivors, evaluated every round.
    assert engine.endpoint.connects >= 2
    assert all(r["selected"] == survivors and set(r["missed"].values()) <= {"deadline"}
               for r in rows[-3:])
    answered(summary, range(7, 10), survivors, steps)
    assert all(r["accuracy"] is not None and r["train_loss"] is not None for r in rows)
    for agent in survivors:
        assert fleet.log(agent).count("connected to") >= 2, agent


def answered(summary: dict[str, Any], rounds: range, agents: list[str], steps: int) -> None:
    """Every agent answered at least one step in these rounds (its missed steps there are
    fewer than the rounds' steps)."""
    for agent in agents:
        missed = [m for m in summary["missed"] if m["agent"] == agent and m["round"] in rounds
                  and m["kind"] == "forward"]
        assert len(missed) < len(rounds) * steps, (agent, missed)


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
        from jetsplit.server.engines.seam import Command

        out = engine.send_and_receive({"a0": Command("status")}, deadline_s=120)
        assert out.agents == ["a0"], out.missed
        assert sum(engine.endpoint.rejected.values()) >= 2  # up/ and presence/ junk
    finally:
        engine.close()
    assert fleet.processes["a0"].poll() is None
    assert "rejected message" in fleet.log("a0")
