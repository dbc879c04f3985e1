"""Write runtime/data/selftest.onnx, the tiny graph `specedge doctor` runs on each provider.

Usage: python scripts/make_selftest_onnx.py [OUT]   (needs the `onnx` package; the runtime does
not, it only reads the file). The inputs and weights come from `selftest_arrays()` in
runtime/doctor.py, which also computes numpy's answer, so the file and the check cannot drift.
Opset 17 and IR version 8 keep the file loadable by older onnxruntime builds (Jetson wheels).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specedge.runtime.doctor import selftest_arrays, selftest_reference

ROOT = Path(__file__).resolve().parents[1]


def build() -> onnx.ModelProto:
    a = selftest_arrays()
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["xw"]),
        helper.make_node("Add", ["xw", "b1"], ["h0"]),
        helper.make_node("Tanh", ["h0"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["z"]),
        helper.make_node("Softmax", ["z"], ["probs"], axis=-1),
        helper.make_node("ArgMax", ["probs"], ["top1"], axis=-1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "specedge_doctor_selftest",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("top1", TensorProto.INT64, [2])],
        [numpy_helper.from_array(a[k], k) for k in ("w1", "b1", "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="specedge")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main(out: Path) -> None:
    probs, _ = selftest_reference(selftest_arrays())
    top2 = np.sort(probs, -1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0] > 0.05).all(), "top-1 margin too small for a stable check"
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), str(out))
    print(f"wrote {out} ({out.stat().st_size} bytes); top-1 margins {top2[:, 1] - top2[:, 0]}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "runtime" / "data" / "selftest.onnx")
