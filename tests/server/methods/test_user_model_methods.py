"""Ampere and SHeRL-FL train a non-sequential user network (testing/usernets.py
tiny_resnet: residual blocks, cut by the fx cut finder) at every candidate cut: Ampere at
each cut alone and with all nine cuts mixed across nine devices, SHeRL-FL with its clients
at every cut and its edge tier ending at every cut; and both learn digits.

tiny_resnet on 1×8×8 digits: blocks stem, stem_bn, relu, block1, relu_2, block2, relu_4,
adaptive_avg_pool2d, flatten, fc; cuts 1-5 carry (8,8,8), 6-7 (16,4,4), 8 (16,1,1),
9 (16,). An aux head has 8·16+16+16·10+10 = 314 parameters at cuts 1-5 and
16·16+16+16·10+10 = 442 at 6-9 (tests/core/test_aux_any_cut_fast.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from jetsplit.data import load_dataset_split, partition
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec, build_model, split
from jetsplit.models.weights import to_arrays
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.methods import build_method
from jetsplit.server.methods.ampere import Ampere
from jetsplit.server.run.simulate import sherl_topology, simulate
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

SPEC = ModelSpec("usernets:tiny_resnet", (1, 8, 8), 10)
MODEL = SPEC.name
CUTS = list(range(1, 10))
HEAD_PARAMS = {k: 314 if k <= 5 else 442 for k in CUTS}
FREE = {"relu", "relu_2", "relu_4", "adaptive_avg_pool2d", "flatten"}  # parameter-free


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Agents and server share this process: one torch thread each (conftest)."""


def _layer(name: str) -> str:
    """`client/block1.block1.bn1.weight` → `block1`."""
    return name.split("/", 1)[1].split(".", 1)[0]


def _fleet(rows: list[int]) -> InProcessEngine:
    train, _ = load_dataset_split("digits", 0.2, 0)
    shards = partition(train.y, len(rows), "iid", 0, train.num_classes)
    return InProcessEngine({f"a{i}": AgentWorker(f"a{i}", train.subset(s[:rows[i]]), seed=i)
                            for i, s in enumerate(shards)})


def _ampere(archive: Path, engine: InProcessEngine, workdir: Path,
            cuts: dict[str, int] | None = None) -> Ampere:
    _, test = load_dataset_split("digits", 0.2, 0)
    settings = Settings(algorithm="ampere", rounds=2, batch=32, lr=0.1, device_epochs=1,
                        activation_dir=str(workdir))
    method = build_method("ampere", Trainer(engine, archive, settings, test, cuts=cuts))
    assert isinstance(method, Ampere)
    return method


def _play(method: Ampere, round_: int) -> float | None:
    t = method.trainer
    t.round = round_
    t.books.reset()
    return method.run_round(t.engine.registry.eligible())


def _changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> set[str]:
    """Layers with a float tensor that moved."""
    return {_layer(n) for n, v in before.items()
            if v.dtype.kind == "f" and not np.array_equal(v, after[n])}


def _params(head: dict[str, np.ndarray]) -> int:
    return sum(v.size for v in head.values())


# ---------------------------------------------------------------- Ampere


@pytest.mark.parametrize("cut", CUTS)
def test_ampere_trains_the_user_network_at_every_cut(cut: int, tmp_path: Path) -> None:
    """The bundle's own aux head at `cut`: phase 1 trains client block + head on the
    devices, phase 2 the server block on the uploaded activations."""
    archive = write_bundle(SPEC, cut, tmp_path / "b", seed=0, tar=True).tar_path
    assert archive is not None
    method = _ampere(archive, _fleet([70, 40]), tmp_path / "work")
    t = method.trainer
    head0, client0 = dict(method.aux[cut]), dict(t.global_client)
    server0 = to_arrays(t.server, "server")
    assert _params(head0) == HEAD_PARAMS[cut]
    assert np.isfinite(_play(method, 0))  # N_d = 1: phase 1 is this one epoch
    assert method.phase == 2
    assert _params(method.aux[cut]) == HEAD_PARAMS[cut]
    assert _changed(head0, method.aux[cut]) == {"hidden", "classifier"}
    names = build_model(SPEC, seed=0).layer_names
    assert _changed(client0, t.global_client) == set(names[:cut]) - FREE
    assert np.isfinite(_play(method, 1))  # the uploads, then a server epoch
    assert method._store().completed() == ["a0", "a1"]
    assert "fc" in _changed(server0, to_arrays(t.server, "server"))
    assert 0.0 <= method.evaluate()["accuracy"] <= 1.0


