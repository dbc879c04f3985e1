"""Write runtime/data/kv_{gather,scatter,zeros,copy}_{float32,float16}.onnx, the graphs that keep a
concat-form model's KV cache on its device (`runtime.device_kv.DeviceKV`) and copy a row's
prefix to another row (`runtime.kvcache.KVCache.copy_prefix`).

Usage: python scripts/make_kv_rows_onnx.py [OUT_DIR]   (needs the `onnx` package; the runtime
does not, it only reads the files). Opset 17 and IR version 8, as the greedy head.

The cache of all layers is one tensor `cache [batch, slots, n, heads, head_dim]` (n = 2 x
layers: every layer's keys, then its values; slots = the cache length + 1, the last slot a bin
for the padding of short rows, never read).
  gather:  cache, rows [r] int64, past [1] int64
           -> pasts [n, r, heads, past, head_dim]: the rows' first `past` positions, in the
              layout the model reads (its past inputs are bound to slices of this tensor)
  scatter: cache, presents [n, r, heads, total, head_dim], past [1], total [1] int64,
           slots [r, width, 2] int64 (row, position)
           -> cache_out: the cache with presents[:, i, :, past + j] written at slots[i, j]; the
              runtime binds cache_out to the cache itself, so ScatterND writes in place
  zeros:   shape [1] int64 (an element count) -> that many zeros; the runtime binds the output
           by address over a buffer of any shape (a new cache, zero-filled on the device without
           a host array as large as the cache; each in-place gqa-shared KV buffer too)
  copy:    x [size] -> y [size], the same values: the runtime binds both by address over spans
           of KV buffers (a row's positions copied to another row, on the device)
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
DIMS = ["batch", "slots", "n", "heads", "head_dim"]


def _model(nodes: list, name: str, inputs: list, outputs: list) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="specedge")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def gather(dtype: int, name: str) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Gather", ["cache", "rows"], ["picked"], axis=0),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor(
            "zero", TensorProto.INT64, [1], [0])),
        helper.make_node("Constant", [], ["axis"], value=helper.make_tensor(
            "axis", TensorProto.INT64, [1], [1])),
        helper.make_node("Slice", ["picked", "zero", "past", "axis"], ["prefix"]),
        helper.make_node("Transpose", ["prefix"], ["pasts"], perm=[2, 0, 3, 1, 4]),
    ]
    i64 = TensorProto.INT64
    return _model(nodes, f"specedge_kv_gather_{name}",
                  [helper.make_tensor_value_info("cache", dtype, DIMS),
                   helper.make_tensor_value_info("rows", i64, ["r"]),
                   helper.make_tensor_value_info("past", i64, [1])],
                  [helper.make_tensor_value_info("pasts", dtype,
                                                 ["n", "r", "heads", "past", "head_dim"])])


def scatter(dtype: int, name: str) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Constant", [], ["axis"], value=helper.make_tensor(
            "axis", TensorProto.INT64, [1], [3])),
        helper.make_node("Slice", ["presents", "past", "total", "axis"], ["new"]),
        helper.make_node("Transpose", ["new"], ["updates"], perm=[1, 3, 0, 2, 4]),
        helper.make_node("ScatterND", ["cache", "slots", "updates"], ["cache_out"]),
    ]
    i64 = TensorProto.INT64
    return _model(nodes, f"specedge_kv_scatter_{name}",
                  [helper.make_tensor_value_info("cache", dtype, DIMS),
                   helper.make_tensor_value_info("presents", dtype,
                                                 ["n", "r", "heads", "total", "head_dim"]),
                   helper.make_tensor_value_info("past", i64, [1]),
                   helper.make_tensor_value_info("total", i64, [1]),
                   helper.make_tensor_value_info("slots", i64, ["r", "width", 2])],
                  [helper.make_tensor_value_info("cache_out", dtype, DIMS)])


def zeros(dtype: int, name: str) -> onnx.ModelProto:
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                              value=helper.make_tensor("zero", dtype, [1], [0]))]
    return _model(nodes, f"specedge_kv_zeros_{name}",
                  [helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
                  [helper.make_tensor_value_info("zeros", dtype, ["size"])])


def copy(dtype: int, name: str) -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    return _model(nodes, f"specedge_kv_copy_{name}",
                  [helper.make_tensor_value_info("x", dtype, ["size"])],
                  [helper.make_tensor_value_info("y", dtype, ["size"])])


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, dtype in (("float32", TensorProto.FLOAT), ("float16", TensorProto.FLOAT16)):
        for kind, build in (("gather", gather), ("scatter", scatter), ("zeros", zeros),
                            ("copy", copy)):
            path = out / f"kv_{kind}_{name}.onnx"
            onnx.save(build(dtype, name), str(path))
            print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "runtime" / "data")
