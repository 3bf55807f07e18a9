"""Forward-only runtimes for exported blocks: ONNX Runtime everywhere, TensorRT where present.

Training stays in PyTorch; these run activation generation, inference and latency checks.
Both modules import without their backend installed and raise BackendUnavailable on use.
"""

from jetsplit.runtimes.onnx_runtime import OnnxBlock, default_providers, onnxruntime_available
from jetsplit.runtimes.tensorrt_runtime import (
    TensorRTBlock,
    build_engine,
    engine_filename,
    tensorrt_available,
    validate_engine,
)

__all__ = [
    "OnnxBlock",
    "TensorRTBlock",
    "build_engine",
    "default_providers",
    "engine_filename",
    "onnxruntime_available",
    "tensorrt_available",
    "validate_engine",
]
