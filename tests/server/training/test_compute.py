"""Where the coordinator computes: device choice (auto/cpu/cuda) through the same code on
CPU as on a GPU, one transfer per step for activations and gradients, autocast on the server
block, and runs that do not depend on this process's torch thread count."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jetsplit.cli import main
from jetsplit.data import load_dataset_split, partition
from jetsplit.devices import resolve_device, torch_threads
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.errors import BackendUnavailable, ConfigError
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.run.assembly import RunSpec, execute
from jetsplit.server.run.config import load_server_config
from jetsplit.server.training.placement import to_device, to_host
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, 2, tmp_path_factory.mktemp("b") / "bundle", seed=3, tar=True)
    assert report.tar_path is not None
    return report.tar_path


Runs = Callable[..., dict[str, np.ndarray]]


@pytest.fixture(scope="module")
def runs(archive: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """`runs(process_threads, autocast)`: one round of PSL with 3 in-process agents at 1
    torch thread and the coordinator at 1, this process at `process_threads`; the final
    server and client weights (each distinct run computed once)."""
    done: dict[tuple[int, str], dict[str, np.ndarray]] = {}

    def run(process_threads: int, autocast: str = "off") -> dict[str, np.ndarray]:
        key = (process_threads, autocast)
        if key not in done:
            out = tmp_path_factory.mktemp(f"run-{process_threads}-{autocast}")
            before = torch.get_num_threads()
            torch.set_num_threads(process_threads)
            try:
                done[key] = _train(archive, out, autocast)
                assert torch.get_num_threads() == process_threads  # put back after the run
            finally:
                torch.set_num_threads(before)
        return done[key]

    return run


def _train(archive: Path, out: Path, autocast: str) -> dict[str, np.ndarray]:
    train, test = load_dataset_split("digits", 0.2, 0)
    shards = partition(train.y, 3, "iid", 0, train.num_classes)
    workers = {f"a{i}": AgentWorker(f"a{i}", train.subset(s), seed=i, threads=1)
               for i, s in enumerate(shards)}
    settings = Settings(algorithm="psl", rounds=1, local_steps=3, batch=24, lr=0.05,
                        device="cpu", autocast=autocast, threads=1)
    execute(InProcessEngine(workers), RunSpec(settings, archive, test, out, checkpoint=False))
    weights = dict(load_file(str(out / "server.safetensors")))
    for path in sorted((out / "clients").iterdir()):
        weights.update({f"{path.stem}:{k}": v for k, v in load_file(str(path)).items()})
    return weights


@pytest.mark.parametrize("cuda", [False, True], ids=["no-cuda", "cuda"])
def test_device_choices_resolve_by_what_torch_sees(cuda: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" follows torch.cuda.is_available (patched both ways, so both branches run on
    any machine), "cpu" never does, and "cuda" without CUDA is one line naming the option."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device("auto", "--device") == ("cuda" if cuda else "cpu")
    assert resolve_device("cpu", "--device") == "cpu"
    if cuda:
        assert resolve_device("cuda", "server.device") == "cuda"
    else:
        with pytest.raises(BackendUnavailable) as caught:
            resolve_device("cuda", "server.device")
        message = str(caught.value)
        assert message.startswith("server.device = cuda, but torch sees no CUDA device")
        assert message.endswith("use cpu or auto)") and "\n" not in message
    for bad in ("tpu", "CUDA", "", "cuda:0"):
        with pytest.raises(ConfigError, match=r"^--device must be auto, cpu or cuda, got "):
            resolve_device(bad, "--device")


@NO_CUDA
def test_cuda_without_cuda_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        resolve_device("cuda", "--device")
    assert main(["simulate", "--device", "cuda", "--dataset", "digits",
                 "--out", str(tmp_path / "sim")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device = cuda") and err.count("\n") == 1
    assert not (tmp_path / "sim").exists()  # refused before any work
    config = tmp_path / "server.toml"
    config.write_text('[server]\ndevice = "cuda"\n')
    for argv in (["server", "run", "--config", str(config)],
                 ["server", "run", "--config", str(config.with_name("cpu.toml")),
                  "--device", "cuda"],
                 ["trial", "--device", "cuda", "--agents", "1", "--dataset", "digits",
                  "--out", str(tmp_path / "trial")]):
        config.with_name("cpu.toml").write_text('[server]\ndevice = "cpu"\n')
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "no CUDA device" in err, err
        assert err.count("\n") == 1


def test_server_section_is_validated(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    path = tmp_path / "server.toml"
    path.write_text('[server]\ndevice = "cpu"\nautocast = "bf16"\nthreads = 2\n')
    settings = load_server_config(path).settings()
    assert (settings.device, settings.autocast, settings.threads) == ("cpu", "bf16", 2)
    for bad, field in (('device = "gpu"', "server.device"), ('autocast = "fp8"',
                                                            "server.autocast"),
                       ("threads = -1", "server.threads"), ("speed = 3", "server.speed")):
        path.write_text(f"[server]\n{bad}\n")
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_server_config(path)
    assert main(["simulate", "--autocast", "fp8", "--dataset", "digits"]) == 2
    assert "autocast" in capsys.readouterr().err


def test_one_transfer_each_way_keeps_every_value() -> None:
    """Arrays of different shapes and lengths cross as views of one buffer and come back
    as the same float32 values."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((n, 3, 2, 2)).astype(np.float32) for n in (5, 1, 7)]
    arrays.append(rng.standard_normal((2, 6)).astype(np.float32))
    device = torch.device(resolve_device("auto", "device"))
    parts = to_device(arrays, np.float32, device)
    assert [tuple(p.shape) for p in parts] == [a.shape for a in arrays]
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1  # one buffer
    assert all(p.device.type == device.type for p in parts)
    back = to_host([p * 2 for p in parts])
    for got, want in zip(back, arrays, strict=True):
        assert got.dtype == np.float32 and np.array_equal(got, want * 2)
    labels = to_device([np.array([1, 2], np.int32), np.array([3], np.int64)], np.int64, device)
    assert [t.dtype for t in labels] == [torch.int64] * 2 and labels[1].tolist() == [3]
    assert to_device([], np.float32, device) == [] and to_host([]) == []


