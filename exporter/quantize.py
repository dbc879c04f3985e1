"""Quantization of an fp32 (or fp16) ONNX graph, one implementation per method name, delegated to
onnxruntime.quantization (no hand-written quantizers).

`specedge export --precision int8|int4|int8-rtn` and `specedge quantize --method ...` (and the
self-drafts of `specedge draft`) all run `quantize_model`, in a child process (`run_isolated`);
`EXPORT_METHODS` says which method an export precision is. Methods:

- `int8-dynamic` (`quantize_dynamic`, per-channel int8 weights, activations quantized at run time
  by DynamicQuantizeLinear + MatMulInteger): uncalibrated; what `export --precision int8` makes.
- `int8-minmax`, `int8-entropy`, `int8-percentile`: static int8 QDQ (`quantize_static`), the
  explicit-quantization form TensorRT consumes; activations calibrated on the given feeds.
- `fp16` with an op block list (attention and norms stay fp32; `exclude` adds nodes).
- `fp8`: FP8 E4M3 QDQ (distribution calibration, ORT's only method for float types), for GPUs
  with FP8 (Hopper, Ada) through TensorRT.
- `int4-rtn`, `int8-rtn`: weight-only MatMulNBits, round to nearest with block-wise scales
  (ORT's default weight-only quantizer); int8 compute at accuracy level 4. `int4-rtn` is what
  `export --precision int4` makes on cpu (with a 4-bit embedding gather), `int8-rtn` the draft
  of the CPU defaults.
- `int4-hqq`, `int4-kquant`, `int4-gptq` (calibrated on the feeds): weight-only MatMulNBits.
  HQQ's float zero points are rewritten exactly into the fast uint8 layout plus a small
  correction (`zero_points.py`), because ORT's CPU kernel for float zero points is about 15x
  slower.

Mixed precision: `exclude` keeps those MatMul nodes in float, e.g. the LM head (`/lm_head/MatMul`).
Calibration data (the feeds) and the pair-level workflow live in `specedge.calibration`.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specedge.runtime.errors import ExportError, InputError

from . import zero_points

METHODS = ("fp16", "fp8", "int8-dynamic", "int8-minmax", "int8-entropy", "int8-percentile",
           "int8-rtn", "int4-rtn", "int4-hqq", "int4-kquant", "int4-gptq")
# Methods whose quantizer reads calibration feeds (the others ignore them).
CALIBRATED = ("fp8", "int8-minmax", "int8-entropy", "int8-percentile", "int4-gptq")
# Methods whose histogram calibrators need every feed to have one shape.
HISTOGRAM = ("fp8", "int8-entropy", "int8-percentile")
# `export --precision P` quantizes the fp32 export with this method, in a child process that
# reads the fp32 files (int4 for CUDA is made by the ONNX Runtime GenAI builder instead: its CUDA
# int4 graph keeps fp16 activations).
EXPORT_METHODS = {"int8": "int8-dynamic", "int4": "int4-rtn", "int8-rtn": "int8-rtn"}
BLOCK_SIZES = (16, 32, 64, 128, 256)

# Ops kept in fp32 by `fp16`: attention (its KV buffers stay fp32 and shared in place) and the
# RMS norms (reductions that lose precision in fp16).
FP16_BLOCK_LIST = ("GroupQueryAttention", "SimplifiedLayerNormalization",
                   "SkipSimplifiedLayerNormalization", "RotaryEmbedding")


@dataclass(frozen=True)
class QuantSettings:
    """How to quantize one graph.

    Attributes:
        method: one of `METHODS`.
        block_size: weight-only block size (MatMulNBits methods).
        accuracy_level: MatMulNBits compute: 4 = int8 activations, 1 = fp32.
        exclude: MatMul node names kept in float.
        symmetric: False gives uint8 zero points (asymmetric weight-only grids).
    """

    method: str
    block_size: int = 32
    accuracy_level: int = 4
    exclude: tuple[str, ...] = ()
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"--method {self.method!r}: use one of {', '.join(METHODS)}")
        if self.block_size not in BLOCK_SIZES:
            raise InputError(f"--block-size {self.block_size}: use "
                             f"{', '.join(map(str, BLOCK_SIZES))}")

    @property
    def precision(self) -> str:
        """The manifest precision of the result (`int4-hqq` -> `int4`)."""
        return self.method.split("-")[0]


def check_exclude(graph: Path, exclude: tuple[str, ...], method: str) -> None:
    """Refuse `exclude` names that are not nodes `method` would quantize in `graph` (a mistyped
    name would otherwise be ignored and the node quantized after all).

    Raises:
        InputError: a name that is not a node of the graph (the closest names suggested), or,
            for the MatMul quantizers, a node that is not a MatMul.
    """
    if not exclude:
        return
    import difflib

    import onnx

    nodes = {n.name: n.op_type for n in onnx.load(str(graph), load_external_data=False).graph.node}
    matmuls = sorted(name for name, op in nodes.items() if op == "MatMul")
    for name in exclude:
        if name not in nodes:
            near = difflib.get_close_matches(name, matmuls or list(nodes), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else \
                f"; its MatMul nodes include {', '.join(matmuls[:3])}"
            raise InputError(f"--exclude {name!r} is not a node of {graph}{hint}")
        if method != "fp16" and nodes[name] != "MatMul":
            raise InputError(f"--exclude {name!r} is a {nodes[name]} node; {method} quantizes "
                             "MatMul nodes only, so name a MatMul (e.g. /lm_head/MatMul)")


class _Reader:
    """onnxruntime.quantization.CalibrationDataReader over a list of feeds (re-iterable)."""

    def __init__(self, feeds: list[dict[str, Any]]) -> None:
        self.feeds = feeds
        self.index = 0

    def get_next(self) -> dict[str, Any] | None:
        if self.index >= len(self.feeds):
            return None
        self.index += 1
        return self.feeds[self.index - 1]

    def rewind(self) -> None:
        self.index = 0

    def __iter__(self) -> Any:
        return iter(self.feeds)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Reader:
        return _Reader(self.feeds)


def quantize_model(settings: QuantSettings, src: Path, dst: Path,
                   feeds: list[dict[str, Any]] | None = None) -> None:
    """Quantize the graph `src` into `dst` (external data next to it) in this process.

    The calibrated methods create their own InferenceSessions with per-session thread pools,
    which ONNX Runtime refuses in a process that already runs on the shared global pool: run
    those through `run_isolated`.

    Raises:
        ExportError: the quantizer failed (its first line is in the message).
    """
    import onnx
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    s = settings
    method = s.method
    feeds = feeds or []
    exclude = list(s.exclude)
    try:
        if method == "int8-dynamic":  # the uncalibrated int8 baseline
            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"], use_external_data_format=True,
                             nodes_to_exclude=exclude, extra_options={"MatMulConstBOnly": True})
            return
        if method == "fp16":
            from onnxruntime.transformers.float16 import convert_float_to_float16

            model16 = convert_float_to_float16(
                onnx.load(str(src)), keep_io_types=True, op_block_list=list(FP16_BLOCK_LIST),
                node_block_list=exclude, disable_shape_infer=True)
            drop_duplicate_nodes(model16.graph)
            onnx.save(model16, str(dst), save_as_external_data=True,
                      location=dst.name + ".data")
            return
        if method == "fp8":  # FP8 E4M3 QDQ, for GPUs that have FP8 (TensorRT)
            quantize_static(str(src), str(dst), _Reader(feeds), quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=["MatMul"],
                            activation_type=QuantType.QFLOAT8E4M3FN,
                            weight_type=QuantType.QFLOAT8E4M3FN,
                            calibrate_method=CalibrationMethod.Distribution,
                            nodes_to_exclude=exclude, use_external_data_format=True,
                            extra_options={"ActivationSymmetric": True,
                                           "WeightSymmetric": True, "MatMulConstBOnly": True})
            return
        if method in ("int8-minmax", "int8-entropy", "int8-percentile"):
            calibrate = {"int8-minmax": CalibrationMethod.MinMax,
                         "int8-entropy": CalibrationMethod.Entropy,
                         "int8-percentile": CalibrationMethod.Percentile}[method]
            quantize_static(str(src), str(dst), _Reader(feeds), quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=["MatMul"], per_channel=True,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                            calibrate_method=calibrate, nodes_to_exclude=exclude,
                            use_external_data_format=True,
                            extra_options={"ActivationSymmetric": True,
                                           "MatMulConstBOnly": True})
            return
        config: Any
        if method in ("int8-rtn", "int4-rtn"):
            config = nbits.DefaultWeightOnlyQuantConfig(
                block_size=s.block_size, is_symmetric=s.symmetric,
                accuracy_level=s.accuracy_level, bits=8 if method == "int8-rtn" else 4)
        elif method == "int4-hqq":
            config = nbits.HQQWeightOnlyQuantConfig(block_size=s.block_size)
        elif method == "int4-kquant":
            config = nbits.KQuantWeightOnlyQuantConfig()
        else:
            config = nbits.GPTQWeightOnlyQuantConfig(
                calibration_data_reader=_Reader(feeds), block_size=s.block_size)
        quant = nbits.MatMulNBitsQuantizer(
            onnx.load(str(src)), block_size=s.block_size, is_symmetric=s.symmetric,
            accuracy_level=s.accuracy_level, nodes_to_exclude=exclude, algo_config=config)
        quant.process()
        if method in ("int4-rtn", "int4-kquant", "int4-gptq"):
            quantize_embedding(quant.model.model, s.block_size)
        if method != "int4-hqq":
            quant.model.save_model_to_file(str(dst), use_external_data_format=True)
            return
        raw = dst.with_name(dst.stem + ".float-zp.onnx")
        quant.model.save_model_to_file(str(raw), use_external_data_format=True)
        zero_points.rewrite(raw, dst, accuracy_level=s.accuracy_level)
        raw.unlink()
        Path(str(raw) + ".data").unlink(missing_ok=True)
    except (InputError, ExportError):
        raise
    except Exception as exc:  # the quantizers raise plain exceptions
        msg = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ExportError(f"{src}: {method} quantization failed ({msg})") from None


def drop_duplicate_nodes(graph: Any) -> int:
    """Remove the nodes of an ONNX `graph` that repeat an earlier node exactly (name, op, inputs,
    outputs, attributes); returns how many went. onnxruntime's float16 converter before 1.32
    writes one Cast back to fp32 per blocked consumer of a value, all alike, and ONNX Runtime
    refuses a graph with two producers of a name ("two nodes with same node name")."""
    seen: set[bytes] = set()
    repeats = []
    for i, node in enumerate(graph.node):
        key = node.SerializeToString(deterministic=True)
        if key in seen:
            repeats.append(i)
        seen.add(key)
    for i in reversed(repeats):  # by index, last first: the first of each stays where it was
        del graph.node[i]
    return len(repeats)


def quantize_embedding(model: Any, block_size: int) -> bool:
    """Replace the float embedding Gather by a 4-bit GatherBlockQuantized (com.microsoft).

    Round to nearest, symmetric, one scale per `block_size` values along the hidden axis, codes
    stored as uint8 pairs (zero point 8, the MatMulNBits layout), so the graph keeps its opset.
    Handles the [vocab, hidden] table (Gather axis 0), the [hidden, vocab] one a tied concat
    export gathers along axis 1 followed by a Transpose (`onnx_export._tie_embedding`), and the
    GenAI builder's tied form (Gather of a Transpose of the LM head's [hidden, vocab] weight),
    which gathers from the LM head's own 4-bit MatMulNBits weights, as the builder's int4 does.
    The float table is dropped when nothing else reads it. Returns whether a Gather was
    replaced.
    """
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    nodes = list(model.graph.node)
    producers = {out: n for n in nodes for out in n.output}
    for node in nodes:
        if node.op_type == "Gather" and node.input[0] in producers:
            if _gather_from_matmul_nbits(model, node, producers[node.input[0]], block_size):
                return True
        if node.op_type != "Gather" or node.input[0] not in inits:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        table = numpy_helper.to_array(inits[node.input[0]]).astype(np.float32)
        output = node.output[0]
        drop = [node]
        if axis == 1:  # [hidden, vocab] + Transpose(1, 2, 0) from _tie_embedding
            after = [n for n in nodes if output in n.input]
            if len(after) != 1 or after[0].op_type != "Transpose":
                continue
            table, output = table.T, after[0].output[0]
            drop.append(after[0])
        elif axis != 0:
            continue
        vocab, hidden = table.shape
        if table.ndim != 2 or hidden % block_size:
            continue
        blocks = table.reshape(vocab, hidden // block_size, block_size)
        scales = np.abs(blocks).max(-1, keepdims=True) / 7.0
        scales[scales == 0] = 1.0
        codes = (np.clip(np.round(blocks / scales), -8, 7) + 8).astype(np.uint8)
        codes = codes.reshape(vocab, hidden)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        base = node.input[0] + "_gbq4"
        model.graph.initializer.extend([
            numpy_helper.from_array(packed, base),
            numpy_helper.from_array(scales.reshape(vocab, -1).astype(np.float32),
                                    base + "_scales")])
        index = nodes.index(node)
        for n in drop:
            model.graph.node.remove(n)
        model.graph.node.insert(index, helper.make_node(
            "GatherBlockQuantized", [base, node.input[1], base + "_scales"], [output],
            name=node.name + "_Q4", domain="com.microsoft", gather_axis=0, quantize_axis=1,
            block_size=block_size, bits=4))
        if not any(node.input[0] in n.input for n in model.graph.node):
            model.graph.initializer.remove(inits[node.input[0]])
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
        return True
    return False


def _gather_from_matmul_nbits(model: Any, gather: Any, transpose: Any, block_size: int) -> bool:
    """The builder's tied embedding, `Gather(Transpose(W), ids)` with W [hidden, vocab] the LM
    head's weight, once the LM head is a symmetric 4-bit MatMulNBits of `block_size`: gather
    its packed rows [vocab, hidden / 2] and scales [vocab, hidden / block] instead, so the table
    is stored once, in 4 bits. Returns whether it did."""
    from onnx import helper, numpy_helper

    perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
    weight = transpose.input[0]
    if transpose.op_type != "Transpose" or perm != [1, 0]:
        return False
    attrs: dict[str, int] = {}
    head = None
    for n in model.graph.node:
        if n.op_type == "MatMulNBits" and n.input[1] == weight + "_Q4":
            head, attrs = n, {a.name: a.i for a in n.attribute}
    if (head is None or len(head.input) != 3 or attrs.get("bits") != 4
            or attrs.get("block_size") != block_size or attrs.get("K", 1) % block_size):
        return False  # zero points, another block size, a padded last block: not shareable
    users = [n for n in model.graph.node if transpose.output[0] in n.input]
    if users != [gather] or any(a.name == "axis" and a.i != 0 for a in gather.attribute):
        return False
    vocab, hidden = attrs["N"], attrs["K"]
    rows = gather.name + "_rows"
    model.graph.initializer.append(
        numpy_helper.from_array(np.array([vocab, hidden // 2], dtype=np.int64), rows + "_shape"))
    index = list(model.graph.node).index(transpose)
    model.graph.node.remove(transpose)
    model.graph.node.remove(gather)
    model.graph.node.insert(index, helper.make_node(
        "Reshape", [head.input[1], rows + "_shape"], [rows], name=rows))  # [vocab, blocks, blob]
    model.graph.node.insert(index + 1, helper.make_node(
        "GatherBlockQuantized", [rows, gather.input[1], head.input[2]], [gather.output[0]],
        name=gather.name + "_Q4", domain="com.microsoft", gather_axis=0, quantize_axis=1,
        block_size=block_size, bits=4))
    table = next((i for i in model.graph.initializer if i.name == weight), None)
    if table is not None and not any(weight in n.input for n in model.graph.node):
        model.graph.initializer.remove(table)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return True


_PEAK_MARKER = "SPECEDGE_PEAK_RSS_MIB="


def run_isolated(settings: QuantSettings, src: Path, dst: Path, feeds: list[dict[str, Any]],
                 scratch: Path) -> float | None:
    """Run `quantize_model` in a child process.

    onnxruntime.quantization creates its own InferenceSessions with per-session thread pools,
    which ONNX Runtime refuses once a process runs on the shared global pool (the runtime's
    default thread plan). The child has no such pool, and its memory is returned when it ends
    (the export quantizes its drafts this way, so that its own peak stays one fp32 build). Feeds
    travel as an .npz file in `scratch`, read with allow_pickle=False. The quantizers' INFO log
    (one line per node) is shown only when this process logs INFO (`specedge -v`). Returns the
    child's peak RSS in MiB (None if it did not report one).

    Raises:
        ExportError: the child failed (its last stderr line is in the message).
    """
    feeds_file = scratch / "calibration_feeds.npz"
    np.savez(feeds_file, **{f"{i}|{k}": v for i, feed in enumerate(feeds)
                            for k, v in feed.items()})
    verbose = logging.getLogger().isEnabledFor(logging.INFO)
    args = {"settings": {**asdict(settings), "exclude": list(settings.exclude)},
            "src": str(src), "dst": str(dst), "feeds": str(feeds_file),
            "log_level": logging.INFO if verbose else logging.WARNING}
    proc = subprocess.run([sys.executable, "-m", "specedge.exporter.quantize", json.dumps(args)],
                          capture_output=True, text=True, check=False)
    feeds_file.unlink(missing_ok=True)
    if verbose and proc.stderr:
        sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        raise ExportError(lines[-1][:400] if lines else f"{src}: {settings.method} failed")
    peaks = [ln.split("=", 1)[1] for ln in proc.stdout.splitlines()
             if ln.startswith(_PEAK_MARKER)]
    return float(peaks[-1]) if peaks else None


def _load_feeds(path: Path) -> list[dict[str, Any]]:
    feeds: dict[int, dict[str, Any]] = {}
    with np.load(path, allow_pickle=False) as z:
        for key in z.files:
            index, name = key.split("|", 1)
            feeds.setdefault(int(index), {})[name] = z[key]
    return [feeds[i] for i in sorted(feeds)]


def _main(argv: list[str]) -> int:
    """The child of `run_isolated`: one JSON argument, the peak RSS on stdout."""
    import resource

    a = json.loads(argv[0])
    # Before onnxruntime.quantization's own logging.basicConfig(level=INFO) runs on import.
    logging.basicConfig(level=a.get("log_level", logging.WARNING),
                        format="%(asctime)s %(name)s [%(levelname)s] - %(message)s")
    settings = QuantSettings(**{**a["settings"], "exclude": tuple(a["settings"]["exclude"])})
    try:
        quantize_model(settings, Path(a["src"]), Path(a["dst"]), _load_feeds(Path(a["feeds"])))
    except ExportError as exc:
        print(f"{exc}", file=sys.stderr)
        return 1
    print(f"{_PEAK_MARKER}{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
