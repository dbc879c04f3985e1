"""HF folder → ONNX model with KV-cache inputs/outputs, in one of two graph forms.

- gqa-shared: ONNX Runtime GenAI's model builder (`onnxruntime_genai.models.builder`), run in a
  subprocess. Its graphs use GroupQueryAttention with rotary embedding inside the op, take any
  number of new tokens with a past, return logits for every new position, and accept one KV buffer
  per layer bound as both past and present. Precisions: fp32, fp16 (CUDA), int8/int4 weight-only
  (MatMulNBits, RTN) straight from the builder.
- concat: present = concat(past, new), any batch with any number of new tokens after a past.
  For the builder's families, the builder's graph with each GroupQueryAttention rewritten into
  standard-op attention (`concat_form`, `concat_from_gqa`: fused norms and weights kept). Else,
  and with `--graph concat-standard` (standard ops only, what TensorRT takes),
  `torch.onnx.export` (TorchScript exporter) of a small wrapper around the HF model, legacy
  tuple KV in and out (`export_concat`).

Both return a `GraphInfo` the manifest is built from.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specedge.runtime.errors import ExportError

from .archs import ArchSpec
from .builder_shim import ERROR_EXIT, ERROR_PREFIX


@dataclass(frozen=True)
class GraphInfo:
    """What the exporter learned about the graph it wrote."""

    onnx_path: Path
    graph: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    vocab_size: int
    kv_dtype: str
    position_ids: str | None
    genai_config: dict[str, Any] | None
    min_cache_len: int = 1


_BUILDER_PRECISION = {"fp32": "fp32", "fp16": "fp16", "int4": "int4", "int8": "int8"}


def build_gqa(hf_dir: Path, out: Path, precision: str, provider: str, cache: Path,
              extra: dict[str, str], log_file: Path) -> GraphInfo:
    """Run the ONNX Runtime GenAI builder on an HF folder.

    Raises:
        ExportError: the builder failed: its last line, and where its whole log is kept (a copy
            in the temporary folder, since `log_file` is usually inside the export's working
            folder, which a failed export removes).
    """
    if precision not in _BUILDER_PRECISION:
        raise ExportError(f"precision {precision!r} is not available for the gqa-shared form")
    out.mkdir(parents=True, exist_ok=True)
    if precision == "int4" and "op_types_to_quantize" not in extra:
        # The embedding Gather too (GatherBlockQuantized): tied models share the LM head's
        # 4-bit weights, untied ones get their own 4-bit table.
        extra = {**extra, "op_types_to_quantize": "MatMul/Gather"}
    # The builder, through the shim that rewrites configs it cannot read (builder_shim).
    cmd = [sys.executable, "-m", "specedge.exporter.builder_shim", "-i", str(hf_dir),
           "-o", str(out), "-p", _BUILDER_PRECISION[precision], "-e", provider,
           "-c", str(cache)]
    if extra:
        cmd += ["--extra_options", *[f"{k}={v}" for k, v in extra.items()]]
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    with open(log_file, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode != 0 or not (out / "model.onnx").is_file():
        lines = [ln.strip() for ln in log_file.read_text(errors="replace").splitlines()
                 if ln.strip()]
        ours = [ln for ln in lines if ln.startswith(ERROR_PREFIX)]
        if proc.returncode == ERROR_EXIT and ours:  # the shim refused the input: say only that
            raise ExportError(ours[-1][len(ERROR_PREFIX):])
        last = lines[-1][:300] if lines else "no output"
        fd, kept = tempfile.mkstemp(prefix="specedge-builder-", suffix=".log")
        with os.fdopen(fd, "wb") as copy:
            copy.write(log_file.read_bytes())
        raise ExportError(f"{hf_dir}: the ONNX Runtime GenAI builder failed ({last}); "
                          f"full log: {kept}")
    cfg = json.loads((out / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    import onnx

    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    past0 = inputs[dec["inputs"]["past_key_names"] % 0]
    elem = past0.type.tensor_type.elem_type
    kv_dtype = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}.get(elem)
    if kv_dtype is None:
        raise ExportError(f"{out}: unsupported KV dtype {elem} in the builder's graph")
    if not any(n.op_type == "GroupQueryAttention" for n in model.graph.node):
        raise ExportError(
            f"{hf_dir}: the builder wrote no GroupQueryAttention graph for {precision} on "
            f"{provider}; use fp32/int8/int4 on cpu, or fp16 with --provider cuda"
        )
    return GraphInfo(
        onnx_path=out / "model.onnx",
        graph="gqa-shared",
        num_layers=int(dec["num_hidden_layers"]),
        num_kv_heads=int(dec["num_key_value_heads"]),
        head_dim=int(dec["head_size"]),
        max_seq_len=int(cfg["model"]["context_length"]),
        vocab_size=int(cfg["model"]["vocab_size"]),
        kv_dtype=kv_dtype,
        position_ids="position_ids" if "position_ids" in inputs else None,
        genai_config=cfg,
        min_cache_len=max([1] + [a.i for n in model.graph.node
                                 if n.op_type == "GroupQueryAttention"
                                 for a in n.attribute if a.name == "local_window_size"]),
    )


def concat_from_gqa(info: GraphInfo) -> GraphInfo:
    """Rewrite the builder's graph at `info.onnx_path` into the concat form, in place (its
    weights file is untouched); a graph already in the concat form is returned as it is.

    Raises:
        concat_form.RewriteUnsupported: soft-capping (use the torch export).
    """
    import onnx

    from .concat_form import POSITION_IDS, gqa_to_concat

    if info.graph == "concat":
        return info
    model = onnx.load(str(info.onnx_path), load_external_data=False)
    gqa_to_concat(model, info.head_dim)
    onnx.save(model, str(info.onnx_path))
    return dataclasses.replace(info, graph="concat", position_ids=POSITION_IDS, min_cache_len=1)


def export_concat(hf_dir: Path, out: Path, arch: ArchSpec, precision: str) -> GraphInfo:
    """Export with torch.onnx (standard ops, concat KV) for families the builder lacks."""
    import torch
    from transformers import AutoConfig

    from .checkpoint import load_complete

    if precision not in ("fp32",):
        raise ExportError(f"{arch.model_type}: the concat form exports fp32 only (then quantize "
                          "with --precision int8/int4 on the fp32 graph)")
    config = AutoConfig.from_pretrained(str(hf_dir))
    model = load_complete(hf_dir, dtype=torch.float32)
    model.eval()
    layers = config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    wrapper = _ConcatWrapper(model, layers)
    raw = out / "raw"  # torch's own file(s); rewritten below with one external data file
    raw.mkdir(parents=True, exist_ok=True)
    past = [torch.zeros(1, heads, 3, head_dim) for _ in range(2 * layers)]
    ids = torch.ones(1, 2, dtype=torch.long)
    mask = torch.ones(1, 5, dtype=torch.long)
    pos = torch.tensor([[3, 4]], dtype=torch.long)
    names_in = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for kv in ("key", "value") for i in range(layers)]
    names_out = ["logits"] + [f"present.{i}.{kv}" for kv in ("key", "value")
                              for i in range(layers)]
    dyn: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "new"}, "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "new"}, "logits": {0: "batch", 1: "new"}}
    for n in names_in[3:]:
        dyn[n] = {0: "batch", 2: "past"}
    for n in names_out[1:]:
        dyn[n] = {0: "batch", 2: "total"}
    with torch.no_grad():
        torch.onnx.export(wrapper, (ids, mask, pos, *past), str(raw / "model.onnx"),
                          input_names=names_in, output_names=names_out, dynamic_axes=dyn,
                          opset_version=17, dynamo=False)
    del wrapper, model, past
    gc.collect()  # the torch weights go before the ONNX weights are loaded
    save_external(raw / "model.onnx", out / "model.onnx")
    shutil.rmtree(raw, ignore_errors=True)
    return GraphInfo(
        onnx_path=out / "model.onnx", graph="concat", num_layers=layers, num_kv_heads=heads,
        head_dim=head_dim, max_seq_len=int(config.max_position_embeddings),
        vocab_size=int(config.vocab_size), kv_dtype="float32", position_ids="position_ids",
        genai_config=None)


def save_external(src: Path, dst: Path) -> None:
    """Re-save `src` as `dst` plus one `dst.name + ".data"` file holding every initializer.

    Any model size fits (protobuf's 2 GB limit applies to the graph only), and initializers
    that are byte-for-byte the same (a tied embedding and its constant-folded LM head transpose
    are not, but duplicated folds are) are stored once.
    """
    import onnx

    model = onnx.load(str(src), load_external_data=True)
    _dedupe_initializers(model)
    _tie_embedding(model)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.name + ".data", size_threshold=1024)


def _dedupe_initializers(model: Any) -> int:
    """Point every use of a duplicated initializer at its first copy; returns how many went."""
    import hashlib

    first: dict[tuple[int, tuple[int, ...], str], str] = {}
    rename: dict[str, str] = {}
    keep = []
    for init in model.graph.initializer:
        if len(init.raw_data) < 1024:
            keep.append(init)
            continue
        key = (init.data_type, tuple(init.dims), hashlib.sha256(init.raw_data).hexdigest())
        if key in first:
            rename[init.name] = first[key]
        else:
            first[key] = init.name
            keep.append(init)
    if not rename:
        return 0
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    return len(rename)


def _tie_embedding(model: Any) -> bool:
    """Store a tied embedding once: the torch exporter writes the embedding [vocab, hidden] for
    the Gather and its constant-folded transpose [hidden, vocab] for the LM head MatMul. The
    Gather is moved onto the transpose (axis 1, then a Transpose of the few gathered rows) and
    the [vocab, hidden] copy dropped. Returns whether it did."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    for node in list(model.graph.node):
        if node.op_type != "Gather" or node.input[0] not in inits:
            continue
        emb = inits[node.input[0]]
        if len(emb.dims) != 2 or any(a.name == "axis" and a.i != 0 for a in node.attribute):
            continue
        twin = [i for i in model.graph.initializer
                if list(i.dims) == list(emb.dims)[::-1] and i.data_type == emb.data_type]
        if not twin:
            continue
        table = numpy_helper.to_array(emb)
        match = next((t for t in twin if np.array_equal(numpy_helper.to_array(t), table.T)), None)
        if match is None:
            continue
        gathered = node.output[0] + "_hidden_first"
        uses = sum(name == emb.name for n in model.graph.node for name in n.input)
        index = list(model.graph.node).index(node)
        model.graph.node.remove(node)
        model.graph.node.insert(index, helper.make_node(
            "Gather", [match.name, node.input[1]], [gathered], name=node.name, axis=1))
        model.graph.node.insert(index + 1, helper.make_node(
            "Transpose", [gathered], [node.output[0]], name=node.name + "_tied_transpose",
            perm=[1, 2, 0]))  # [hidden, batch, seq] -> [batch, seq, hidden]
        if uses == 1:
            model.graph.initializer.remove(emb)
        return True
    return False


class _ConcatWrapper:  # a torch.nn.Module is created lazily to keep torch out of module import
    def __new__(cls, model: Any, layers: int) -> Any:
        import torch
        from transformers import DynamicCache

        class Wrapper(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any,
                        *past: Any) -> Any:
                cache = DynamicCache()
                for i in range(layers):
                    cache.update(past[i], past[layers + i], i)
                out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=cache, use_cache=True)
                kv = out.past_key_values
                keys = [kv.layers[i].keys for i in range(layers)]
                values = [kv.layers[i].values for i in range(layers)]
                return (out.logits, *keys, *values)

        return Wrapper()


def move_model(src_onnx: Path, dest_dir: Path) -> list[Path]:
    """Move model.onnx and its external data file(s) into `dest_dir`."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    moved = []
    for f in sorted(src_onnx.parent.iterdir()):
        if f.name == src_onnx.name or f.name.startswith(src_onnx.name + ".") or f.suffix == ".data":
            shutil.move(str(f), str(dest_dir / f.name))
            moved.append(dest_dir / f.name)
    return moved
