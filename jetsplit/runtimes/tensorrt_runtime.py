"""Build, cache and run TensorRT engines for a block's forward-only work, on TRT 8.x and 10.x.

TensorRT ships with JetPack and cannot be pip-installed from PyPI alone, so ``tensorrt`` and
CUDA are imported inside functions: this module imports anywhere, and every entry point
raises BackendUnavailable in one line where they are absent. Device buffers are torch CUDA
tensors and the stream a torch CUDA stream, so no pycuda is needed.

API differences handled here (JetPack 4 → 8.2, 5 → 8.5, 6.0 → 8.6, 6.1+ → 10.x):
- network creation needs the EXPLICIT_BATCH flag before 10 (deprecated and implied in 10);
- workspace is ``set_memory_pool_limit`` from 8.4, ``max_workspace_size`` before;
- execution is name-based (``set_input_shape``/``set_tensor_address``/``execute_async_v3``,
  8.5+ and the only way in 10, detected by ``not hasattr(engine, "num_bindings")``),
  else binding-index based (``set_binding_shape`` + ``execute_async_v2``, 8.2).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jetsplit.errors import BackendUnavailable, BundleError, JetsplitError, ModelError

log = logging.getLogger(__name__)

TRT_MISSING = (
    "TensorRT is not installed on this machine (it ships with JetPack on Jetson); "
    "ONNX Runtime remains available"
)
CUDA_MISSING = (
    "CUDA is not available to PyTorch on this machine (TensorRT engines need an NVIDIA GPU); "
    "ONNX Runtime remains available"
)


# --------------------------------------------------------------------------- availability


def tensorrt_available() -> str | None:
    """Installed TensorRT version, or None (also None when its libraries fail to load)."""
    try:
        import tensorrt as trt
    except (ImportError, OSError):
        return None
    return str(getattr(trt, "__version__", "unknown"))


def _import_trt() -> Any:
    try:
        import tensorrt as trt
    except (ImportError, OSError):
        raise BackendUnavailable(TRT_MISSING) from None
    return trt


def _require_cuda() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable(CUDA_MISSING)
    return torch


def _trt_major(trt: Any) -> int:
    match = re.match(r"(\d+)", str(getattr(trt, "__version__", "0")))
    return int(match.group(1)) if match else 0


# --------------------------------------------------------------------------- engine cache names


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def engine_filename(block: str, trt_version: str, gpu_name: str) -> str:
    """``<block>.<trt-version>.<gpu-slug>.engine``: engines only run where they were built."""
    if not block or "/" in block or "\\" in block or block.startswith("."):
        raise ValueError(f"block name must be a plain file stem, got {block!r}")
    version = re.sub(r"[^0-9A-Za-z.]+", "-", trt_version).strip("-.") or "unknown"
    return f"{block}.{version}.{_slug(gpu_name)}.engine"


def engine_path_for(onnx_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where this machine caches the engine of ``onnx_path`` (next to it by default)."""
    trt = _import_trt()
    torch = _require_cuda()
    onnx_path = Path(onnx_path)
    name = engine_filename(onnx_path.stem, trt.__version__, torch.cuda.get_device_name())
    return Path(cache_dir or onnx_path.parent) / name


# --------------------------------------------------------------------------- building


def _check_shape(input_shape_chw: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in input_shape_chw)
    if not shape or any(d < 1 for d in shape):
        raise ModelError(f"input shape must be positive dims (C, H, W), got {list(shape)}")
    return shape


def _parse_onnx(trt: Any, network: Any, logger: Any, onnx_path: Path) -> None:
    parser = trt.OnnxParser(network, logger)
    if hasattr(parser, "parse_from_file"):  # resolves external-data files next to the model
        ok = parser.parse_from_file(str(onnx_path))
    else:
        ok = parser.parse(onnx_path.read_bytes())
    if not ok:
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        first = " ".join((errors[0] if errors else "unknown parser error").split())[:200]
        raise ModelError(
            f"onnx model {onnx_path}: TensorRT {trt.__version__} cannot parse it: {first} "
            "(check the opset: <=13 for TRT 8.2, <=17 for 8.5/8.6)"
        )


def _set_workspace(trt: Any, config: Any, workspace_mb: int) -> None:
    nbytes = int(workspace_mb) << 20
    if hasattr(config, "set_memory_pool_limit"):  # TRT >= 8.4
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, nbytes)
    else:  # TRT 8.2 (JetPack 4)
        config.max_workspace_size = nbytes


