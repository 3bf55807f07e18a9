"""Export tool: cost model, split planner, bundles and ONNX / TensorRT exporters."""
