"""Ampere (the Ampere paper §3, Algorithm 1) and its no-consolidation ablation: the trained bundle's
ONNX client block, the on-disk activation store (restart, refusals), streaming replies,
early stopping, a simulation that learns, and a run over MQTT that matches the in-process
run bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jetsplit.bundle import load_bundle
from jetsplit.data import load_dataset_split, partition
from jetsplit.edge_agent.worker import AgentWorker, Result
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.models.split import eval_mode
from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.engines.seam import Command, InProcessEngine
from jetsplit.server.methods import build_method
from jetsplit.server.methods.activation_store import ActivationStore, StoreError
from jetsplit.server.methods.ampere import Ampere
from jetsplit.server.run.simulate import simulate
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
SPLIT = 2
SHAPE = (16, 4, 4)  # mobilenetv3-small's activation at split 2 for 8×8 inputs


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Agents and server share this process: one torch thread each (conftest)."""


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, SPLIT, tmp_path_factory.mktemp("b") / "bundle", seed=0, tar=True)
    assert report.tar_path is not None
    return report.tar_path


def fleet(agents: int, worker: type[AgentWorker] = AgentWorker, rows: int | list[int] = 150
           ) -> InProcessEngine:
    """`agents` in-process agents with `rows` digits each, or rows[i] for agent i (small:
    these tests check the mechanics, the simulation below checks learning)."""
    train, _ = load_dataset_split("digits", 0.2, 0)
    shards = partition(train.y, agents, "iid", 0, train.num_classes)
    counts = rows if isinstance(rows, list) else [rows] * agents
    return InProcessEngine({f"a{i}": worker(f"a{i}", train.subset(s[:counts[i]]), seed=i)
                            for i, s in enumerate(shards)})


def ampere(engine: InProcessEngine, archive: Path, workdir: Path,
           cuts: dict[str, int] | None = None, **settings: Any) -> Ampere:
    _, test = load_dataset_split("digits", 0.2, 0)
    merged: dict[str, Any] = {"algorithm": "ampere", "rounds": 4, "batch": 48, "lr": 0.1,
                              "device_epochs": 1, "activation_dir": str(workdir), **settings}
    trainer = Trainer(engine, archive, Settings(**merged), test, cuts=cuts)
    method = build_method(merged["algorithm"], trainer)
    assert isinstance(method, Ampere)
    return method


def play(method: Ampere, round_: int) -> float | None:
    """One round as `run_training` drives it (every agent selected)."""
    t = method.trainer
    t.round = round_
    t.books.reset()
    return method.run_round(t.engine.registry.eligible())


def record_pulls(monkeypatch: pytest.MonkeyPatch, trainer: Trainer
                 ) -> dict[str, dict[str, np.ndarray]]:
    """What each agent's last pull returned (the trainer's `pull` wrapped), by agent."""
    seen: dict[str, dict[str, np.ndarray]] = {}
    pull = trainer.pull

    def recording(agents: list[str], blocks: tuple[str, ...] = ("client",)
                  ) -> dict[str, dict[str, np.ndarray]]:
        out = pull(agents, blocks)
        seen.update({a: dict(v) for a, v in out.items()})
        return out

    monkeypatch.setattr(trainer, "pull", recording)
    return seen


def rows(n: int, first: int = 0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, *SHAPE)).astype(np.float32),
            (np.arange(first, first + n) % 10).astype(np.int64))


# --------------------------------------------------------------------------- trained bundle