def _add_batch_profile(
    builder: Any,
    network: Any,
    config: Any,
    onnx_path: Path,
    chw: tuple[int, ...],
    batches: tuple[int, int, int],
) -> None:
    """One optimization profile spanning min/opt/max batch for the single input."""
    if network.num_inputs != 1:
        raise ModelError(f"onnx model {onnx_path}: expected 1 input, found {network.num_inputs}")
    tensor = network.get_input(0)
    dims = tuple(int(d) for d in tensor.shape)
    if len(dims) != len(chw) + 1:
        raise ModelError(
            f"onnx model {onnx_path}: input {tensor.name} is {list(dims)}, "
            f"which does not fit batch x {list(chw)}"
        )
    for axis, (want, got) in enumerate(zip(dims[1:], chw), start=1):
        if want not in (-1, got):
            raise ModelError(
                f"onnx model {onnx_path}: input {tensor.name} dim {axis} is {want}, "
                f"but input shape says {got}"
            )
    if dims[0] != -1:  # exported without a dynamic batch axis: one fixed batch only
        batches = (dims[0], dims[0], dims[0])
    profile = builder.create_optimization_profile()
    lo, opt, hi = ((b, *chw) for b in batches)
    profile.set_shape(tensor.name, lo, opt, hi)
    config.add_optimization_profile(profile)


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path,
    *,
    input_shape_chw: Sequence[int],
    max_batch: int = 64,
    opt_batch: int = 32,
    min_batch: int = 1,
    fp16: bool = False,
    workspace_mb: int = 1024,
) -> Path:
    """Build a dynamic-batch engine from an ONNX block and write it atomically.

    Build on the device that will run it: engines are tied to the TensorRT version and GPU.
    """
    trt = _import_trt()
    _require_cuda()
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    if not onnx_path.is_file():
        raise BundleError(f"onnx model {onnx_path}: file not found")
    chw = _check_shape(input_shape_chw)
    if not 1 <= min_batch <= max_batch:
        raise ModelError(f"batch range must satisfy 1 <= min <= max, got {min_batch}..{max_batch}")
    opt_batch = min(max(opt_batch, min_batch), max_batch)

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if _trt_major(trt) < 10:  # implicit-batch networks cannot take ONNX models
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    _parse_onnx(trt, network, logger, onnx_path)

    config = builder.create_builder_config()
    _set_workspace(trt, config, workspace_mb)
    if fp16:
        if not getattr(builder, "platform_has_fast_fp16", True):
            log.warning("this GPU has no fast FP16 path; building FP16 anyway")
        config.set_flag(trt.BuilderFlag.FP16)
    _add_batch_profile(builder, network, config, onnx_path, chw, (min_batch, opt_batch, max_batch))

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise JetsplitError(
            f"onnx model {onnx_path}: TensorRT {trt.__version__} failed to build an engine "
            "(see the TensorRT log above; try a larger workspace_mb)"
        )
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = engine_path.with_name(f".{engine_path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(memoryview(serialized))
    os.replace(tmp, engine_path)
    return engine_path


# --------------------------------------------------------------------------- running


class TensorRTBlock:
    """A deserialized engine as a forward-only callable on numpy arrays (first output)."""

    def __init__(self, engine_path: str | Path, *, device: int = 0) -> None:
        trt = _import_trt()
        torch = _require_cuda()
        self._trt, self._torch = trt, torch
        self.path = Path(engine_path)
        if not self.path.is_file():
            raise BundleError(f"engine {self.path}: file not found (build it with build_engine)")
        self.device = torch.device("cuda", device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise BundleError(
                f"engine {self.path}: TensorRT {trt.__version__} cannot load it "
                "(built by another TensorRT version or GPU?); rebuild it on this device"
            )
        self.context = self.engine.create_execution_context()
        self.is_trt10 = not hasattr(self.engine, "num_bindings")
        self._named = self.is_trt10 or hasattr(self.context, "execute_async_v3")
        self._stream = torch.cuda.Stream(device=self.device)
        self._io = self._describe_io()
        inputs = [n for n, (is_in, _, _) in self._io.items() if is_in]
        outputs = [n for n, (is_in, _, _) in self._io.items() if not is_in]
        if len(inputs) != 1 or not outputs:
            raise ModelError(
                f"engine {self.path}: expected 1 input and >=1 output, "
                f"found {len(inputs)} and {len(outputs)}"
            )
        self.input_name, self.output_names = inputs[0], outputs
        self.max_batch = self._max_batch()

    def _describe_io(self) -> dict[str, tuple[bool, np.dtype, int]]:
        """name -> (is_input, numpy dtype, binding index) in engine order."""
        trt, eng = self._trt, self.engine
        io: dict[str, tuple[bool, np.dtype, int]] = {}
        if self._named:
            for i in range(eng.num_io_tensors):
                name = eng.get_tensor_name(i)
                is_in = eng.get_tensor_mode(name) == trt.TensorIOMode.INPUT
                io[name] = (is_in, np.dtype(trt.nptype(eng.get_tensor_dtype(name))), i)
        else:
            for i in range(eng.num_bindings):
                name = eng.get_binding_name(i)
                dtype = np.dtype(trt.nptype(eng.get_binding_dtype(i)))
                io[name] = (bool(eng.binding_is_input(i)), dtype, i)
        return io

    def _max_batch(self) -> int:
        """Largest batch the engine's first optimization profile accepts."""
        eng, name = self.engine, self.input_name
        if self._named and hasattr(eng, "get_tensor_profile_shape"):
            shapes = eng.get_tensor_profile_shape(name, 0)
        else:
            shapes = eng.get_profile_shape(0, self._io[name][2])
        return int(tuple(shapes[2])[0])

    def _to_torch_dtype(self, dtype: np.dtype) -> Any:
        return self._torch.from_numpy(np.empty(0, dtype=dtype)).dtype

    def _run_chunk(self, x: np.ndarray) -> np.ndarray:
        torch, ctx = self._torch, self.context
        in_dtype = self._io[self.input_name][1]
        x_dev = torch.from_numpy(np.ascontiguousarray(x, dtype=in_dtype)).to(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # input copy done first
        outputs: dict[str, Any] = {}
        if self._named:
            ctx.set_input_shape(self.input_name, tuple(x_dev.shape))
            ctx.set_tensor_address(self.input_name, x_dev.data_ptr())
            for name in self.output_names:
                shape = tuple(ctx.get_tensor_shape(name))
                out = torch.empty(
                    shape, dtype=self._to_torch_dtype(self._io[name][1]), device=self.device
                )
                ctx.set_tensor_address(name, out.data_ptr())
                outputs[name] = out
            ok = ctx.execute_async_v3(stream.cuda_stream)
        else:
            ptrs = [0] * len(self._io)
            ctx.set_binding_shape(self._io[self.input_name][2], tuple(x_dev.shape))
            ptrs[self._io[self.input_name][2]] = x_dev.data_ptr()
            for name in self.output_names:
                index = self._io[name][2]
                shape = tuple(ctx.get_binding_shape(index))
                out = torch.empty(
                    shape, dtype=self._to_torch_dtype(self._io[name][1]), device=self.device
                )
                ptrs[index] = out.data_ptr()
                outputs[name] = out
            ok = ctx.execute_async_v2(bindings=ptrs, stream_handle=stream.cuda_stream)
        stream.synchronize()
        if not ok:
            raise JetsplitError(f"engine {self.path}: TensorRT execution failed (see its log)")
        return outputs[self.output_names[0]].cpu().numpy()

    def run(self, x: np.ndarray) -> np.ndarray:
        """Forward ``x`` (batch first); batches above the engine's max run in chunks."""
        if x.ndim < 1 or len(x) == 0:
            raise ModelError(f"engine {self.path}: empty input")
        chunks = [
            self._run_chunk(x[i : i + self.max_batch]) for i in range(0, len(x), self.max_batch)
        ]
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.run(x)


# --------------------------------------------------------------------------- validation


def validate_engine(
    engine_path: str | Path,
    onnx_path: str | Path,
    input_shape_chw: Sequence[int],
    batches: Sequence[int] = (1, 32),
    atol: float = 1e-3,
    rtol: float = 1e-2,
    seed: int = 0,
) -> float:
    """Max |Δ| between the engine and ONNX Runtime (CPU) on random inputs.

    FP16 (and TF32) engines can silently diverge, so an engine is used only after this
    passes: it raises JetsplitError when |Δ| > atol + rtol·max|reference| or is not finite.
    """
    from jetsplit.runtimes.onnx_runtime import CPU_EP, OnnxBlock

    chw = _check_shape(input_shape_chw)
    block = TensorRTBlock(engine_path)
    reference = OnnxBlock(onnx_path, providers=[CPU_EP])
    rng = np.random.default_rng(seed)
    worst = 0.0
    for batch in batches:
        x = rng.standard_normal((int(batch), *chw), dtype=np.float32)
        want = reference.run(x).astype(np.float64)
        got = block.run(x).astype(np.float64)
        if got.shape != want.shape:
            raise JetsplitError(
                f"engine {engine_path}: output shape {list(got.shape)} differs from ONNX "
                f"Runtime's {list(want.shape)} at batch {batch}"
            )
        delta = float(np.max(np.abs(got - want))) if want.size else 0.0
        tol = atol + rtol * (float(np.max(np.abs(want))) if want.size else 0.0)
        if not np.isfinite(delta) or delta > tol:
            raise JetsplitError(
                f"engine {engine_path}: output differs from ONNX Runtime by {delta:.3g} at "
                f"batch {batch} (tolerance {tol:.3g}); rebuild without fp16 or do not use it"
            )
        worst = max(worst, delta)
    return worst
