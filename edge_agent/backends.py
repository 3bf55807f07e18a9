"""What this device can run, reported at registration (and later by `jetsplit doctor`)."""

from __future__ import annotations

import platform
from typing import Any

import torch

from jetsplit.runtimes.onnx_runtime import onnxruntime_available
from jetsplit.runtimes.tensorrt_runtime import tensorrt_available


def detect_backends() -> dict[str, Any]:
    """torch (and CUDA), ONNX Runtime (and its providers), TensorRT; absent ones are None."""
    ort_version = onnxruntime_available()
    providers: list[str] = []
    if ort_version is not None:
        import onnxruntime

        providers = list(onnxruntime.get_available_providers())
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "onnxruntime": ort_version,
        "onnxruntime_providers": providers,
        "tensorrt": tensorrt_available(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
