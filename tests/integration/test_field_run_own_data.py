"""A field run as a lab would start it: `jetsplit server run` evaluating on the
coordinator's own held-out folder (its class names are the run's), agent processes each on
their own camera folder over a real Mosquitto. A device lacking a class trains with its
labels mapped by name; a device with a class the run does not know is refused at
registration in one line and never trains; the report names the classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import server_run

from jetsplit.server.ops.brokers import MosquittoProcess

pytest.importorskip("PIL.Image")

from camera_folders import COLOURS, write_folder  # noqa: E402  (testing/)

TESTING = str(Path(__file__).resolve().parents[2] / "testing")


def _agent(root: Path, agent: str, folder: Path, url: str) -> Path:
    path = root / f"{agent}.toml"
    path.write_text(f'fleet = "field"\nagent = "{agent}"\nstate_dir = "{root / "state"}"\n'
                    f'threads = 1\ndevice = "cpu"\n[mqtt]\nbroker = "{url}"\n'
                    f'[data]\ndataset = "folder:{folder}"\nown = true\nimage_size = 16\n'
                    "workers = 0\nmean = [0.5, 0.5, 0.5]\nstd = [0.25, 0.25, 0.25]\n")
    return path


def test_own_folders_agree_classes_by_name(mosquitto: MosquittoProcess, tmp_path: Path
                                           ) -> None:
    from usernets import tiny_resnet

    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    held = write_folder(tmp_path / "held", per_class=6, seed=1, truncated=0)
    folders = {"cam0": write_folder(tmp_path / "cam0", per_class=10, seed=2,
                                    classes=("red", "green")),  # no blue: fine
               "cam1": write_folder(tmp_path / "cam1", per_class=10, seed=3)}
    wolf = write_folder(tmp_path / "cam2", per_class=4, seed=4, classes=("red",), truncated=0)
    (wolf / "red").rename(wolf / "wolf")  # a class the run does not know
    write_folder(wolf, per_class=4, seed=5, classes=("red",), truncated=0)
    weights = tmp_path / "start.pt"
    torch.manual_seed(0)
    torch.save(tiny_resnet(3, (3, 16, 16)).state_dict(), weights)

    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (TESTING, os.environ.get("PYTHONPATH"))
                                         if p)}
    agents = {**folders, "cam2": wolf}
    processes = []
    try:
        for agent, folder in agents.items():
            log = (tmp_path / f"{agent}.log").open("wb")
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "jetsplit.cli", "agent", "run", "--config",
                 str(_agent(tmp_path, agent, folder, url))],
                stdout=log, stderr=subprocess.STDOUT, env=env))
        config = tmp_path / "server.toml"
        config.write_text(
            f'fleet = "field"\nagents = 2\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
            'run = "field"\n[server]\nthreads = 1\n'
            '[model]\nsource = "usernets:tiny_resnet"\ninput_shape = [3, 16, 16]\n'
            f'classes = 3\nsplit = 2\nweights = "{weights}"\n'
            f'[data]\ndataset = "folder:{held}"\nown = true\nimage_size = 16\n'
            "mean = [0.5, 0.5, 0.5]\nstd = [0.25, 0.25, 0.25]\n"
            '[train]\nalgorithm = "splitfed-v1"\nrounds = 2\nlocal_steps = 3\nbatch = 8\n'
            "deadline_s = 120\ndeadline_k = 0\n")
        done = server_run(config, url, env=env, timeout=600)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    assert "2 rounds with 2 agents" in done.stdout
    assert "rejected messages: UnknownClass" in done.stdout
    run = tmp_path / "runs" / "field"
    summary = json.loads((run / "summary.json").read_text())
    names = sorted(COLOURS)  # the held-out folder's classes: blue, green, red
    assert summary["classes"] == names
    booked = {a["agent"]: a for a in summary["agents"]}
    assert sorted(booked) == ["cam0", "cam1"]  # cam2 never registered
    report = (run / "report.md").read_text()
    assert "Per-class accuracy in the last round (%): blue: " in report
    assert "class 'wolf' is not one of the run's 3 classes" in done.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert all(sorted(r["selected"]) == ["cam0", "cam1"] for r in rows)
    assert all(len(r["per_class_accuracy"]) == 3 for r in rows)
