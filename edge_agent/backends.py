"""What this device can run, reported at registration (and later by `jetsplit doctor`)."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

from jetsplit.runtimes.onnx_runtime import onnxruntime_available
from jetsplit.runtimes.tensorrt_runtime import tensorrt_available


def _installed(*dists: str) -> str | None:
    """The version of the first installed distribution, read from its metadata: knowing a
    runtime is there costs nothing, importing it costs tens of MB the agent keeps."""
    from importlib import metadata

    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def detect_backends(light: bool = False) -> dict[str, Any]:
    """torch (and CUDA), ONNX Runtime (and its providers), TensorRT; absent ones are None.

    `light` (an agent's registration) imports neither ONNX Runtime nor TensorRT: versions
    come from package metadata, providers only once the agent has loaded ONNX Runtime for
    its own work (`jetsplit doctor` does the full check)."""
    if light:
        ort_version = _installed("onnxruntime", "onnxruntime-gpu")
        trt_version = _installed("tensorrt")
    else:
        ort_version, trt_version = onnxruntime_available(), tensorrt_available()
    providers: list[str] = []
    if ort_version is not None and (not light or "onnxruntime" in sys.modules):
        import onnxruntime

        providers = list(onnxruntime.get_available_providers())
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "onnxruntime": ort_version,
        "onnxruntime_providers": providers,
        "tensorrt": trt_version,
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
