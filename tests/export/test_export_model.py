"""`jetsplit export model`: a run's trained blocks leave as ONNX that ONNX Runtime runs like
the PyTorch composition (max |Δ| ≤ 1e-4), for a split method (SCALA) and for PSL's
per-client models; `jetsplit predict` reproduces the run's own test accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from jetsplit.cli import main
from jetsplit.data import load_dataset_split
from jetsplit.export.model_export import compose, read_run
from jetsplit.runtimes.onnx_runtime import CPU_EP, OnnxBlock


def _simulate(algorithm: str, out: Path) -> dict:
    assert main(["simulate", "--algorithm", algorithm, "--model", "mobilenetv3-small",
                 "--dataset", "digits", "--agents", "2", "--rounds", "1", "--local-steps", "3",
                 "--lr", "0.05", "--out", str(out)]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("algorithm, names", [("scala", ["model"]), ("psl", ["a0", "a1"])])
def test_exported_onnx_matches_the_trained_composition(
        algorithm: str, names: list[str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / algorithm
    summary = _simulate(algorithm, run)
    capsys.readouterr()
    assert main(["export", "model", str(run), "--out", str(tmp_path / "m.onnx")]) == 0
    paths = {n: tmp_path / ("m.onnx" if n == "model" else f"m-{n}.onnx") for n in names}
    assert all(p.is_file() for p in paths.values())

    trained = read_run(run)
    _, test = load_dataset_split("digits", 0.2, 0)
    for name, path in paths.items():
        module = compose(trained, trained.clients[name])
        with torch.no_grad():
            expected = module(torch.from_numpy(test.x)).numpy()
        got = OnnxBlock(path, providers=[CPU_EP]).run(test.x)
        assert float(np.abs(got - expected).max()) <= 1e-4
        assert float(expected.std()) > 1e-3  # real logits, not a constant

    # predict: the exported model scores what the run's own evaluation scored
    accuracies = []
    for path in paths.values():
        assert main(["predict", str(path), "--dataset", "digits"]) == 0
        line = capsys.readouterr().out
        assert "latency" in line and "ms per batch" in line
        accuracies.append(float(line.split("accuracy ")[1].split(";")[0]))
    assert np.mean(accuracies) == pytest.approx(summary["final_accuracy"], abs=1e-4)


def test_export_model_errors_are_one_line(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "model", str(tmp_path / "nope")]) == 2
    assert "not a folder" in capsys.readouterr().err
    tmp_path.joinpath("run").mkdir()
    assert main(["export", "model", str(tmp_path / "run")]) == 2
    assert "no checkpoint/bundle.tar.gz" in capsys.readouterr().err
