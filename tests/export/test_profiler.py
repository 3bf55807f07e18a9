"""Profiler: a quick measured profile is written, loads, and `plan` uses its per-layer times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.export.cost_model import get_costs, measured_matches, predict_layer_times
from jetsplit.export.profiler import measure_layers, measure_ort_layers
from jetsplit.models import build_model
from jetsplit.profiles import load_profile, resolve_profile

MODEL = "mobilenetv3-small"
QUICK = ["--batch", "2", "--repeats", "1", "--warmup", "0"]


@pytest.fixture()
def cli_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
              ) -> Path:
    cache = tmp_path_factory.getbasetemp() / "jetsplit-cache"
    monkeypatch.setenv("JETSPLIT_CACHE_DIR", str(cache))
    return cache / "costs"


def test_measure_layers_times_every_layer() -> None:
    model = build_model(MODEL, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = measure_layers(model, batch=2, repeats=1, warmup=0)
    assert [m.name for m in layers] == model.layer_names
    assert all(m.fwd_ms > 0 and m.bwd_ms > 0 and m.peak_mem_mb > m.saved_mb for m in layers)
    assert all((before[k] == v).all() for k, v in model.state_dict().items())


def test_ort_layer_times_or_a_note() -> None:
    model = build_model("vgg11", (1, 16, 16), 10, seed=0)
    times, notes = measure_ort_layers(model, batch=2, repeats=1)
    assert len(times) == len(model)
    assert all(t is not None and t > 0 for t in times) or notes


def test_profile_cli_writes_a_profile_plan_accepts(
        cli_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nano-measured.toml"
    assert main(["profile", "--model", MODEL, *QUICK, "--no-ort", "--out", str(out),
                 "--base-profile", "jetson-nano-4gb"]) == 0
    assert "wrote" in capsys.readouterr().out
    prof = load_profile(out)
    nano = resolve_profile("jetson-nano-4gb")
    assert prof.name == "nano-measured" and prof.memory == nano.memory
    assert prof.measured is not None and prof.measured.batch == 2
    costs = get_costs(MODEL, (3, 32, 32), 10, cache_dir=cli_cache)
    assert measured_matches(costs, prof)
    times = predict_layer_times(costs, prof, 8)  # scaled ×4 from the measured batch
    for t, m in zip(times, prof.measured.layers, strict=True):
        assert t.source == "measured" and t.fwd_ms == pytest.approx(4 * m.fwd_ms)

    assert main(["export", "plan", "--model", MODEL, "--profile", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["devices"][0]["time_source"] == "measured"
    assert data["chosen_k"] is not None


def test_profile_without_base_describes_this_host(cli_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "here.toml"
    assert main(["profile", "--model", MODEL, *QUICK, "--no-ort", "--out", str(out)]) == 0
    prof = load_profile(out)
    assert prof.device.kind == "cpu" and prof.memory.total_mb > 0
    assert 0 < prof.compute.efficiency <= 1 and prof.measured is not None


def test_profile_cli_bad_input_is_one_line(cli_cache: Path, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    assert main(["profile", "--model", "nope", *QUICK, "--no-ort"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert main(["profile", "--model", MODEL, "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_profile_on_a_cpu_only_torch_writes_a_cpu_profile(
        cli_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stock JetPack 4 Nano's torch has no CUDA: a GPU base profile's cores and peaks give
    way to the CPU's that were measured; a CPU base profile keeps its own figures."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: the measurement runs on it")
    out = tmp_path / "nano-cpu-measured.toml"
    assert main(["profile", "--model", MODEL, *QUICK, "--no-ort", "--out", str(out),
                 "--base-profile", "jetson-nano-4gb"]) == 0
    assert "measured on the CPU (torch has no CUDA here)" in capsys.readouterr().out
    prof, gpu = load_profile(out), resolve_profile("jetson-nano-4gb")
    assert prof.device.kind == "cpu" and prof.device.gpu is None
    assert prof.compute.cuda_cores is None and prof.compute.gpu_clock_mhz is None
    assert prof.compute.peak_fp16_gflops is None
    assert prof.compute.peak_fp32_gflops != gpu.compute.peak_fp32_gflops
    # the achieved share of the measured peak, kept in [0.001, 1] (a host busy enough to run
    # the model at a thousandth of its sgemm peak still gives a usable efficiency)
    assert prof.measured is not None and prof.compute.efficiency == pytest.approx(
        min(1.0, max(0.001, prof.measured.achieved_gflops / prof.compute.peak_fp32_gflops)),
        abs=1e-4)
    assert prof.memory == gpu.memory and prof.network == gpu.network
    kept = tmp_path / "kept.toml"
    assert main(["profile", "--model", MODEL, *QUICK, "--no-ort", "--out", str(kept),
                 "--base-profile", "jetson-nano-4gb-cpu"]) == 0
    assert "measured on the CPU" not in capsys.readouterr().out
    assert load_profile(kept).compute == resolve_profile("jetson-nano-4gb-cpu").compute
