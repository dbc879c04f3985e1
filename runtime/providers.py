"""The execution providers specedge runs on, by the names its options use (`--providers cpu`),
mapped to ONNX Runtime's provider names. A module of its own so that `doctor` can name them
without importing onnxruntime (which it diagnoses)."""

from __future__ import annotations

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
