"""The field guide's example, end to end: a user's residual network (testing/usernets.py,
not a Sequential: torch.fx finds its cuts), started from a weights file of a 10-class
model (its classifier re-initialised for the run's 3 classes), trained on a folder of
JPEG and PNG pictures of many sizes and modes with one truncated file, by SplitFed V1,
SCALA, PSL and Ampere in `simulate` with per-device cuts, then by SCALA in a `trial` over
MQTT with per-device cuts; `export model` and `predict` on the result. And the plumbing
adds nothing: a zoo name and a factory returning that zoo model train the same bits."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import torch

from jetsplit.cli import main

pytest.importorskip("PIL.Image")

from camera_folders import write_folder  # noqa: E402  (testing/, on the path in tests)

TESTING = str(Path(__file__).resolve().parents[2] / "testing")
CLASSES = ["blue", "green", "red"]
CUTS = {"a0": 2, "a1": 5, "a2": 8}
CUT_FLAGS = [flag for agent, k in CUTS.items() for flag in ("--cut", f"{agent}={k}")]


@pytest.fixture(scope="module")
def camera(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_folder(tmp_path_factory.mktemp("field") / "camera", per_class=12, seed=3)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pretrained-style file: the same network for 10 classes (a PyTorch state dict)."""
    from usernets import tiny_resnet

    torch.manual_seed(11)
    path = tmp_path_factory.mktemp("weights") / "tiny10.pt"
    torch.save(tiny_resnet(10, (3, 16, 16)).state_dict(), path)
    return path


def _manifest(run: Path) -> dict:
    with tarfile.open(run / "checkpoint" / "bundle.tar.gz") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("manifest.json"))
        handle = tar.extractfile(member)
        assert handle is not None
        return json.load(io.TextIOWrapper(handle))


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").open()]


@pytest.mark.parametrize("algorithm", ["splitfed-v1", "scala", "psl", "ampere"])
def test_simulate_a_user_model_on_camera_pictures(algorithm: str, camera: Path, weights: Path,
                                                  tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "run"
    code = main(["simulate", "--algorithm", algorithm, "--model", "usernets:tiny_resnet",
                 "--dataset", f"folder:{camera}", "--image-size", "16",
                 "--weights", str(weights), "--agents", "3", "--partition", "iid",
                 "--rounds", "3", "--local-steps", "2", "--batch", "12", "--split", "2",
                 *CUT_FLAGS, "--seed", "1", "--out", str(out), "--json"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["classes"] == CLASSES and summary["rounds"] == 3
    rows = _rows(out)
    assert len(rows) == 3 and all(len(r["per_class_accuracy"]) == 3 for r in rows)
    if algorithm != "ampere":  # Ampere's server phase trains on the uploaded activations
        assert all(r["cuts"] == CUTS for r in rows)
    manifest = _manifest(out)
    assert manifest["classes"] == CLASSES and manifest["model"]["name"] == "usernets:tiny_resnet"
    assert manifest["initial_weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert manifest["code"]["module"] == "usernets" and len(manifest["code"]["sha256"]) == 64
    assert any("re-initialised fc for the new class count" in r.getMessage()
               for r in caplog.records)
    assert all(r["train_loss"] == r["train_loss"] for r in rows)  # finite: no NaN


def test_a_zoo_name_and_a_factory_returning_it_train_the_same_bits(tmp_path: Path) -> None:
    runs = {}
    for model in ("resnet18", "usernets:zoo_resnet18"):
        out = tmp_path / model.replace(":", "-")
        assert main(["simulate", "--algorithm", "scala", "--model", model, "--dataset",
                     "digits", "--agents", "3", "--rounds", "2", "--local-steps", "2",
                     "--split", "3", "--seed", "2", "--out", str(out), "--json"]) == 0
        runs[model] = out
    zoo, user = runs.values()
    for name in ("client.safetensors", "server.safetensors"):
        assert (zoo / name).read_bytes() == (user / name).read_bytes(), name
    assert [r["train_loss"] for r in _rows(zoo)] == [r["train_loss"] for r in _rows(user)]


def test_a_trial_over_mqtt_then_export_and_predict(camera: Path, weights: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (TESTING, os.environ.get("PYTHONPATH")) if p))  # the agents' processes
    out = tmp_path / "trial"
    code = main(["trial", "--algorithm", "scala", "--model", "usernets:tiny_resnet",
                 "--dataset", f"folder:{camera}", "--image-size", "16",
                 "--weights", str(weights), "--agents", "3", "--partition", "iid",
                 "--rounds", "2", "--local-steps", "2", "--batch", "12", *CUT_FLAGS,
                 "--seed", "1", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = _rows(out)
    assert summary["classes"] == CLASSES and all(r["cuts"] == CUTS for r in rows)
    report = (out / "report.md").read_text()
    assert "Per-class accuracy in the last round (%): blue: " in report
    # every agent met the truncated file (its statistics sample covers the whole folder);
    # an agent sitting out at the last poll would report nothing, not zero
    reported = [info["images_skipped"] for info in rows[-1]["agents"].values()
                if "images_skipped" in info]
    assert reported and all(n >= 1 for n in reported)
    capsys.readouterr()

    assert main(["export", "model", str(out)]) == 0
    assert main(["predict", str(out / "model.onnx"), "--dataset", f"folder:{camera}",
                 "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    accuracy = float(printed.split("accuracy ")[1].split(";")[0])
    assert accuracy == pytest.approx(summary["final_accuracy"], abs=1e-4)  # same crops
    assert "per class: blue " in printed
