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

# Before 1.32 the CPU provider's QDQ fusion turns an fp8 (E4M3) DequantizeLinear -> MatMul into a
# QLinearMatMul it has no fp8 kernel for, so an fp8 pair fails to load ("Failed to find kernel for
# QLinearMatMul"); without that fusion the DequantizeLinear and MatMul run as they are.
FP8_FUSION_FIXED = (1, 32)
QDQ_FUSION = "QDQSelectorActionTransformer"


def _minor(version: str) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", version)
    return None if found is None else (int(found[1]), int(found[2]))


def onnxruntime_too_old(version: str) -> str | None:
    """One line saying that onnxruntime `version` ("1.22.1", "1.20.0+cu126") is older than
    `MIN_ONNXRUNTIME` and how to upgrade it; None when it is not (or the version is unreadable).

    pip keeps `onnxruntime>=1.23` for the CPU package, but a GPU build installed apart (the
    Jetson wheels, `onnxruntime-gpu`) is another package, so an old one goes unnoticed until a
    model fails to load."""
    found = _minor(version)
    if found is None or found >= MIN_ONNXRUNTIME:
        return None
    least = ".".join(map(str, MIN_ONNXRUNTIME))
    return (f"onnxruntime {version} is older than {least}, the oldest that runs the graphs "
            f"specedge exports: upgrade it (pip install -U 'onnxruntime>={least}', or on a "
            "Jetson the newest onnxruntime-gpu of your JetPack's index, docs/jetson.md)")


def fusions_to_skip(precision: str, version: str) -> tuple[str, ...]:
    """The ONNX Runtime graph optimizers to disable for a model of `precision` on onnxruntime
    `version`: the QDQ fusion for fp8 models before 1.32 (see `FP8_FUSION_FIXED`), else none."""
    found = _minor(version)
    if precision == "fp8" and found is not None and found < FP8_FUSION_FIXED:
        return (QDQ_FUSION,)
    return ()
