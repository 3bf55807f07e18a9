"""The attack harness in `jetsplit simulate`: `--attack AGENT=SPEC` refused (one line, exit
2, before any data loads) unless JETSPLIT_ALLOW_ATTACKS=1, and an attacker's scaled weights
reaching the coordinator in a real in-process run. Coordinator-side (Python 3.10+): no
device marker."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jetsplit.cli import main
from jetsplit.edge_agent.attacks import ALLOW_ENV
from jetsplit.models.weights import to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.engines import seam as engine_module
from jetsplit.server.run.simulate import simulate
from jetsplit.server.training.settings import Settings

SIMULATE = ["simulate", "--algorithm", "splitfed-v1", "--model", "mobilenetv3-small",
            "--dataset", "digits", "--agents", "3", "--rounds", "1", "--local-steps", "2"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main([*SIMULATE, *argv])
    return code, capsys.readouterr().err


def test_simulate_attack_refused_without_the_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    out = tmp_path / "run"
    code, err = run_cli(capsys, "--attack", "a1=scale:1000", "--out", str(out))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: --attack a1: attacks are for tests and benchmarks only")
    assert f"{ALLOW_ENV}=1" in err
    assert not out.exists()  # refused before any data or bundle


@pytest.mark.parametrize(("option", "needle"), [
    ("a1", "write AGENT=SPEC"), ("=scale:2", "write AGENT=SPEC"), ("a1=", "write AGENT=SPEC"),
    ("a7=scale:2", "no simulated client 'a7' (they are a0..a2)"),
    ("a1=scale:abc", "--attack a1: attack 'scale:abc': scale needs a finite number"),
    ("a1=noise:-1", "noise needs a finite SIGMA"), ("a1=size-lie:0", "size-lie needs"),
])
def test_simulate_bad_attack_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str], option: str,
                                         needle: str) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")
    out = tmp_path / "run"
    code, err = run_cli(capsys, "--attack", option, "--out", str(out))
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert needle in err
    assert not out.exists()


def test_simulate_attack_twice_for_one_agent_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")
    code, err = run_cli(capsys, "--attack", "a1=scale:2", "--attack", "a1=signflip")
    assert code == 2 and "once per agent" in err


class WeightWitness(engine_module.InProcessEngine):
    """The in-process engine, noting for every get_weights reply what reached the
    coordinator next to the weights the agent really held."""

    uploads: list[tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]]] = []

    def _run_one(self, agent: str, command: engine_module.Command, round: int, step: int
                 ) -> engine_module.Reply | str:
        worker = self.workers[agent]
        held = to_arrays(worker.client, "client") if command.kind == Kind.GET_WEIGHTS.value \
            and worker.client is not None else None
        result = super()._run_one(agent, command, round, step)
        if held is not None and isinstance(result, engine_module.Reply):
            self.uploads.append((agent, held, result.tensors))
        return result


def test_scale_attacker_uploads_reach_the_coordinator_1000x(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")
    monkeypatch.setattr(engine_module, "InProcessEngine", WeightWitness)
    monkeypatch.setattr(WeightWitness, "uploads", [])
    settings = Settings(algorithm="splitfed-v1", rounds=1, local_steps=2, batch=24, lr=0.05)
    simulate(settings, model="mobilenetv3-small", split=2, dataset="digits", clients=3,
             partition_scheme="iid", out_dir=tmp_path, checkpoint=False,
             attacks={"a1": "scale:1000"})
    uploads = {agent: (held, sent) for agent, held, sent in WeightWitness.uploads}
    assert sorted(uploads) == ["a0", "a1", "a2"]
    for agent, (held, sent) in uploads.items():
        client = {k: v for k, v in sent.items() if k.startswith("client/")}
        assert set(client) == set(held)
        for name, w in held.items():
            factor = 1000 if agent == "a1" and np.issubdtype(w.dtype, np.floating) else 1
            assert np.allclose(client[name], w * factor, rtol=1e-6, atol=0), (agent, name)
    big = [k for k, v in uploads["a1"][0].items() if np.abs(v).max() > 0.01]
    assert big  # the comparison above is not between zeros
    saved = json.loads((tmp_path / "simulation.json").read_text())
    assert saved["attacks"] == {"a1": "scale:1000"}  # --resume keeps attacking


def test_simulate_attack_with_resume_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")
    code, err = run_cli(capsys, "--attack", "a1=scale:2", "--resume", str(tmp_path))
    assert code == 2 and "a resumed run keeps the attacks it began with" in err