def test_trained_bundle_generates_in_onnx_runtime_as_pytorch(archive: Path, tmp_path: Path
                                                             ) -> None:
    """After phase 1 the agents get a fresh bundle with the averaged client block, and its
    ONNX Runtime activations equal PyTorch's for those weights (not the initial ones)."""
    engine = fleet(2)
    method = ampere(engine, archive, tmp_path / "work")
    play(method, 0)  # one device epoch (N_d = 1): phase 1 is done
    assert method.phase == 2
    method._prepare_phase2()
    assert method.shipper is not None and method.shipper.ensure(engine.online()) == ["a0", "a1"]
    assert engine.counters.by_kind()["down"][Kind.TRAINED_BUNDLE.value] > 0  # training bytes

    out = engine.send_and_receive({"a1": Command(Kind.GENERATE.value,
                                                 {"offset": 5, "limit": 100})})
    reply, data = out["a1"], engine.workers["a1"].data
    assert reply.meta["backend"].endswith("ExecutionProvider")  # ONNX Runtime, not torch
    assert (reply.meta["offset"], reply.meta["samples"], reply.meta["total"]) == (
        5, 100, len(data))
    t = method.trainer
    trained, initial = t.bundle.client_module(), t.bundle.client_module()
    load_strict(trained, from_arrays(t.global_client, "client"), "client")
    x = torch.from_numpy(data.x[5:105])
    with torch.no_grad(), eval_mode(trained), eval_mode(initial):
        want, before = trained(x).numpy(), initial(x).numpy()
    assert np.abs(reply.tensors["activations"] - want).max() <= 1e-4
    assert np.abs(before - want).max() > 1e-2  # the fresh weights, not the first bundle's
    assert np.array_equal(reply.tensors["labels"], data.y[5:105])


# --------------------------------------------------------------------------- store


def test_store_survives_a_restart_and_cuts_a_torn_append(tmp_path: Path) -> None:
    store = ActivationStore(tmp_path, SHAPE, 10, max_bytes=1 << 26, tag="run-1")
    a0, y0 = rows(30)
    a1, y1 = rows(40, seed=1)
    store.append("a0", 0, 30, a0[:20], y0[:20])
    store.append("a1", 0, 40, a1[:25], y1[:25])
    store.append("a0", 20, 30, a0[20:], y0[20:])
    with open(tmp_path / "a1.act", "ab") as fh:  # killed mid-append: bytes, no commit
        fh.write(b"\0" * 1000)

    again = ActivationStore(tmp_path, SHAPE, 10, max_bytes=1 << 26, tag="run-1")
    assert again.completed() == ["a0"] and again.received("a1") == 25 and len(again) == 55
    acts, labels = again.take(np.concatenate([again.rows_of("a1"), again.rows_of("a0")]))
    assert np.array_equal(acts, np.concatenate([a1[:25], a0]))
    assert np.array_equal(labels, np.concatenate([y1[:25], y0]))
    again.append("a1", 25, 40, a1[25:], y1[25:])  # the upload goes on where it stopped
    assert again.completed() == ["a0", "a1"]
    assert np.array_equal(again.take(again.rows_of("a1"))[0], a1)
    with pytest.raises(StoreError, match="another model"):
        ActivationStore(tmp_path, SHAPE, 10, max_bytes=1 << 26, tag="run-2")
    with pytest.raises(StoreError, match="this run needs"):
        ActivationStore(tmp_path, (8, 2, 2), 10, max_bytes=1 << 26, tag="run-1")


def _bad(kind: str) -> tuple[str, int, int, np.ndarray, np.ndarray]:
    acts, labels = rows(8)
    if kind == "shape":
        acts = acts[:, :, :2]
    elif kind == "dtype":
        acts = acts.astype(np.float64)
    elif kind == "nan":
        acts[3, 0, 0, 0] = np.nan
    elif kind == "label":
        labels[2] = 10
    elif kind == "negative":
        labels[0] = -1
    elif kind == "label-dtype":
        labels = labels.astype(np.float32)  # type: ignore[assignment]
    elif kind == "count":
        labels = labels[:5]
    elif kind == "offset":
        return "a0", 3, 8, acts, labels
    elif kind == "total":
        return "a0", 0, 5, acts, labels
    elif kind == "name":
        return "../a0", 0, 8, acts, labels
    return "a0", 0, 8, acts, labels


@pytest.mark.parametrize(("kind", "says"), [
    ("shape", "expected float32 [8, 16, 4, 4]"), ("dtype", "float64"), ("nan", "NaN"),
    ("label", "out of range"), ("negative", "out of range"), ("label-dtype", "int64"),
    ("count", "expected float32 [5,"), ("offset", "expects row 0"), ("total", "labels must"),
    ("name", "not allowed")])
