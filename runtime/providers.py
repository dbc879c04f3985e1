"""The execution providers specedge runs on, by the names its options use (`--providers cpu`),
mapped to ONNX Runtime's provider names, and the oldest onnxruntime that runs what specedge
exports. A module of its own so that `doctor` can name them without importing onnxruntime
(which it diagnoses)."""

from __future__ import annotations

import re

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}

# ONNX Runtime GenAI 0.18's builder writes GroupQueryAttention inputs, GatherBlockQuantized's
# `bits` and 8-bit MatMulNBits that 1.22 refuses to load; 1.23 also makes the shared thread pool.
MIN_ONNXRUNTIME = (1, 23)


def onnxruntime_too_old(version: str) -> str | None:
    """One line saying that onnxruntime `version` ("1.22.1", "1.20.0+cu126") is older than
    `MIN_ONNXRUNTIME` and how to upgrade it; None when it is not (or the version is unreadable).

    pip keeps `onnxruntime>=1.23` for the CPU package, but a GPU build installed apart (the
    Jetson wheels, `onnxruntime-gpu`) is another package, so an old one goes unnoticed until a
    model fails to load."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= MIN_ONNXRUNTIME:
        return None
    least = ".".join(map(str, MIN_ONNXRUNTIME))
    return (f"onnxruntime {version} is older than {least}, the oldest that runs the graphs "
            f"specedge exports: upgrade it (pip install -U 'onnxruntime>={least}', or on a "
            "Jetson the newest onnxruntime-gpu of your JetPack's index, docs/jetson.md)")
