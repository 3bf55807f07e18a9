"""Per-device cuts over a real Mosquitto: a shallow and a deep agent process trained by
`jetsplit server run` (SCALA, Ampere) end with the same weights as the same fleet in one
process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.config import load_agent_config
from jetsplit.edge_agent.setup import build_worker
from jetsplit.server.brokers import MosquittoProcess
from jetsplit.server.config import load_server_config
from jetsplit.server.coordinator import prepare_bundle
from jetsplit.server.engine import InProcessEngine
from jetsplit.server.training import run_training


def _weights(run_dir: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for path in sorted(run_dir.glob("*.safetensors")) + sorted(run_dir.glob("clients/*")):
        out.update({f"{path.stem}:{k}": v for k, v in load_file(str(path)).items()})
    return out


def test_shallow_and_deep_agents_over_mqtt_match_in_process(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet = agent_fleet(url, "hetero", 2).start()
    config = tmp_path / "server.toml"
    config.write_text(
        f'fleet = "hetero"\nagents = 2\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
        'run = "mqtt"\n[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\n'
        'split = 3\n[model.cuts]\na0 = 1\n[data]\ndataset = "digits"\n[train]\n'
        'algorithm = "scala"\nrounds = 2\nlocal_steps = 3\nbatch = 32\nlr = 0.05\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "jetsplit.cli", "server", "run",
                           "--config", str(config), "--broker", url],
                          capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'a0': 1" in done.stdout and "'a1': 3" in done.stdout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workers = {a: build_worker(load_agent_config(p)) for a, p in fleet.configs.items()}
        cfg = load_server_config(config)
        _, test = load_dataset_split("digits", 0.2, 0)
        engine = InProcessEngine(workers, run_id="local")
        archive = prepare_bundle(cfg, tmp_path / "local")
        run_training(engine, archive, cfg.settings(), test, tmp_path / "runs" / "local",
                     cuts={"a0": 1, "a1": 3})
    finally:
        torch.set_num_threads(threads)

    mqtt_run, local_run = tmp_path / "runs" / "mqtt", tmp_path / "runs" / "local"
    a, b = _weights(mqtt_run), _weights(local_run)
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
        'split = 2\n[model.cuts]\na0 = 1\n[data]\ndataset = "digits"\n[train]\n'
        'algorithm = "ampere"\nrounds = 3\nbatch = 48\nlr = 0.1\ndevice_epochs = 1\n'
        f'upload_mb = 0.1\nactivation_dir = "{tmp_path / "a"}"\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "jetsplit.cli", "server", "run",
                           "--config", str(config), "--broker", url],
                          capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'a0': 1" in done.stdout and "'a1': 2" in done.stdout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workers = {a: build_worker(load_agent_config(p)) for a, p in fleet.configs.items()}
        cfg = load_server_config(config)
        settings = replace(cfg.settings(), activation_dir=str(tmp_path / "b"))
        _, test = load_dataset_split("digits", 0.2, 0)
        run_training(InProcessEngine(workers, run_id="local"),
                     prepare_bundle(cfg, tmp_path / "local"), settings, test,
                     tmp_path / "runs" / "local", cuts={"a0": 1, "a1": 2})
    finally:
        torch.set_num_threads(threads)

    mqtt_run, local_run = tmp_path / "runs" / "mqtt", tmp_path / "runs" / "local"
    a, b = _weights(mqtt_run), _weights(local_run)
    assert set(a) == set(b) and any(k.startswith("aux:aux-k1/") for k in a)
    assert [k for k in a if a[k].tobytes() != b[k].tobytes()] == []
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").open()]
            for run in (mqtt_run, local_run)]
    assert [r["phase"] for r in rows[0]] == [1, 2, 2]
    assert rows[0][1]["bytes_by_kind"]["up"]["generate"] > 0
    for key in ("train_loss", "accuracy", "validation_accuracy"):
        assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]], key