def test_store_refuses_bad_uploads_in_one_line(tmp_path: Path, kind: str, says: str) -> None:
    store = ActivationStore(tmp_path, SHAPE, 10, max_bytes=1 << 26)
    with pytest.raises(StoreError) as info:
        store.append(*_bad(kind))
    message = str(info.value)
    assert says in message and "\n" not in message and message.startswith("upload from")
    assert len(store) == 0 and not (tmp_path / "a0.act").exists()


def test_store_is_bounded(tmp_path: Path) -> None:
    row = 4 * 16 * 4 * 4 + 8
    store = ActivationStore(tmp_path, SHAPE, 10, max_bytes=10 * row)
    acts, labels = rows(8)
    store.append("a0", 0, 16, acts, labels)
    with pytest.raises(StoreError, match="exceed its"):
        store.append("a0", 8, 16, acts, labels)
    assert len(store) == 8


# --------------------------------------------------------------------------- engine


def test_in_process_stream_yields_each_agent_in_id_order_as_it_runs() -> None:
    engine = fleet(3)
    engine.registry.set_state("a1", "offline")
    stream = engine.send_and_stream({a: Command(Kind.STATUS.value) for a in ("a2", "a0", "a1")})
    first = next(stream)
    assert first.agents == ["a0"] and engine.workers["a2"].commands_done == 0  # not yet run
    rest = list(stream)
    assert [o.missed for o in rest] == [{"a1": "offline"}, {}]
    assert rest[1].agents == ["a2"] and engine.workers["a2"].commands_done == 1


# --------------------------------------------------------------------------- the method


class NaNWorker(AgentWorker):
    """A device whose uploads are poisoned."""

    def _do_generate(self, args: Any, round_: int, step: int, tensors: Any) -> Result:
        result = super()._do_generate(args, round_, step, tensors)
        result.tensors["activations"][0, 0, 0, 0] = np.nan
        return result


def test_coordinator_restart_between_upload_and_server_training(archive: Path,
                                                                tmp_path: Path) -> None:
    """Phase 2 with one agent away: the other two upload (in several slices each) and the
    server trains. The coordinator restarts from the checkpoint hooks: it knows whose
    uploads are complete, asks only the missing agent, and trains on the stored rows."""
    engine = fleet(3)
    method = ampere(engine, archive, tmp_path / "work", upload_mb=0.02)
    assert method._rows_per_reply("a0") < len(engine.workers["a0"].data)  # several replies
    play(method, 0)
    engine.registry.set_state("a2", "offline")
    assert play(method, 1) is not None
    store = method.store
    assert store is not None and store.completed() == ["a0", "a1"]
    arrays, meta = method.checkpoint()
    json.dumps(meta)  # JSON-serialisable
    assert all(isinstance(v, np.ndarray | np.generic) for v in arrays.values())
    before = engine.counters.snapshot()

    restarted = ampere(engine, archive, tmp_path / "elsewhere")  # the folder comes from meta
    restarted.restore(arrays, meta)
    assert restarted.phase == 2 and restarted.server_epochs == 1
    engine.registry.set_state("a2", "online")
    assert play(restarted, 2) is not None
    after = engine.counters.snapshot()
    generated = {a: after[a]["up"].get("generate", 0) - before[a]["up"].get("generate", 0)
                 for a in ("a0", "a1", "a2")}
    assert generated["a0"] == generated["a1"] == 0 and generated["a2"] > 0
    assert restarted.store is not None and restarted.store.completed() == ["a0", "a1", "a2"]
    assert not (tmp_path / "elsewhere").exists()


def test_a_poisoned_upload_is_a_recorded_miss(archive: Path, tmp_path: Path) -> None:
    engine = fleet(2)
    engine.workers["a1"] = NaNWorker("a1", engine.workers["a1"].data, seed=1)
    method = ampere(engine, archive, tmp_path / "work")
    play(method, 0)
    assert play(method, 1) is not None  # the server trains on a0's rows
    t = method.trainer
    assert "NaN" in t.books.missed["a1"] and t.books.missed["a1"].startswith("error: bad reply")
    assert method.store is not None and method.store.agents() == ["a0"]


class Killed(Exception):
    """Stands in for SIGKILL after a round's checkpoint."""


