"""Write runtime/data/greedy_head_{float32,float16}.onnx, the graph greedy verification runs on
the logits a model left on its device (`runtime.greedy_head.GreedyHead`).

Usage: python scripts/make_greedy_head_onnx.py [OUT_DIR]   (needs the `onnx` package; the runtime
does not, it only reads the files). Opset 17 and IR version 8 keep the files loadable by older
onnxruntime builds (Jetson wheels).

The graph, for logits `[rows, positions, vocab]`:
  ids   [rows, positions] int64: the argmax, ties to the lowest token id (numpy's rule), computed
        as min{i : logits[i] == max(logits)} so it does not depend on a provider's ArgMax kernel
  sums  [rows, positions] float32: each position's logit sum, which is NaN or inf exactly when a
        logit is (the runtime refuses such logits, as on the host path)
  kept  [len(keep), positions, vocab]: the rows `keep` (those that sample), in the logits' dtype
Inputs: `logits`; `index` [vocab] float32 = 0, 1, ..., vocab - 1 (exact below 2**24, bound once by
the runtime); `keep` [n] int64. The float16 graph casts to float32 first (exact).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
NO_ID = float(2**24)  # larger than any index: where a logit is not the maximum


def build(dtype: str) -> onnx.ModelProto:
    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    x = "logits"
    nodes = []
    if dtype == "float16":
        nodes.append(helper.make_node("Cast", ["logits"], ["x"], to=TensorProto.FLOAT))
        x = "x"
    nodes += [
        helper.make_node("ReduceMax", [x], ["top"], axes=[-1], keepdims=1),
        helper.make_node("Equal", [x, "top"], ["is_top"]),
        helper.make_node("Where", ["is_top", "index", "no_id"], ["top_index"]),
        helper.make_node("ReduceMin", ["top_index"], ["first"], axes=[-1], keepdims=0),
        helper.make_node("Cast", ["first"], ["ids"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", [x, "last_axis"], ["sums"], keepdims=0),
        helper.make_node("Gather", ["logits", "keep"], ["kept"], axis=0),
    ]
    init = [numpy_helper.from_array(np.asarray(NO_ID, np.float32), "no_id"),
            numpy_helper.from_array(np.asarray([-1], np.int64), "last_axis")]
    graph = helper.make_graph(
        nodes, f"specedge_greedy_head_{dtype}",
        [helper.make_tensor_value_info("logits", elem, ["rows", "positions", "vocab"]),
         helper.make_tensor_value_info("index", TensorProto.FLOAT, ["vocab"]),
         helper.make_tensor_value_info("keep", TensorProto.INT64, ["kept_rows"])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["rows", "positions"]),
         helper.make_tensor_value_info("sums", TensorProto.FLOAT, ["rows", "positions"]),
         helper.make_tensor_value_info("kept", elem, ["kept_rows", "positions", "vocab"])],
        init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="specedge")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for dtype in ("float32", "float16"):
        path = out / f"greedy_head_{dtype}.onnx"
        onnx.save(build(dtype), str(path))
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "runtime" / "data")