def test_a_step_reads_its_loss_with_its_gradients(archive: Path) -> None:
    """Trainer.read_step: a float32 loss tensor and every agent's gradient come back
    together, in agent order with their shapes; a float loss passes through as it is."""
    _, test = load_dataset_split("digits", 0.2, 0)
    trainer = Trainer(InProcessEngine({}), archive, Settings(device="cpu"), test)
    grads = {"a1": torch.full((2, 3), 0.25), "a0": torch.arange(4.0).reshape(4, 1)}
    loss, host = trainer.read_step(torch.tensor(1.75), grads)
    assert loss == 1.75 and list(host) == ["a1", "a0"]
    assert host["a1"].shape == (2, 3) and float(host["a1"].sum()) == 1.5
    assert host["a0"].ravel().tolist() == [0.0, 1.0, 2.0, 3.0]
    loss, host = trainer.read_step(0.5, {"a2": torch.ones(1, 2, dtype=torch.float64)})
    assert loss == 0.5 and host["a2"].dtype == np.float32 and host["a2"].tolist() == [[1, 1]]
    bf16 = torch.tensor(3.0, dtype=torch.bfloat16)  # not float32: read on its own
    assert trainer.read_step(bf16, {})[0] == 3.0


def test_auto_places_the_server_block_where_torch_sees_a_device(
        archive: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, test = load_dataset_split("digits", 0.2, 0)
    want = "cuda" if torch.cuda.is_available() else "cpu"  # this machine, said independently
    trainer = Trainer(InProcessEngine({}), archive, Settings(device="auto"), test)
    assert trainer.device.type == want
    assert {p.device.type for p in trainer.server.parameters()} == {want}
    # a GPU machine whose torch cannot see CUDA puts it on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    trainer = Trainer(InProcessEngine({}), archive, Settings(device="auto"), test)
    assert trainer.device.type == "cpu"
    assert {p.device.type for p in trainer.server.parameters()} == {"cpu"}


def test_runs_do_not_depend_on_this_process_thread_count(runs: Runs) -> None:
    """Agents at 1 thread and the coordinator at 1 thread give the same bits whether this
    process runs torch with 1 thread or 3 (what an MQTT agent process and a 16-core
    simulation differ in)."""
    one, three = runs(1), runs(3)
    assert set(one) == set(three) and len(one) > 50
    assert [k for k in one if one[k].tobytes() != three[k].tobytes()] == []


def test_bf16_autocast_trains_the_server_block_in_bf16(runs: Runs) -> None:
    """Autocast changes the server block's arithmetic (different bits, weights stay fp32)
    and stays close to the fp32 run."""
    full, mixed = runs(1), runs(1, "bf16")
    assert all(v.dtype == full[k].dtype for k, v in mixed.items())
    server = [k for k in full if k.startswith("server/") and full[k].dtype == np.float32
              and "running_" not in k]  # trained parameters, not batch-norm statistics
    assert server and any(full[k].tobytes() != mixed[k].tobytes() for k in server)
    a, b = (np.concatenate([w[k].ravel() for k in server]) for w in (full, mixed))
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.02  # 0.004 measured


def test_torch_threads_restores_the_count() -> None:
    before = torch.get_num_threads()
    with torch_threads(before + 2):
        assert torch.get_num_threads() == before + 2
    assert torch.get_num_threads() == before
    with torch_threads(0):
        assert torch.get_num_threads() == before


def test_bench_server_runs_here_and_says_when_there_is_no_cuda(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_server.py on a tiny workload: the coordinator's own step (a real
    trainer and SCALA over a replay engine) against the plain step, a CPU timing, and on a
    machine without CUDA one "no CUDA" line (on a GPU machine: a ratio)."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_server.py"
    module = runpy.run_path(str(path))  # defines main() without running it
    monkeypatch.setattr(sys, "argv", [str(path), "--model", "mobilenetv3-small", "--clients",
                                      "3", "--samples", "4", "--repeats", "1", "--warmup", "0",
                                      "--threads", "1"])
    module["main"]()
    lines = capsys.readouterr().out.splitlines()
    cpu = [line for line in lines if line.startswith("cpu (1 threads): coordinator step")]
    assert len(cpu) == 1
    ratio = float(cpu[0].split("coordinator / plain ")[1].rstrip("x"))
    assert ratio > 0
    if torch.cuda.is_available():
        assert any(line.startswith("ratio cpu / cuda, coordinator step:") for line in lines)
    else:
        assert sum(line.startswith("no CUDA: ") for line in lines) == 1


def test_the_replay_engine_answers_forwards_with_its_activations() -> None:
    """The bench's engine: a forward gets the agent's own activations and labels, other
    kinds an empty reply, and every agent is registered with its label histogram."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_server.py"
    module = runpy.run_path(str(path))
    from jetsplit.server.engines.seam import Command

    acts = {"a": np.ones((2, 3), np.float32), "b": np.zeros((3, 3), np.float32)}
    labels = {"a": np.array([1, 1]), "b": np.array([0, 2, 2])}
    engine = module["ReplayEngine"](acts, labels)
    out = engine.send_and_receive({"a": Command("forward"), "b": Command("forward")})
    assert out.agents == ["a", "b"]
    assert out["b"].tensors["activations"] is acts["b"]
    assert out["b"].tensors["labels"] is labels["b"]
    assert engine.registry.registration("b")["dataset"]["label_histogram"][:3] == [1, 0, 2]
    assert engine.send_and_receive({"a": Command("backward")})["a"].tensors == {}
