"""Split a model's output head off its body, for exact greedy decoding that reads a quarter of
the head.

A decode step of a small model streams every weight once, and the output head (hidden ->
vocabulary, a float MatMul) is a large share of them: 113 of SmolLM2-135M's 540 MB. Greedy
decoding only needs the argmax, so the runtime (`runtime/shortlist.py`) takes it in two passes:
an int8 copy of the head (ONNX Runtime's MatMulNBits, 8 bits, blocks of 32, int8 compute) gives
approximate logits and, from per-row error bounds, the few tokens that can still be the argmax;
their logits are then computed exactly from the float rows. This module writes, beside
`<name>/model.onnx` (which stays as it is, for ONNX Runtime GenAI and for every other path):

- `body.onnx`: the same graph without the head MatMul; it outputs the hidden state and reads
  the same external data file (no weight is copied).
- `head.onnx`: that MatMul alone, on the same bytes of the same data file: full logits, bit for
  bit those of the whole graph (same kernel, same shapes), for sampling and `forward`.
- `shortlist.onnx` (+ `.data`): the int8 head, the bound (below), the head's float rows
  `[vocab, hidden]` and the candidates' exact logits from them: hidden -> argmax ids.

The bound, per token i (h the hidden state, w_i its head row, hat for the int8 values):
|h.w_i - hat(h).hat(w_i)| <= |h - hat(h)| |w_i| + |hat(h)| |w_i - hat(w_i)|, with
|h - hat(h)| <= sqrt(sum over blocks of 32 (max|h_block| / 254)^2) (round to nearest, symmetric
int8 per block of 32, as MatMulNBits' int8 compute quantizes its input), plus a float32 rounding
allowance. The runtime checks at load that this build of ONNX Runtime quantizes as assumed
(`SplitHead.check`) and falls back to the full head if not.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from specedge.runtime.errors import ModelError
from specedge.runtime.files import sha256_file
from specedge.runtime.manifest import HeadSpec, ModelSpec

log = logging.getLogger(__name__)

# Only float32 heads are split. A float16 model's logits are rounded to float16, so two tokens
# often tie there (measured: SmolLM2's fp16 GPU recipe, 17.42 for both); the whole graph gives
# the lower id, the exact float64 argmax may not, and greedy output would change. (fp16 pairs are
# for GPUs anyway, where the runtime takes the argmax on the device and never splits the head.)
SPLIT_TYPES = (1,)  # onnx TensorProto.FLOAT
BLOCK = 32  # MatMulNBits block along the hidden size (and the input quantization's block)
ROUNDING = 1e-4  # relative allowance for float32 rounding in the int8 head's sums
MIN_HEAD_BYTES = 1 << 20  # smaller heads gain nothing worth the extra files


def split_head(folder: Path, spec: ModelSpec, *, min_bytes: int = MIN_HEAD_BYTES) -> ModelSpec:
    """Write the split-head files of the model `spec` in pair `folder` and return its spec with
    `head` set and the files listed; the spec unchanged (logged why) when the model's logits do
    not come from a float MatMul on an external-data weight, or the head is too small to gain.

    Raises:
        ModelError: the model file is not valid ONNX.
        OSError: writing the files failed.
    """
    import onnx
    from google.protobuf.message import DecodeError
    from onnx import TensorProto, helper, numpy_helper

    path = folder / spec.path
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError) as exc:
        raise ModelError(f"{path}: not a valid ONNX file ({' '.join(str(exc).split())[:200]}); "
                         "the file may be truncated or corrupt: re-export the pair") from None
    graph = model.graph
    node = next((n for n in graph.node if spec.logits in n.output), None)
    inits = {i.name: i for i in graph.initializer}
    weight = inits.get(node.input[1]) if node is not None and len(node.input) == 2 else None
    why = None
    if node is None or weight is None or node.op_type != "MatMul":
        log.info("%s: head not split (its logits do not come from a MatMul on a weight)",
                 spec.path)
        return spec
    if weight.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16) or len(weight.dims) != 2:
        why = "its head is not a float matrix"
    elif weight.data_type not in SPLIT_TYPES:
        why = "its head is float16, whose rounded logits tie where the exact argmax may not"
    elif weight.data_location != TensorProto.EXTERNAL:
        why = "its head weight is inside the graph file"
    elif weight.dims[0] % BLOCK:
        why = f"its hidden size {weight.dims[0]} is not a multiple of {BLOCK}"
    elif weight.dims[1] != spec.vocab_size:
        why = "its head is not vocabulary-wide"
    if why is None:
        hidden_size, vocab = int(weight.dims[0]), int(weight.dims[1])
        itemsize = 4 if weight.data_type == TensorProto.FLOAT else 2
        if hidden_size * vocab * itemsize < min_bytes:
            why = f"its head is only {hidden_size * vocab * itemsize} bytes"
    if why is not None:
        log.info("%s: head not split (%s)", spec.path, why)
        return spec
    model_dir = path.parent
    rel_dir = Path(spec.path).parent
    names = ["body.onnx", "head.onnx", "shortlist.onnx", "shortlist.onnx.data"]
    for name in names:  # onnx appends to an existing external data file: start afresh
        (model_dir / name).unlink(missing_ok=True)
    hidden = node.input[0]
    matrix = _read_external(model_dir, weight)  # [hidden, vocab]

    # The body: the graph without the head MatMul, the hidden state as its first output.
    graph.node.remove(node)
    kept = [o for o in graph.output if o.name != spec.logits]
    del graph.output[:]
    graph.output.extend([helper.make_tensor_value_info(
        hidden, weight.data_type, ["batch_size", "sequence_length", hidden_size]), *kept])
    if not any(weight.name in n.input for n in graph.node):
        graph.initializer.remove(weight)
    onnx.save(model, str(model_dir / "body.onnx"))

    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]

    def save(nodes: list, inputs: list, outputs: list, initializers: list, name: str,
             external: bool) -> None:
        g = helper.make_graph(nodes, name, inputs, outputs, initializers)
        m = helper.make_model(g, opset_imports=opsets)
        m.ir_version = model.ir_version
        if external:
            onnx.save(m, str(model_dir / name), save_as_external_data=True,
                      all_tensors_to_one_file=True, location=f"{name}.data", size_threshold=1024)
        else:
            onnx.save(m, str(model_dir / name))

    # The full head: the same MatMul on the same bytes of the same data file.
    head_weight = TensorProto()
    head_weight.CopyFrom(weight)
    save([helper.make_node("MatMul", ["hidden", head_weight.name], ["logits"])],
         [helper.make_tensor_value_info("hidden", weight.data_type,
                                        ["batch_size", "sequence_length", hidden_size])],
         [helper.make_tensor_value_info("logits", weight.data_type,
                                        ["batch_size", "sequence_length", vocab])],
         [head_weight], "head.onnx", external=False)

    # The int8 head and the bound: hidden [rows, hidden] -> candidates [2, n] (row, token).
    weight_q, scale32, norm, error = _quantize_rows(matrix.T)
    c_hidden = (1.01 * (error + ROUNDING * (norm + error))).astype(np.float32)
    c_input = (1.01 * (1 + ROUNDING) * (norm + error)).astype(np.float32)
    f32 = TensorProto.FLOAT
    nb = hidden_size // BLOCK
    consts = [
        numpy_helper.from_array(weight_q, "weight_q"),
        numpy_helper.from_array(scale32.reshape(-1), "weight_scale"),
        numpy_helper.from_array(c_hidden, "c_hidden"),
        numpy_helper.from_array(c_input, "c_input"),
        numpy_helper.from_array(np.ascontiguousarray(matrix.T), "head_rows"),  # [vocab, hidden]
        numpy_helper.from_array(np.array([0, nb, BLOCK], np.int64), "block_shape"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array(-1, np.int64), "minus_one"),
        # sqrt(BLOCK) / 254: a block's rounding error (half a step of max/127), as a norm.
        numpy_helper.from_array(np.array(np.sqrt(BLOCK) / 254, np.float32), "input_scale"),
    ]
    f64 = TensorProto.DOUBLE
    node = helper.make_node
    nodes = [
        node("Cast", ["hidden"], ["x"], to=f32),
        # Approximate logits and the bound: candidates [2, n] (row, token), row-major.
        node("MatMulNBits", ["x", "weight_q", "weight_scale"], ["approx"],
             domain="com.microsoft", K=hidden_size, N=vocab, bits=8, block_size=BLOCK,
             accuracy_level=4),
        node("ReduceL2", ["x", "axis1"], ["x_norm"], keepdims=1),
        node("Reshape", ["x", "block_shape"], ["x_blocks"]),
        node("Abs", ["x_blocks"], ["x_abs"]),
        node("ReduceMax", ["x_abs", "axis2"], ["x_amax"], keepdims=0),
        node("ReduceL2", ["x_amax", "axis1"], ["amax_norm"], keepdims=1),
        node("Mul", ["amax_norm", "input_scale"], ["x_error"]),
        node("Mul", ["x_norm", "c_hidden"], ["b_hidden"]),
        node("Mul", ["x_error", "c_input"], ["b_input"]),
        node("Add", ["b_hidden", "b_input"], ["bound"]),
        node("Sub", ["approx", "bound"], ["lower"]),
        node("Add", ["approx", "bound"], ["upper"]),
        node("ReduceMax", ["lower", "axis1"], ["best_lower"], keepdims=1),
        node("GreaterOrEqual", ["upper", "best_lower"], ["keep"]),
        node("NonZero", ["keep"], ["candidates"]),
        # The candidates' logits in float64 from the float rows: exact for float32 inputs.
        node("Gather", ["candidates", "zero"], ["cand_row"], axis=0),
        node("Gather", ["candidates", "one"], ["cand_col"], axis=0),
        node("Gather", ["head_rows", "cand_col"], ["cand_w"], axis=0),
        node("Cast", ["cand_w"], ["cand_w64"], to=f64),
        node("Gather", ["x", "cand_row"], ["cand_x"], axis=0),
        node("Cast", ["cand_x"], ["cand_x64"], to=f64),
        node("Mul", ["cand_w64", "cand_x64"], ["cand_prod"]),
        node("ReduceSum", ["cand_prod", "axis1"], ["exact"], keepdims=0),
        # Per row, the largest exact logit (ArgMax: ties to the lowest id) over a -inf table.
        node("Shape", ["approx"], ["table_shape"]),
        node("ConstantOfShape", ["table_shape"], ["table"],
             value=numpy_helper.from_array(np.array([-np.inf], np.float64))),
        node("Transpose", ["candidates"], ["cand_idx"], perm=[1, 0]),
        node("ScatterND", ["table", "cand_idx", "exact"], ["scores"]),
        node("ArgMax", ["scores"], ["best_id"], axis=1, keepdims=0),
        node("ReduceMax", ["scores", "axis1"], ["best"], keepdims=0),
        # ok: the row's best logit and its hidden state are finite (no NaN, no inf).
        node("ReduceSum", ["x_norm", "axis1"], ["norm_row"], keepdims=0),
        node("Cast", ["norm_row"], ["norm64"], to=f64),
        node("Add", ["best", "norm64"], ["check"]),
        node("IsNaN", ["check"], ["is_nan"]),
        node("IsInf", ["check"], ["is_inf"]),
        node("Or", ["is_nan", "is_inf"], ["bad"]),
        node("Not", ["bad"], ["ok"]),
        node("Where", ["ok", "best_id", "minus_one"], ["ids"]),  # -1: not finite
    ]
    save(nodes, [helper.make_tensor_value_info("hidden", weight.data_type, ["rows", hidden_size])],
         [helper.make_tensor_value_info("ids", TensorProto.INT64, ["rows"]),
          helper.make_tensor_value_info("ok", TensorProto.BOOL, ["rows"]),
          helper.make_tensor_value_info("candidates", TensorProto.INT64, [2, "count"]),
          # For the runtime's load-time check of the bound (`SplitHead.check`).
          *[helper.make_tensor_value_info(n, f32, ["rows", vocab])
            for n in ("approx", "b_hidden", "b_input")]],
         consts, "shortlist.onnx", external=True)

    files = {rel: digest for rel, digest in spec.files.items()
             if Path(rel).parent != rel_dir or Path(rel).name not in names}
    for name in names:
        os.chmod(model_dir / name, 0o644)  # as the exporter's other files (onnx writes 0600)
        files[str(rel_dir / name)] = sha256_file(model_dir / name)
    head = HeadSpec(body=str(rel_dir / "body.onnx"), hidden=hidden,
                    logits=str(rel_dir / "head.onnx"), shortlist=str(rel_dir / "shortlist.onnx"),
                    hidden_size=hidden_size)
    return dataclasses.replace(spec, files=files, head=head)


def _quantize_rows(rows: np.ndarray, chunk: int = 4096
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric int8 per block of 32 of the head's rows `[vocab, hidden]`, as MatMulNBits
    stores it (uint8 = q + 128), a few thousand rows at a time (the export's peak memory).

    Returns:
        weight_q `[vocab, hidden / 32, 32]` uint8, scales `[vocab, hidden / 32]` float32, and
        per row the norm |w| and the quantization error |w - hat(w)| (float64).
    """
    vocab, hidden = rows.shape
    weight_q = np.empty((vocab, hidden // BLOCK, BLOCK), np.uint8)
    scales = np.empty((vocab, hidden // BLOCK), np.float32)
    norm = np.empty(vocab)
    error = np.empty(vocab)
    for start in range(0, vocab, chunk):
        part = slice(start, start + chunk)
        blocks = rows[part].astype(np.float64).reshape(-1, hidden // BLOCK, BLOCK)
        scale = (np.abs(blocks).max(-1) / 127.0).astype(np.float32)
        scale[scale == 0] = 1.0
        quant = np.clip(np.rint(blocks / scale[..., None]), -127, 127)
        weight_q[part] = (quant + 128).astype(np.uint8)
        scales[part] = scale
        norm[part] = np.sqrt((blocks ** 2).sum((1, 2)))
        error[part] = np.sqrt(((blocks - quant * scale[..., None]) ** 2).sum((1, 2)))
    return weight_q, scales, norm, error


def _read_external(model_dir: Path, tensor: object) -> np.ndarray:
    """The values of an initializer stored in an external data file."""
    from onnx import TensorProto

    assert isinstance(tensor, TensorProto)
    info = {e.key: e.value for e in tensor.external_data}
    dtype = np.float32 if tensor.data_type == TensorProto.FLOAT else np.float16
    count = int(np.prod(tensor.dims))
    data = np.fromfile(model_dir / info["location"], dtype=dtype, count=count,
                       offset=int(info.get("offset", 0)))
    if data.size != count:
        raise OSError(f"{model_dir / info['location']}: shorter than the head weight it holds")
    return data.reshape(tuple(tensor.dims))


def split_pair_heads(folder: Path, *, force: bool = False, min_bytes: int = MIN_HEAD_BYTES,
                     say: Callable[[str], None] = lambda _m: None) -> dict[str, bool]:
    """Split the heads of the models of an existing pair in place (`specedge split-head`):
    which models have a split head afterwards. A model already split is left as it is, unless
    `force` (then its head files are written again).

    Raises:
        ManifestError / InputError: not a valid pair; OSError: writing failed (the manifest is
            written last, atomically: a failure leaves the pair as it was, plus stray files).
    """
    from specedge.runtime.manifest import load_manifest, write_manifest

    manifest = load_manifest(folder)
    models = {"target": manifest.target, "draft": manifest.draft}
    out: dict[str, bool] = {}
    changed = {}
    for name, spec in models.items():
        if spec is None:
            continue
        if (spec.head is None or force) and spec.graph == "gqa-shared":
            say(f"splitting the {name}'s head")
            new = split_head(manifest.root, spec, min_bytes=min_bytes)
            if new.head is not None:
                changed[name] = new
        out[name] = (changed.get(name) or spec).head is not None
    if changed:
        write_manifest(dataclasses.replace(manifest, **changed), manifest.root)
    return out
