"""Forward-only runtimes: ONNX Runtime matches torch; TensorRT fails cleanly where absent."""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from jetsplit.errors import BackendUnavailable, BundleError, ModelError
from jetsplit.runtimes import (
    OnnxBlock,
    TensorRTBlock,
    build_engine,
    default_providers,
    engine_filename,
    tensorrt_available,
    validate_engine,
)
from jetsplit.runtimes.tensorrt_runtime import TRT_MISSING, engine_path_for

CHW = (1, 8, 8)


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 10),
    ).eval()


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    model = _tiny()
    path = tmp_path_factory.mktemp("onnx") / "client.onnx"
    with warnings.catch_warnings():  # the legacy exporter warns; TRT 8.x on JetPack needs it
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            (torch.zeros(1, *CHW),),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        )
    return model, path


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg
    return msg


@pytest.mark.parametrize("batch", [1, 7])
def test_onnx_block_matches_torch(tiny_onnx: tuple[nn.Module, Path], batch: int) -> None:
    model, path = tiny_onnx
    block = OnnxBlock(path)
    x = np.random.default_rng(batch).standard_normal((batch, *CHW), dtype=np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    got = block.run(x)
    assert got.shape == (batch, 10)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert block.input_name == "x"
    assert block.providers[-1] == "CPUExecutionProvider"


def test_run_batched_equals_run(tiny_onnx: tuple[nn.Module, Path]) -> None:
    block = OnnxBlock(tiny_onnx[1])
    x = np.random.default_rng(1).standard_normal((7, *CHW), dtype=np.float32)
    np.testing.assert_allclose(block.run_batched(x, 3), block.run(x), atol=1e-6)
    assert block.latency_ms(x[:2], warmup=1, repeats=2) > 0
    with pytest.raises(ValueError):
        block.run_batched(x, 0)


def test_float64_input_is_cast(tiny_onnx: tuple[nn.Module, Path]) -> None:
    block = OnnxBlock(tiny_onnx[1])
    x = np.ones((2, *CHW))
    assert block.run(x).dtype == np.float32


def test_default_providers_order() -> None:
    names = [p if isinstance(p, str) else p[0] for p in default_providers()]
    order = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert names == [n for n in order if n in names]
    assert "CPUExecutionProvider" in names


def test_onnx_block_errors(tiny_onnx: tuple[nn.Module, Path], tmp_path: Path) -> None:
    block = OnnxBlock(tiny_onnx[1])
    with pytest.raises(ModelError) as info:
        block.run(np.zeros((2, 3, 8, 8), dtype=np.float32))
    assert "dim 1 must be 1" in _one_line(info)
    with pytest.raises(ModelError) as info:
        block.run(np.zeros((8, 8), dtype=np.float32))
    _one_line(info)
    with pytest.raises(BundleError) as info:
        OnnxBlock(tmp_path / "absent.onnx")
    assert "file not found" in _one_line(info)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model\n\x00\x01")
    with pytest.raises(BundleError) as info:
        OnnxBlock(junk)
    assert "cannot load" in _one_line(info)


def test_unavailable_provider_only(tiny_onnx: tuple[nn.Module, Path]) -> None:
    with pytest.raises(BackendUnavailable) as info:
        OnnxBlock(tiny_onnx[1], providers=["NoSuchExecutionProvider"])
    assert "NoSuchExecutionProvider" in _one_line(info)


def test_onnxruntime_missing(
    tiny_onnx: tuple[nn.Module, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(BackendUnavailable) as info:
        OnnxBlock(tiny_onnx[1])
    assert "ONNX Runtime is not installed" in _one_line(info)


# --------------------------------------------------------------------------- TensorRT


def test_engine_filename() -> None:
    assert engine_filename("client", "10.3.0", "Orin (nvgpu)") == "client.10.3.0.orin-nvgpu.engine"
    assert (
        engine_filename("aux", "8.5.2.2", "NVIDIA GeForce RTX 3090")
        == "aux.8.5.2.2.nvidia-geforce-rtx-3090.engine"
    )
    assert engine_filename("client", "", "") == "client.unknown.unknown.engine"
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError):
            engine_filename(bad, "10.0", "gpu")


def test_tensorrt_missing_is_one_line(
    tiny_onnx: tuple[nn.Module, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # absent even where it is installed
    assert tensorrt_available() is None
    path = tiny_onnx[1]
    calls = [
        lambda: build_engine(path, tmp_path / "e.engine", input_shape_chw=CHW),
        lambda: TensorRTBlock(tmp_path / "e.engine"),
        lambda: validate_engine(tmp_path / "e.engine", path, CHW),
        lambda: engine_path_for(path),
    ]
    for call in calls:
        with pytest.raises(BackendUnavailable) as info:
            call()
        assert _one_line(info) == TRT_MISSING


def test_tensorrt_really_absent_here() -> None:
    if tensorrt_available() is not None:
        pytest.skip("TensorRT is installed on this machine")
    with pytest.raises(BackendUnavailable):
        TensorRTBlock("whatever.engine")


# A stand-in for the tensorrt module that records what build_engine asks of it, so the
# 8.x / 10.x branches are exercised on machines without TensorRT.


def _fake_trt(version: str, *, pool_api: bool, parse_ok: bool = True) -> Any:
    rec: dict[str, Any] = {}

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    class Network:
        num_inputs = 1

        def __init__(self, flags: int) -> None:
            rec["flags"] = flags

        def get_input(self, i: int) -> Any:
            return types.SimpleNamespace(name="x", shape=(-1, *CHW))

    class Parser:
        num_errors = 0 if parse_ok else 1

        def __init__(self, network: Network, logger: Logger) -> None:
            pass

        def parse_from_file(self, path: str) -> bool:
            rec["parsed"] = path
            return parse_ok

        def get_error(self, i: int) -> str:
            return "In node 3: unsupported\noperator Foo"

    class Profile:
        def set_shape(self, name: str, lo: tuple, opt: tuple, hi: tuple) -> None:
            rec["profile"] = (name, lo, opt, hi)

    class Config:
        def set_flag(self, flag: str) -> None:
            rec.setdefault("flags_set", []).append(flag)

        def add_optimization_profile(self, profile: Profile) -> None:
            rec["profiles"] = rec.get("profiles", 0) + 1

    class PoolConfig(Config):
        def set_memory_pool_limit(self, pool: str, n: int) -> None:
            rec["workspace"] = (pool, n)

    class LegacyConfig(Config):
        def __setattr__(self, name: str, value: Any) -> None:
            rec["workspace"] = (name, value)

    class Builder:
        platform_has_fast_fp16 = True

        def __init__(self, logger: Logger) -> None:
            pass

        def create_network(self, flags: int) -> Network:
            return Network(flags)

        def create_builder_config(self) -> Config:
            return PoolConfig() if pool_api else LegacyConfig()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config) -> bytes:
            return b"ENGINE"

    mod = types.ModuleType("tensorrt")
    mod.__dict__.update(
        __version__=version,
        Logger=Logger,
        Builder=Builder,
        OnnxParser=Parser,
        NetworkDefinitionCreationFlag=types.SimpleNamespace(EXPLICIT_BATCH=0),
        MemoryPoolType=types.SimpleNamespace(WORKSPACE="workspace"),
        BuilderFlag=types.SimpleNamespace(FP16="fp16"),
        rec=rec,
    )
    return mod


@pytest.mark.parametrize(
    ("version", "pool_api", "flags", "workspace"),
    [
        ("10.3.0", True, 0, ("workspace", 256 << 20)),
        ("8.6.2", True, 1, ("workspace", 256 << 20)),
        ("8.2.1", False, 1, ("max_workspace_size", 256 << 20)),
    ],
)
def test_build_engine_api_branches(
    tiny_onnx: tuple[nn.Module, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    version: str,
    pool_api: bool,
    flags: int,
    workspace: tuple[str, int],
) -> None:
    fake = _fake_trt(version, pool_api=pool_api)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = build_engine(
        tiny_onnx[1],
        tmp_path / "cache" / "client.engine",
        input_shape_chw=CHW,
        max_batch=16,
        opt_batch=32,
        fp16=True,
        workspace_mb=256,
    )
    assert out.read_bytes() == b"ENGINE"
    rec = fake.rec
    assert rec["flags"] == flags
    assert rec["workspace"] == workspace
    assert rec["flags_set"] == ["fp16"]
    assert rec["profiles"] == 1
    assert rec["profile"] == ("x", (1, *CHW), (16, *CHW), (16, *CHW))  # opt clamped to max


def test_build_engine_user_errors(
    tiny_onnx: tuple[nn.Module, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt("10.0.1", pool_api=True))
    with pytest.raises(ModelError) as info:
        build_engine(tiny_onnx[1], tmp_path / "e.engine", input_shape_chw=(3, 8, 8))
    assert "dim 1 is 1" in _one_line(info)
    with pytest.raises(BundleError) as info:
        build_engine(tmp_path / "absent.onnx", tmp_path / "e.engine", input_shape_chw=CHW)
    _one_line(info)
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt("8.2.1", pool_api=False, parse_ok=False))
    with pytest.raises(ModelError) as info:
        build_engine(tiny_onnx[1], tmp_path / "e.engine", input_shape_chw=CHW)
    assert "cannot parse" in _one_line(info)
    assert not (tmp_path / "e.engine").exists()


def test_cuda_missing_is_one_line(
    tiny_onnx: tuple[nn.Module, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt("10.3.0", pool_api=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable) as info:
        build_engine(tiny_onnx[1], tmp_path / "e.engine", input_shape_chw=CHW)
    assert "CUDA" in _one_line(info)