@pytest.mark.parametrize(("rounds", "device_epochs", "phases"), [
    (5, None, [1, 1, 2, 2, 2]),  # N_d unset: half the rounds (5 // 2)
    (7, None, [1, 1, 1, 2, 2, 2, 2]),
    (5, 4, [1, 1, 1, 1, 2]),  # a given N_d is kept, one round left for phase 2
])
def test_phase_one_takes_half_the_rounds_unless_told(archive: Path, tmp_path: Path,
                                                     rounds: int, device_epochs: int | None,
                                                     phases: list[int]) -> None:
    """Phase 1 keeps improving here (patience far off), so only N_d ends it: by default
    half the rounds, leaving the untrained server block the other half."""
    from jetsplit.server.run.assembly import RunSpec, execute

    _, test = load_dataset_split("digits", 0.2, 0)
    settings = Settings(algorithm="ampere", rounds=rounds, batch=48, lr=0.1, patience=100,
                        device_epochs=device_epochs)
    execute(fleet(2, rows=60), RunSpec(settings, archive, test, tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["phase"] for r in rows] == phases


def test_resume_after_the_upload_round_equals_the_uninterrupted_run(archive: Path,
                                                                    tmp_path: Path) -> None:
    """`run_training` checkpoints after every round; a coordinator that dies after the
    upload round resumes with the store it left (nobody uploads again) and ends with the
    uninterrupted run's weights, bit for bit. Its temp work folder is gone at the end."""
    from jetsplit.server.run.assembly import RunSpec, execute

    _, test = load_dataset_split("digits", 0.2, 0)
    settings = Settings(algorithm="ampere", rounds=4, batch=48, lr=0.1, device_epochs=1)
    steady, broken = tmp_path / "steady", tmp_path / "broken"
    execute(fleet(2), RunSpec(settings, archive, test, steady))

    def kill(row: dict[str, Any]) -> None:
        if row["round"] == 1:
            raise Killed

    with pytest.raises(Killed):
        execute(fleet(2), RunSpec(settings, archive, test, broken, on_round=[kill]))
    workdir = Path(json.loads((broken / "checkpoint" / "state.json").read_text())
                   ["method"]["ampere"]["workdir"])
    assert (workdir / "store" / "index.json").exists()
    execute(fleet(2), RunSpec(settings, archive, test, broken, resume=True))
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").open()]
            for run in (steady, broken)]
    assert [r["train_loss"] for r in rows[0]] == [r["train_loss"] for r in rows[1]]
    assert "generate" not in rows[1][2]["bytes_by_kind"]["up"]  # no second upload
    for name in ("client", "aux", "server"):
        a, b = (load_file(str(run / f"{name}.safetensors")) for run in (steady, broken))
        assert all(a[k].tobytes() == b[k].tobytes() for k in a), name
    assert not workdir.exists()


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("algorithm", ["ampere", "ampere-noconsolidation"])
def test_simulation_stops_early_then_trains_the_server_block(algorithm: str, tmp_path: Path
                                                             ) -> None:
    settings = Settings(algorithm=algorithm, rounds=10, batch=64, lr=0.2, patience=1,
                        device_epochs=20)
    summary = simulate(settings, model="mobilenetv3-small", split=2, dataset="digits",
                       clients=3, partition_scheme="iid", out_dir=tmp_path / "run")
    got = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    phases = [r["phase"] for r in got]
    device = phases.count(1)
    assert phases == [1] * device + [2] * (10 - device)
    # Early stopping: the last device epoch did not beat the best validation accuracy,
    # before N_d and before the round budget forced phase 2.
    validation = [r["validation_accuracy"] for r in got[:device]]
    assert validation[-1] <= max(validation[:-1]) and device < 9
    assert {"train", "get_weights", "set_weights"} <= set(got[1]["bytes_by_kind"]["down"])
    first = got[device]["bytes_by_kind"]
    assert set(first["up"]) == {"trained_bundle", "trained_bundle_part", "generate"}
    assert first["down"]["trained_bundle"] > 0 and got[device]["bundle_bytes"] == 0
    # Devices get the client block and aux head, as in phase 1; never the server block.
    trained = first["down"]["trained_bundle"] + first["down"]["trained_bundle_part"]
    assert 0.5 * got[0]["bundle_bytes"] < trained < 1.1 * got[0]["bundle_bytes"]
    assert all("generate" not in r["bytes_by_kind"]["up"] for r in got[device + 1:])
    assert all(r["train_loss"] is not None for r in got)
    assert summary["final_accuracy"] > 0.5  # chance is 0.1
    assert (tmp_path / "run" / "aux.safetensors").exists()


