"""Per-device cuts over a real Mosquitto: a shallow and a deep agent process trained by
`jetsplit server run` (SCALA, Ampere) end with the same weights as the same fleet in one
process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import run_in_process, run_weights, server_run

from jetsplit.server.ops.brokers import MosquittoProcess


def test_shallow_and_deep_agents_over_mqtt_match_in_process(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet = agent_fleet(url, "hetero", 2).start()
    config = tmp_path / "server.toml"
    config.write_text(
        f'fleet = "hetero"\nagents = 2\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
        'run = "mqtt"\n[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\n'
        'split = 3\n[model.cuts]\na0 = 1\n[data]\ndataset = "digits"\n[train]\ndeadline_s = 300\n'
        'algorithm = "scala"\nrounds = 2\nlocal_steps = 3\nbatch = 32\nlr = 0.05\n')
    done = server_run(config, url)
    assert "'a0': 1" in done.stdout and "'a1': 3" in done.stdout
    run_in_process(fleet, config, tmp_path / "runs" / "local", cuts={"a0": 1, "a1": 3})

    mqtt_run, local_run = tmp_path / "runs" / "mqtt", tmp_path / "runs" / "local"
    a, b = run_weights(mqtt_run), run_weights(local_run)
    assert set(a) == set(b) and len(a) > 20
    assert [k for k in a if a[k].tobytes() != b[k].tobytes()] == []
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").open()]
            for run in (mqtt_run, local_run)]
    assert [r["cuts"] for r in rows[0]] == [{"a0": 1, "a1": 3}] * 2
    for key in ("train_loss", "accuracy", "cuts"):
        assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]], key
    # the shallow agent's device computes less than the deep one's
    assert rows[0][-1]["device_gflops"]["a0"] < rows[0][-1]["device_gflops"]["a1"]


def test_ampere_shallow_and_deep_agents_over_mqtt_match_in_process(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path) -> None:
    """Ampere with a0 at cut 1 and a1 at cut 2 (`[model.cuts]`): phase 1 with one aux head
    per cut and layer-wise averaging, per-cut trained bundles, a0's upload carried to cut 2,
    a server epoch; the in-process engine on the same agents ends with the same weights."""
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet = agent_fleet(url, "hamp", 2).start()
    config = tmp_path / "server.toml"
    config.write_text(
        f'fleet = "hamp"\nagents = 2\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
        'run = "mqtt"\n[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\n'
        'split = 2\n[model.cuts]\na0 = 1\n[data]\ndataset = "digits"\n[train]\ndeadline_s = 300\n'
        'algorithm = "ampere"\nrounds = 3\nbatch = 48\nlr = 0.1\ndevice_epochs = 1\n'
        f'upload_mb = 0.1\nactivation_dir = "{tmp_path / "a"}"\n')
    done = server_run(config, url)
    assert "'a0': 1" in done.stdout and "'a1': 2" in done.stdout
    run_in_process(fleet, config, tmp_path / "runs" / "local", cuts={"a0": 1, "a1": 2},
                   settings={"activation_dir": str(tmp_path / "b")})

    mqtt_run, local_run = tmp_path / "runs" / "mqtt", tmp_path / "runs" / "local"
    a, b = run_weights(mqtt_run), run_weights(local_run)
    assert set(a) == set(b) and any(k.startswith("aux:aux-k1/") for k in a)
    assert [k for k in a if a[k].tobytes() != b[k].tobytes()] == []
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").open()]
            for run in (mqtt_run, local_run)]
    assert [r["phase"] for r in rows[0]] == [1, 2, 2]
    assert rows[0][1]["bytes_by_kind"]["up"]["generate"] > 0
    for key in ("train_loss", "accuracy", "validation_accuracy"):
        assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]], key
