"""Ampere over a real broker: agent processes and `jetsplit server run` through phase two,
and the same fleet in one process ending bit-identical."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import run_in_process, server_run
from safetensors.numpy import load_file

from jetsplit.models import ModelSpec
from jetsplit.server.ops.brokers import MosquittoProcess

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
SPLIT = 2
SHAPE = (16, 4, 4)  # mobilenetv3-small's activation at split 2 for 8×8 inputs


def test_mqtt_run_through_phase_two_matches_in_process(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path) -> None:
    """Agent processes behind a real broker, `jetsplit server run`: phase 1, the trained
    bundle, sliced uploads streamed into the store, server epochs; the in-process engine
    on the same agents and config ends with the same weights, bit for bit."""
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet_ = agent_fleet(url, "amp", 2).start()
    config = tmp_path / "server.toml"
    config.write_text(
        f'fleet = "amp"\nagents = 2\nwait_s = 120\nout = "{tmp_path / "runs"}"\nrun = "mqtt"\n'
        '[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\nsplit = 2\n'
        '[data]\ndataset = "digits"\n[train]\ndeadline_s = 300\n'
        'algorithm = "ampere"\nrounds = 4\nbatch = 48\n'
        f'lr = 0.1\ndevice_epochs = 2\nupload_mb = 0.1\nactivation_dir = "{tmp_path / "a"}"\n')
    server_run(config, url)
    run_in_process(fleet_, config, tmp_path / "runs" / "local",
                   settings={"activation_dir": str(tmp_path / "b")})

    runs = [tmp_path / "runs" / name for name in ("mqtt", "local")]
    got = [[json.loads(line) for line in (run / "metrics.jsonl").open()] for run in runs]
    assert [r["phase"] for r in got[0]] == [1, 1, 2, 2]
    assert got[0][2]["bytes_by_kind"]["up"]["generate"] > 0
    assert got[0][-1]["accuracy"] > 0.3  # two short server epochs; chance is 0.1
    assert json.loads((runs[0] / "summary.json").read_text())["missed"] == []
    for key in ("train_loss", "accuracy", "validation_accuracy"):
        assert [r[key] for r in got[0]] == [r[key] for r in got[1]], key
    for name in ("client", "aux", "server"):
        a, b = (load_file(str(run / f"{name}.safetensors")) for run in runs)
        assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a), name


# --------------------------------------------------------------------------- per-device cuts
