"""TensorBoard and MLflow are fed from the per-round rows; absent packages are one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.errors import ConfigError
from jetsplit.server.ops.tracking import Trackers, scalars
from jetsplit.server.run.assembly import chain_rounds as chain

ROWS = [{"round": 0, "accuracy": 0.5, "train_loss": 2.0, "test_loss": None,
         "bytes_up_total": 3_000_000, "phases_s": {"forward": 1.5}, "seconds": 4.0},
        {"round": 1, "accuracy": 0.75, "train_loss": 1.0, "bytes_up_total": 6_000_000,
         "seconds": float("nan")}]


def test_scalars_from_a_row() -> None:
    assert dict(scalars(ROWS[0])) == {"accuracy/top1": 0.5, "loss/train": 2.0,
                                      "time/round_s": 4.0, "traffic/up_total_mb": 3.0,
                                      "time/phase_forward_s": 1.5}
    assert "time/round_s" not in dict(scalars(ROWS[1]))  # NaN is not recorded
    seen: list[int] = []
    hook = chain(None, lambda r: seen.append(1), lambda r: seen.append(2))
    assert chain(None, None) is None and hook is not None
    hook({})
    assert seen == [1, 2]


def test_tensorboard_scalars_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers(tensorboard=str(tmp_path / "tb"))
    assert trackers.active
    for row in ROWS:
        trackers.log_round(row)
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    top1 = [(e.step, e.value) for e in events.Scalars("accuracy/top1")]
    assert top1 == [(1, 0.5), (2, 0.75)]
    assert [e.value for e in events.Scalars("traffic/up_total_mb")] == [3.0, 6.0]


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is not None,
                    reason="mlflow is installed here")
def test_missing_mlflow_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"^--mlflow: the mlflow package is not installed"):
        Trackers(mlflow="file:///tmp/x")
    assert main(["trial", "--mlflow", "file:///tmp/x", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --mlflow:") and err.count("\n") == 1
    assert not (tmp_path / "t").exists()
