"""ONNX Runtime session for a block's forward-only work (activations, inference, latency).

Providers are tried fastest first — TensorRT EP, CUDA EP, CPU — and only those this
onnxruntime build reports as available are requested, so one code path serves a Jetson
(NVIDIA's onnxruntime-gpu wheel) and an x86 CPU box alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Dict, Tuple, Union

import numpy as np

from jetsplit.errors import BackendUnavailable, BundleError, ModelError

ProviderSpec = Union[str, Tuple[str, Dict[str, Any]]]

TRT_EP = "TensorrtExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"

ORT_MISSING = (
    "ONNX Runtime is not installed (pip install 'jetsplit[agent]'; on Jetson use NVIDIA's "
    "onnxruntime-gpu wheel)"
)
_ORT_DTYPES: dict[str, type[np.generic]] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def _import_ort() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise BackendUnavailable(ORT_MISSING) from None
    return onnxruntime


def onnxruntime_available() -> str | None:
    """Installed onnxruntime version, or None."""
    try:
        import onnxruntime
    except ImportError:
        return None
    return str(onnxruntime.__version__)


def default_providers(
    *, fp16: bool = False, engine_cache_dir: str | Path | None = None
) -> list[ProviderSpec]:
    """TensorRT EP, CUDA EP, CPU — filtered to what this onnxruntime build offers."""
    ort = _import_ort()
    available = set(ort.get_available_providers())
    trt_options: dict[str, Any] = {"trt_fp16_enable": fp16}
    if engine_cache_dir is not None:
        Path(engine_cache_dir).mkdir(parents=True, exist_ok=True)
        trt_options["trt_engine_cache_enable"] = True
        trt_options["trt_engine_cache_path"] = str(engine_cache_dir)
    wanted: list[ProviderSpec] = [(TRT_EP, trt_options), CUDA_EP, CPU_EP]
    return [p for p in wanted if _provider_name(p) in available]


def _provider_name(spec: ProviderSpec) -> str:
    return spec if isinstance(spec, str) else spec[0]


class OnnxBlock:
    """One exported block (``client.onnx``, ``aux.onnx``) as a forward-only callable."""

    def __init__(
        self,
        path: str | Path,
        providers: Sequence[ProviderSpec] | None = None,
        *,
        fp16: bool = False,
        engine_cache_dir: str | Path | None = None,
        intra_op_threads: int | None = None,
    ) -> None:
        ort = _import_ort()
        self.path = Path(path)
        if not self.path.is_file():
            raise BundleError(f"onnx model {self.path}: file not found")
        if providers is None:
            chosen = default_providers(fp16=fp16, engine_cache_dir=engine_cache_dir)
        else:
            available = set(ort.get_available_providers())
            chosen = [p for p in providers if _provider_name(p) in available]
            if not chosen:
                wanted = ", ".join(_provider_name(p) for p in providers)
                raise BackendUnavailable(
                    f"none of the requested ONNX Runtime providers ({wanted}) is available here "
                    f"(available: {', '.join(sorted(available))})"
                )
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: provider fallbacks are expected
        if intra_op_threads is not None:
            options.intra_op_num_threads = intra_op_threads
        try:
            self.session = ort.InferenceSession(
                str(self.path), sess_options=options, providers=list(chosen)
            )
        except Exception as exc:  # ORT raises its own Fail/InvalidProtobuf/... types
            first = " ".join(str(exc).split())[:200]
            raise BundleError(f"onnx model {self.path}: cannot load: {first}") from None
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise ModelError(f"onnx model {self.path}: expected 1 input, found {len(inputs)}")
        self.input_name: str = inputs[0].name
        self.input_shape: tuple[int | str | None, ...] = tuple(inputs[0].shape)
        self.input_dtype = np.dtype(_ORT_DTYPES.get(inputs[0].type, np.float32))
        self.output_names: list[str] = [o.name for o in self.session.get_outputs()]

    @property
    def providers(self) -> list[str]:
        """Providers the session actually uses, fastest first."""
        return list(self.session.get_providers())

    def _check(self, x: np.ndarray) -> np.ndarray:
        if x.ndim != len(self.input_shape):
            raise ModelError(
                f"onnx model {self.path}: input {self.input_name} expects "
                f"{len(self.input_shape)}-D {list(self.input_shape)}, got shape {list(x.shape)}"
            )
        for axis, (want, got) in enumerate(zip(self.input_shape, x.shape)):
            if isinstance(want, int) and want != got:
                raise ModelError(
                    f"onnx model {self.path}: input {self.input_name} dim {axis} must be "
                    f"{want}, got shape {list(x.shape)}"
                )
        return np.ascontiguousarray(x, dtype=self.input_dtype)

    def run(self, x: np.ndarray) -> np.ndarray:
        """Forward one batch; returns the first output."""
        (out,) = self.session.run(self.output_names[:1], {self.input_name: self._check(x)})
        return np.asarray(out)

    def run_batched(self, x: np.ndarray, batch_size: int) -> np.ndarray:
        """Forward a whole array in chunks of ``batch_size`` to bound memory."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(x) == 0:
            raise ModelError(f"onnx model {self.path}: empty input")
        chunks = [self.run(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]
        return np.concatenate(chunks)

    def latency_ms(self, x: np.ndarray, *, warmup: int = 2, repeats: int = 10) -> float:
        """Median wall time of one forward of ``x`` in milliseconds."""
        x = self._check(x)
        feed = {self.input_name: x}
        for _ in range(warmup):
            self.session.run(self.output_names[:1], feed)
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            self.session.run(self.output_names[:1], feed)
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.run(x)

    def __repr__(self) -> str:
        return f"OnnxBlock({str(self.path)!r}, providers={self.providers})"