def test_ampere_with_every_cut_on_its_own_device(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Nine devices at cuts 1..9 (server cut 9): each cut has its own head (its own
    hand-counted size), trained by its one device; each layer is the |D_k|-weighted mean
    of the devices holding it; phase 2 carries every cut's uploads to cut 9."""
    rows = [30 + 5 * i for i in range(9)]
    archive = write_bundle(SPEC, 9, tmp_path / "b", seed=0, tar=True).tar_path
    assert archive is not None
    cuts = {f"a{i}": i + 1 for i in range(9)}
    method = _ampere(archive, _fleet(rows), tmp_path / "work", cuts=cuts)
    t = method.trainer
    assert sorted(method.aux) == CUTS
    assert {k: _params(h) for k, h in method.aux.items()} == HEAD_PARAMS
    heads0 = {k: dict(h) for k, h in method.aux.items()}
    seen: dict[str, dict[str, np.ndarray]] = {}
    pull = t.pull

    def recording(agents: list[str], blocks: tuple[str, ...] = ("client",)) -> Any:
        out = pull(agents, blocks)
        seen.update({a: dict(v) for a, v in out.items()})
        return out

    monkeypatch.setattr(t, "pull", recording)
    assert np.isfinite(_play(method, 0))
    assert set(seen) == set(cuts)
    names = build_model(SPEC, seed=0).layer_names
    for agent, cut in cuts.items():
        head = {n: v for n, v in seen[agent].items() if n.startswith("aux/")}
        assert head.keys() == method.aux[cut].keys()
        assert all(np.array_equal(head[n], method.aux[cut][n]) for n in head)
        assert _changed(heads0[cut], method.aux[cut]) == {"hidden", "classifier"}
        layers = {_layer(n) for n in seen[agent] if n.startswith("client/")}
        assert layers == set(names[:cut]) - FREE, agent
    for name, value in t.global_client.items():
        if value.dtype.kind != "f":
            continue
        holders = [a for a, c in cuts.items() if _layer(name) in names[:c]]
        want = sum(seen[a][name].astype(np.float64) * rows[int(a[1:])] for a in holders)
        want /= sum(rows[int(a[1:])] for a in holders)
        np.testing.assert_allclose(value, want.astype(value.dtype), rtol=0, atol=1e-6,
                                   err_msg=name)
    server0 = to_arrays(t.server, "server")
    assert np.isfinite(_play(method, 1))
    assert method._store().completed() == sorted(cuts)
    assert _changed(server0, to_arrays(t.server, "server")) == {"fc"}


def test_ampere_learns_the_user_network(tmp_path: Path) -> None:
    settings = Settings(algorithm="ampere", rounds=6, batch=64, lr=0.1, device_epochs=3)
    summary = simulate(settings, model=MODEL, split=5, dataset="digits", clients=3,
                       partition_scheme="iid", out_dir=tmp_path / "run")
    assert summary["final_accuracy"] > 0.5  # chance is 0.1
    assert summary["missed"] in ({}, [], None)


# ---------------------------------------------------------------- SHeRL-FL


def _sherl(tmp_path: Path, k1: int, k2: int | None, rounds: int = 2, steps: int = 4
           ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    settings = Settings(algorithm="sherl", rounds=rounds, local_steps=steps, batch=32,
                        lr=0.05, tau1=2, tau2=steps, edges=sherl_topology("sherl", 2, 4),
                        edge_split=k2)
    out = tmp_path / f"run-{k1}-{k2}"
    summary = simulate(settings, model=MODEL, split=k1, dataset="digits", clients=4,
                       partition_scheme="iid", out_dir=out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    final = {**load_file(str(out / "client.safetensors")),
             **load_file(str(out / "server.safetensors"))}
    return {"summary": summary, "final": final}, rows


def _check_tiers(tmp_path: Path, k1: int, k2: int | None, want_k2: int) -> None:
    run, rows = _sherl(tmp_path, k1, k2)
    assert run["summary"]["missed"] in ({}, [], None)
    assert [r["edge_split"] for r in rows] == [want_k2] * 2
    assert all(r["edge_loss"] is not None and np.isfinite(r["edge_loss"]) for r in rows)
    model = build_model(SPEC, seed=0)
    client, server = split(model, k1)
    initial = {**to_arrays(client, "client"), **to_arrays(server, "server")}
    names = model.layer_names
    moved = _changed(initial, run["final"])
    held = set(names[:k1]) - FREE
    edge = set(names[k1:want_k2]) - FREE
    cloud = set(names[want_k2:]) - FREE
    assert "fc" in cloud
    # Every client layer with weights moved (the edge's gradient reached the clients, also
    # through a parameter-free edge), as did the edge's own layers and the cloud's.
    assert moved == held | edge | cloud, (k1, want_k2)


@pytest.mark.parametrize("k1", CUTS[:-1])
def test_sherl_clients_at_every_cut_with_the_planned_edge(k1: int, tmp_path: Path) -> None:
    """The planner's k2 is 9: the cloud holds fc, the one vector-fed block; the edge holds
    everything between (only parameter-free blocks for k1 ≥ 6)."""
    _check_tiers(tmp_path, k1, None, 9)


@pytest.mark.parametrize("k2", list(range(3, 10)))
def test_sherl_edge_tier_ending_at_every_cut(k2: int, tmp_path: Path) -> None:
    """Clients at cut 2, the edge hosting [2:k2]: relu alone at k2 = 3 (nothing to step,
    yet its contrastive loss trains the clients through the gradient it returns)."""
    _check_tiers(tmp_path, 2, k2, k2)


def test_sherl_learns_the_user_network(tmp_path: Path) -> None:
    _, rows = _sherl(tmp_path, 1, 2, rounds=4, steps=10)
    assert rows[-1]["accuracy"] > 0.3  # chance is 0.1
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
