"""One enrolled device that lies, over MQTT with per-device identity: four provisioned agent
processes on the provisioned mTLS Mosquitto, `jetsplit server run` (SCALA), and a3 sending
its activations × 10^6 through the attack harness in its own worker. With the default
defences the run ends within 2 points of the clean run and the report names a3; the same
fleet in one process gives the same bits (the harness and the defences behave the same
behind either engine), and with the defences off the same attack wrecks the run. a2
registers 10^9 samples against the sizes provisioned in server.toml
(`[train.provisioned_sizes]`): it weighs as its true size in every average, as an honest
a2 would, and the report names the bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import AgentFleet, kit_lines, run_in_process, run_weights, server_run

from jetsplit.edge_agent.attacks import ALLOW_ENV
from jetsplit.edge_agent.config import load_agent_config
from jetsplit.edge_agent.worker_factory import local_dataset
from jetsplit.server.fleet.provision import provision
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.server.report.document import write_report

ATTACK = "activation-scale:1000000"


def _final_accuracy(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return float(rows[-1]["accuracy"])


def test_one_lying_agent_process_costs_under_two_points_and_is_named(
        agent_fleet: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")  # the in-process replays load a3's [attack] too
    kits, runs = tmp_path / "kits", tmp_path / "runs"
    provision("live", ["a0", "a1", "a2", "a3"], kits)
    with MosquittoProcess(provisioned=kits / "broker") as broker:
        url = f"mqtts://localhost:{broker.port}"
        fleet = agent_fleet(url, "live", 4, kits=kits,
                            attacks={"a3": ATTACK, "a2": "size-lie:1000000000"}).start()
        truth = {a: len(local_dataset(load_agent_config(path)))
                 for a, path in fleet.configs.items()}
        config = tmp_path / "server.toml"
        config.write_text(
            f'fleet = "live"\nagents = 4\nwait_s = 120\nout = "{runs}"\nrun = "mqtt"\n'
            '[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\nsplit = 2\n'
            '[data]\ndataset = "digits"\n[train]\ndeadline_s = 300\nalgorithm = "scala"\n'
            "rounds = 6\nlocal_steps = 20\nbatch = 48\nlr = 0.05\n"
            f'[mqtt]\nbroker = "{url}"\n' + kit_lines(kits / "coordinator")
            + "[train.provisioned_sizes]\n" + "".join(f"{a} = {n}\n" for a, n in truth.items()))
        server_run(config, url)
    attacked = runs / "mqtt"
    run_in_process(fleet, config, runs / "local")
    a, b = run_weights(attacked), run_weights(runs / "local")
    assert set(a) == set(b) and len(a) > 50
    assert [k for k in a if a[k].tobytes() != b[k].tobytes()] == []

    (tmp_path / "honest").mkdir()
    honest = AgentFleet(tmp_path / "honest", url, "live", 4)
    run_in_process(honest, config, runs / "clean")
    run_in_process(fleet, config, runs / "undefended",
                   settings={"activation_bound": 0.0, "loss_bound": 0.0})
    clean, defended = _final_accuracy(runs / "clean"), _final_accuracy(attacked)
    undefended = _final_accuracy(runs / "undefended")
    print(f"final accuracy: clean {clean:.4f}, a3 {ATTACK} with the defaults {defended:.4f}, "
          f"without them {undefended:.4f}")
    assert defended >= clean - 0.02
    assert undefended < clean - 0.2  # the attack bites: the defence is what holds the run

    report = write_report(attacked).read_text()
    limited = next(line for line in report.splitlines()
                   if line.startswith("Devices the coordinator limited:"))
    assert limited.startswith("Devices the coordinator limited: a3 (6 of 6 rounds)"), limited
    section = report.split("## Defences", 1)[1]
    assert "activations bounded" in section and "| a3 |" in section
    assert (f"- a2: claimed 1000000000 samples, weighed as {truth['a2']} (provisioned size)."
            in section)