def _outcome(method: Ampere) -> dict[str, np.ndarray]:
    """Every weight a run ends with: server block, global client block, each cut's aux."""
    t = method.trainer
    return {**to_arrays(t.server, "server"), **t.global_client, **method._flat(method.aux)}


def test_equal_cuts_are_the_one_cut_ampere_bit_for_bit(archive: Path, tmp_path: Path) -> None:
    """Every device at the bundle's split, named as per-device cuts, runs exactly the
    one-cut code: phase 1, the upload and a server epoch give the same bytes."""
    runs = []
    for name, cuts in (("common", None), ("equal", {"a0": SPLIT, "a1": SPLIT})):
        method = ampere(fleet(2, rows=[120, 80]), archive, tmp_path / name, cuts=cuts,
                        rounds=3)
        losses = [play(method, r) for r in range(3)]
        runs.append((losses, _outcome(method), method.evaluate()["accuracy"]))
    (loss_a, weights_a, acc_a), (loss_b, weights_b, acc_b) = runs
    assert loss_a == loss_b and acc_a == acc_b and None not in loss_a
    assert list(weights_a) == list(weights_b)
    assert [k for k in weights_a if weights_a[k].tobytes() != weights_b[k].tobytes()] == []


def test_cuts_1_and_2_average_each_layer_over_its_holders(archive: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Device a0 trains layer 1 + an aux head for cut 1, a1 layers 1–2 + a head for cut 2.
    Layer 1 is the |D_k|-weighted mean of both, layer 2 is a1's alone, each head is its own
    cut's. In phase 2 a0 uploads cut-1 activations, which the coordinator carries through
    the global layer 2 before storing; a0's trained bundle is cut 1 with its trained head."""
    sizes = {"a0": 150, "a1": 90}
    engine = fleet(2, rows=list(sizes.values()))
    method = ampere(engine, archive, tmp_path / "work", cuts={"a0": 1}, rounds=2)
    t = method.trainer
    seen = record_pulls(monkeypatch, t)
    play(method, 0)  # N_d = 1: phase 1 ends with this epoch's average
    assert method.phase == 2 and set(seen) == {"a0", "a1"}
    layer = {n: n.split("/", 1)[1].split(".", 1)[0] for n in t.global_client}
    first, second = sorted(set(layer.values()), key=list(layer.values()).index)[:2]
    assert {layer[n] for n in seen["a0"] if n.startswith("client/")} == {first}
    checked = 0
    for name, value in t.global_client.items():
        a0, a1 = seen["a0"].get(name), seen["a1"][name]
        if layer[name] == second:
            assert a0 is None and np.array_equal(value, a1)
            continue
        assert a0 is not None
        if value.dtype.kind != "f":
            assert np.array_equal(value, np.maximum(a0, a1))
            continue
        want = (a0.astype(np.float64) * 150 + a1.astype(np.float64) * 90) / 240
        np.testing.assert_allclose(value, want.astype(value.dtype), rtol=0, atol=1e-7)
        if a0.size > 1:
            assert not np.array_equal(a0, a1), name  # the two devices really differ
            checked += 1
    assert checked >= 2
    for agent, cut in (("a0", 1), ("a1", 2)):
        head = {n: v for n, v in seen[agent].items() if n.startswith("aux/")}
        assert head.keys() == method.aux[cut].keys()
        assert all(np.array_equal(head[n], method.aux[cut][n]) for n in head)
    shapes = [{v.shape for v in method.aux[c].values()} for c in (1, 2)]
    assert shapes[0] != shapes[1]  # each head is built for its own cut

    assert play(method, 1) is not None  # uploads (a0's carried to cut 2), a server epoch
    store = method._store()
    assert store.completed() == ["a0", "a1"]
    acts, labels = store.take(np.sort(store.rows_of("a0")))
    client = t.bundle.client_module()
    load_strict(client, from_arrays(t.global_client, "client"), "client")
    data = engine.workers["a0"].data
    with torch.no_grad(), eval_mode(client):
        want = client(torch.from_numpy(data.x)).numpy()
    assert acts.shape == (sizes["a0"], *SHAPE)
    assert np.abs(acts - want).max() <= 1e-4 and np.array_equal(labels, data.y)
    assert method.shipper is not None
    shipped = load_bundle(method.shipper.bundles.get("client", 1, aux=True).root)
    assert shipped.split == 1
    head = to_arrays(shipped.aux_module(), "aux")
    assert all(np.array_equal(head[n], method.aux[1][n]) for n in method.aux[1])


def test_a_bad_ampere_cut_is_one_error_line_naming_the_device(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from jetsplit.cli import main

    argv = ["trial", "--algorithm", "ampere", "--dataset", "digits", "--cut", "a1=99",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: agent a1: cut 99 is out of range") and err.count("\n") == 1
    assert not (tmp_path / "run" / "agents").exists()  # nothing was started


def test_per_cut_heads_survive_a_checkpoint_and_a_damaged_one_is_named(
        archive: Path, tmp_path: Path) -> None:
    """Every cut's aux head (and the best epoch's) round-trips through a checkpoint; a head
    of the wrong shape for its cut is refused in one line naming the cut."""
    from jetsplit.server.training.checkpoints import CheckpointError

    method = ampere(fleet(2, rows=60), archive, tmp_path / "w", cuts={"a0": 1}, rounds=3,
                    device_epochs=2)
    play(method, 0)
    assert method.phase == 1 and set(method.aux) == {1, 2}
    arrays, meta = method.checkpoint()
    assert any(k.startswith("aux-k1/") for k in arrays)
    assert any(k.startswith("best/aux-k1/") for k in arrays)
    restarted = ampere(fleet(2, rows=60), archive, tmp_path / "w2", cuts={"a0": 1}, rounds=3,
                       device_epochs=2)
    restarted.restore(arrays, meta)
    for cut in (1, 2):
        assert all(np.array_equal(restarted.aux[cut][n], v)
                   for n, v in method.aux[cut].items())
    assert restarted.best.keys() == method.best.keys()
    name = next(k for k in arrays if k.startswith("aux-k1/"))
    damaged = {**arrays, name: np.zeros((3, 3), np.float32)}
    with pytest.raises(CheckpointError, match=r"^checkpoint aux head: cut 1: tensor aux/"):
        restarted.restore(damaged, meta)


def test_a_phase_one_switch_moves_the_device_to_its_new_cuts_head_and_back_for_free(
        archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Live re-planning in Ampere's device phase: both devices start at cut 2; after epoch
    0, a0 moves to cut 1, which no device held: it gets a head fresh from cut 1's bundle and
    trains layer 1 with it, and the epoch's cut-2 head and layer 2 are a1's alone. Moved
    back after epoch 1, a0 gets cut 2's head as a1 left it, and no bundle byte is shipped
    (its cache holds cut 2). Every head survives a checkpoint into a run planned without
    cut 1; in phase 2 nothing moves (the store's rows are encoded at each device's cut)."""
    method = ampere(fleet(2, rows=[120, 80]), archive, tmp_path / "w", rounds=4,
                    device_epochs=3)
    t = method.trainer
    fresh_head = to_arrays(load_bundle(t.shipper.bundles.get("client", 1, aux=True).root
                                       ).aux_module(), "aux")
    pushed: dict[str, dict[str, np.ndarray]] = {}
    push = t.push

    def recording_push(agents: list[str], arrays: dict[str, np.ndarray]) -> list[str]:
        pushed.update({a: dict(arrays) for a in agents})
        return push(agents, arrays)

    monkeypatch.setattr(t, "push", recording_push)
    pulled = record_pulls(monkeypatch, t)
    play(method, 0)
    assert set(method.aux) == {2}
    assert method.switch_cuts({"a0": 1, "a1": 2}) == ["a0"]
    assert set(method.aux) == {1, 2} and 1 in t.cut_templates
    assert all(np.array_equal(method.aux[1][n], v) for n, v in fresh_head.items())
    head_2, global_before = dict(method.aux[2]), dict(t.global_client)
    play(method, 1)
    a0_in = {n: v for n, v in pushed["a0"].items() if n.startswith("aux/")}
    assert all(np.array_equal(a0_in[n], v) for n, v in fresh_head.items())
    layer = {n: n.split("/", 1)[1].split(".", 1)[0] for n in t.global_client}
    first = layer[next(iter(t.global_client))]
    assert {layer[n] for n in pushed["a0"] if n.startswith("client/")} == {first}
    for name in pushed["a0"]:
        if name.startswith("client/"):
            assert np.array_equal(pushed["a0"][name], global_before[name])
    for name, value in method.aux[1].items():  # cut 1's head: a0's alone
        assert np.array_equal(value, pulled["a0"][name])
    for name, value in method.aux[2].items():  # cut 2's head: a1's alone
        assert np.array_equal(value, pulled["a1"][name])
    assert not all(np.array_equal(method.aux[2][n], v) for n, v in head_2.items())
    for name, value in t.global_client.items():
        if layer[name] != first:
            assert np.array_equal(value, pulled["a1"][name]), name

    shipped = int(t.engine.counters.by_kind()["down"].get("bundle_part", 0))
    assert method.switch_cuts({"a0": 2}) == ["a0"]
    head_2 = dict(method.aux[2])
    play(method, 2)
    assert int(t.engine.counters.by_kind()["down"].get("bundle_part", 0)) == shipped
    assert all(np.array_equal(pushed["a0"][n], v) for n, v in head_2.items())

    arrays, meta = method.checkpoint()
    restarted = ampere(fleet(2, rows=[120, 80]), archive, tmp_path / "w2", rounds=4,
                       device_epochs=3)
    restarted.restore(arrays, meta)
    assert set(restarted.aux) == {1, 2}
    for cut in (1, 2):
        assert all(np.array_equal(restarted.aux[cut][n], v)
                   for n, v in method.aux[cut].items())
    assert method.phase == 2 and not method.switches_cuts
    assert method.switch_cuts({"a0": 1}) == [] and t.cut("a0") == 2


def test_phase_two_uploads_are_bounded_against_the_coordinators_own_activations(
        archive: Path, tmp_path: Path) -> None:
    """a1 uploads its phase-2 activations × 1000 (`activation-scale`). Uploads arrive one
    device at a time, so the bound's reference is the median per-sample norm the
    coordinator's own copy of the trained client block gives its held-out inputs: a1's
    stored rows end within 5× that norm and a1 is noted; a0's rows are stored bit for bit
    as with the bound off, and with it off a1's rows keep their 1000-fold norms."""
    from jetsplit.edge_agent.attacks import Attack, parse_attack

    def worker(agent: str, data: Any, seed: int) -> AgentWorker:
        attack = Attack(parse_attack("activation-scale:1000"), seed) if agent == "a1" else None
        return AgentWorker(agent, data, seed=seed, attack=attack)

    stored, notes, references = {}, {}, {}
    for bound in (5.0, 0.0):
        method = ampere(fleet(2, worker=worker, rows=[120, 80]),  # type: ignore[arg-type]
                        archive, tmp_path / f"w{bound}", rounds=2, activation_bound=bound)
        play(method, 0)
        play(method, 1)
        store = method._store()
        stored[bound] = {a: store.take(np.sort(store.rows_of(a)))[0] for a in ("a0", "a1")}
        notes[bound] = dict(method.trainer.books.bounded)
        references[bound] = method._reference_norm()
    reference = references[5.0]
    assert reference > 0 and references[0.0] == reference  # the same trained block
    norms = {b: {a: np.linalg.norm(x.reshape(len(x), -1), axis=1) for a, x in rows.items()}
             for b, rows in stored.items()}
    assert np.array_equal(stored[5.0]["a0"], stored[0.0]["a0"])
    assert norms[0.0]["a1"].min() > 100 * reference
    assert norms[5.0]["a1"].max() <= 5 * reference * (1 + 1e-5)
    assert list(notes[5.0]) == ["a1"] and notes[0.0] == {}
