"""Coordinator checkpoint/resume: a run killed with SIGKILL after round 2 of 4 and resumed
ends with the same weights as an uninterrupted run (fp32, in-process agents)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jetsplit.server.training.checkpoints import (
    CheckpointError,
    load_checkpoint,
    load_optimizer_state,
    optimizer_state,
    save_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]


def _simulate(*args: str) -> list[str]:
    return [sys.executable, "-m", "jetsplit.cli", "simulate", *args]


def _options(algorithm: str, out: Path) -> list[str]:
    return ["--algorithm", algorithm, "--model", "mobilenetv3-small", "--split", "2",
            "--dataset", "digits", "--clients", "4", "--fraction", "0.5", "--rounds", "4",
            "--local-steps", "3", "--batch", "32", "--seed", "5", "--json", "--out", str(out)]


def _checkpointed_round(run: Path) -> int:
    try:
        return int(json.loads((run / "checkpoint" / "state.json").read_text())["round"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


def _weights(run: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for path in sorted(run.rglob("*.safetensors")):
        if "checkpoint" in path.parts:
            continue
        out.update({f"{path.relative_to(run)}:{k}": v for k, v in load_file(path).items()})
    return out


@pytest.mark.parametrize("algorithm", ["scala", "psl"])
def test_sigkill_after_round_2_then_resume_equals_uninterrupted(algorithm: str,
                                                                tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    steady, broken = tmp_path / "steady", tmp_path / "broken"
    subprocess.run(_simulate(*_options(algorithm, steady)), check=True, env=env,
                   capture_output=True, timeout=600)

    proc = subprocess.Popen(_simulate(*_options(algorithm, broken)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while _checkpointed_round(broken) < 1 and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint of round 2 in time"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert _checkpointed_round(broken) in (1, 2)
    assert not (broken / "summary.json").exists()

    done = subprocess.run(_simulate("--resume", str(broken), "--json"), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    steady_rows = [json.loads(x) for x in (steady / "metrics.jsonl").read_text().splitlines()]
    broken_rows = [json.loads(x) for x in (broken / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in broken_rows] == [0, 1, 2, 3]
    for a, b in zip(steady_rows, broken_rows, strict=True):
        assert a["accuracy"] == b["accuracy"] and a["train_loss"] == b["train_loss"]
        assert a["selected"] == b["selected"]
    first, second = _weights(steady), _weights(broken)
    assert first and set(first) == set(second)
    for name, value in first.items():
        assert np.array_equal(value, second[name]), name
    # Books continue across the restart (headers carry timestamps, so bytes vary by a few;
    # PSL also reinstalls each agent's own block after the resume).
    resumed = json.loads((broken / "summary.json").read_text())["bytes_up"]
    assert resumed == pytest.approx(
        json.loads((steady / "summary.json").read_text())["bytes_up"], rel=1e-2)


def test_optimizer_state_round_trips(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    arrays, meta = optimizer_state(opt, "optimizer")
    assert arrays  # momentum buffers
    save_checkpoint(tmp_path, 0, {"optimizer": meta}, arrays, _bundle(tmp_path))
    saved = load_checkpoint(tmp_path)
    twin = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    load_optimizer_state(twin, "optimizer", saved.arrays, saved.meta["optimizer"])
    assert twin.param_groups[0]["lr"] == 0.1
    for p in model.parameters():
        assert torch.equal(twin.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def _bundle(tmp_path: Path) -> Path:
    path = tmp_path / "b.tar.gz"
    path.write_bytes(b"x")
    return path


def test_a_newer_checkpoint_replaces_the_older_one(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path)
    save_checkpoint(tmp_path / "c", 0, {}, {"w": np.zeros(2, np.float32)}, bundle)
    save_checkpoint(tmp_path / "c", 1, {}, {"w": np.ones(2, np.float32)}, bundle)
    saved = load_checkpoint(tmp_path / "c")
    assert saved.round == 1 and saved.arrays["w"].tolist() == [1.0, 1.0]
    assert len(list((tmp_path / "c").glob("arrays-*"))) == 1


@pytest.mark.parametrize("text, message", [
    (None, "no checkpoint"),
    ("{not json", "not valid JSON"),
    ('{"format": 99}', "not a jetsplit checkpoint"),
    ('{"format": 1, "round": 0, "arrays": "../../etc/passwd"}', "bad round or arrays"),
    ('{"format": 1, "round": 0, "arrays": "arrays-9.safetensors"}', "cannot read"),
])
def test_damaged_checkpoints_fail_in_one_line(tmp_path: Path, text: str | None,
                                              message: str) -> None:
    if text is not None:
        (tmp_path / "state.json").write_text(text)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(tmp_path)
    assert "\n" not in str(info.value)


def test_resume_refuses_changed_settings(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = tmp_path / "run"
    options = _options("scala", run)
    options[options.index("--rounds") + 1] = "1"
    subprocess.run(_simulate(*options), check=True, env=env, capture_output=True, timeout=600)
    state = json.loads((run / "simulation.json").read_text())
    state["settings"]["lr"] = 0.5
    (run / "simulation.json").write_text(json.dumps(state))
    done = subprocess.run(_simulate("--resume", str(run)), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode != 0
    assert "setting 'lr' was unset (the method's default), now 0.5" in done.stderr
    assert "Traceback" not in done.stderr

    # a checkpoint from before a setting existed (its default then applies) resumes, even
    # where the default is built by a factory (a dict: `provisioned_sizes`, `edges`)
    state["settings"]["lr"] = None
    state["settings"]["rounds"] = 2
    (run / "simulation.json").write_text(json.dumps(state))
    saved = json.loads((run / "checkpoint" / "state.json").read_text())
    for key in ("provisioned_sizes", "edges", "gradient_shares"):
        del saved["settings"][key]
    (run / "checkpoint" / "state.json").write_text(json.dumps(saved))
    done = subprocess.run(_simulate("--resume", str(run)), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _checkpointed_round(run) == 1
