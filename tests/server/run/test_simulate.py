"""`jetsplit simulate` and the methods end to end in one process: every method runs, the
report has what the README promises, and 100 simulated clients share one copy of the data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jetsplit.catalog import METHODS
from jetsplit.cli import main
from jetsplit.server.run.simulate import sherl_topology, simulate
from jetsplit.server.training.settings import Settings

ROUND_KEYS = {"round", "algorithm", "selected", "missed", "train_loss", "accuracy",
              "balanced_accuracy", "per_class_accuracy", "test_loss", "bytes_up", "bytes_down",
              "bytes_by_kind", "eval_bytes", "bundle_bytes", "device_gflops", "phases_s",
              "seconds"}


def test_simulate_cli_json_and_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    out = tmp_path / "run"
    code = main(["simulate", "--algorithm", "scala", "--model", "mobilenetv3-small",
                 "--dataset", "digits", "--clients", "4", "--fraction", "0.5", "--rounds", "2",
                 "--local-steps", "2", "--partition", "quantity:2", "--seed", "3",
                 "--out", str(out), "--json"])
    assert code == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("algorithm", "rounds", "final_accuracy", "balanced_accuracy", "bytes_up",
                "bytes_down", "device_gflops"):
        assert key in last, key
    assert last["algorithm"] == "scala" and last["rounds"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert len(rows) == 2 and set(rows[0]) >= ROUND_KEYS
    assert all(len(r["selected"]) == 2 for r in rows)  # fraction 0.5 of 4
    assert len(rows[0]["per_class_accuracy"]) == 10
    kinds = rows[1]["bytes_by_kind"]
    assert {"forward", "set_weights"} <= set(kinds["up"]) | set(kinds["down"])
    assert "bundle" not in kinds["down"] and rows[0]["bundle_bytes"] > 0
    assert set(rows[0]["device_gflops"]) == set(rows[0]["selected"])
    assert all(v > 0 for v in rows[0]["device_gflops"].values())
    assert {"forward", "server", "backward", "evaluate"} <= set(rows[0]["phases_s"])
    assert (out / "summary.json").exists() and (out / "server.safetensors").exists()


def test_simulate_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--algorithm", "magic", "--dataset", "digits"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "algorithm" in err and err[-1] == "\n"
    assert main(["simulate", "--partition", "quantity:x", "--dataset", "digits"]) == 2
    assert "quantity" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["simulate", "trial"])
def test_a_run_folder_the_wire_cannot_name_is_refused_first(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run folder's name is the run id every message carries: one the wire refuses
    (`x=1`) is one line before anything starts, not a round 0 in which every agent refused
    every command."""
    out = tmp_path / "x=1"
    assert main([command, "--dataset", "digits", "--agents", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out}: the folder's name is the run id")
    assert err.count("\n") == 1 and not out.exists()


def test_server_run_resumes_no_folder_the_wire_cannot_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "server.toml"
    config.write_text('[data]\ndataset = "digits"\n[mqtt]\nbroker = "mqtt://127.0.0.1:1"\n')
    resume = tmp_path / "x=1"
    resume.mkdir()
    assert main(["server", "run", "--config", str(config), "--resume",
                 str(resume)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume {resume}: the folder's name is the run id"), err
    assert err.count("\n") == 1


@pytest.mark.parametrize("algorithm", sorted(METHODS))
def test_every_method_trains_and_reports(algorithm: str, tmp_path: Path) -> None:
    edges = sherl_topology(algorithm, 1 if algorithm == "sherl" else 0, 3)
    settings = Settings(algorithm=algorithm, rounds=2, local_steps=2, batch=32, lr=0.05,
                        edges=edges)
    summary = simulate(settings, model="vgg11", split=2, dataset="digits",
                       clients=3, partition_scheme="iid", out_dir=tmp_path)
    assert summary["algorithm"] == algorithm
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0
    assert summary["device_gflops"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert all(r["train_loss"] is not None and np.isfinite(r["train_loss"]) for r in rows)
    kinds = set(rows[-1]["bytes_by_kind"]["up"])
    if algorithm == "fedavg":
        # replies too; the upload releases the model (no exchange of its own)
        assert kinds == {"train", "get_weights", "set_weights"}
    elif algorithm.startswith("ampere"):  # round 0 trains client+aux, round 1 the server
        # the trained client+aux ships as an offer, then only the parts the agent lacks
        assert kinds == {"trained_bundle", "trained_bundle_part", "generate"}
    else:
        assert "forward" in kinds
    if algorithm in ("psl", "gapsl"):  # client blocks are never averaged
        assert "set_weights" not in rows[-1]["bytes_by_kind"]["down"]
        assert summary["final_accuracy_std"] is not None


def test_hundred_clients_share_one_copy_of_the_data(tmp_path: Path) -> None:
    from jetsplit.data import load_dataset_split, partition
    from jetsplit.edge_agent.worker import AgentWorker

    train, _ = load_dataset_split("digits", 0.2, 0)
    shards = partition(train.y, 100, "dirichlet:0.5", 0, train.num_classes)
    workers = [AgentWorker(f"a{i}", train.subset(s)) for i, s in enumerate(shards)]
    assert sum(len(w.data) for w in workers) == len(train)
    assert sum(w.data.x.nbytes for w in workers) == train.x.nbytes
    # Shards are copies of their rows only, never views that pin the whole array.
    assert all(w.data.x.base is None or w.data.x.base.nbytes < train.x.nbytes
               for w in workers)
    del workers

    settings = Settings(algorithm="scala", rounds=2, local_steps=1, fraction=0.1, batch=50)
    summary = simulate(settings, model="mobilenetv3-small", split=2, dataset="digits",
                       clients=100, partition_scheme="dirichlet:0.5", out_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [len(r["selected"]) for r in rows] == [10, 10]
    # Only the clients selected in a round ever held a block at once (they release theirs
    # when the round's average is taken).
    assert 1 <= summary["peak_agents_holding_blocks"] <= 10
    assert summary["peak_rss_mb"] > 0


def test_splitfed_v2_serves_a_client_whose_batch_share_rounds_to_one(tmp_path: Path) -> None:
    # 4 samples over 6 clients: B_k would round to 1, and SplitFed V2 runs each client's batch
    # through the server block alone, where BatchNorm needs more than one value per channel.
    settings = Settings(algorithm="splitfed-v2", rounds=1, local_steps=1, batch=4, lr=0.05)
    summary = simulate(settings, model="mobilenetv3-small", split=2, dataset="digits",
                       clients=6, partition_scheme="iid", out_dir=tmp_path)
    assert summary["algorithm"] == "splitfed-v2"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert np.isfinite(rows[-1]["train_loss"])
