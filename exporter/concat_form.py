"""The model builder's graph, rewritten into the concat form: batched verification, fused ops.

ONNX Runtime's GroupQueryAttention (CPU and CUDA) refuses batch > 1 with several new tokens
after a past (`docs/gpu_batching.md`), so batched speculative decoding needs a graph whose
attention is ordinary tensor math under an attention mask: the concat form (`present =
Concat(past, new)`). torch.onnx writes one, but with ~7,600 nodes for SmolLM2-135M: unfused
RMSNorm, rotary and attention, and per-layer shape arithmetic that ONNX Runtime runs on the CPU
provider (~400 Gather/Unsqueeze/Concat per call; on an H200 10-16 ms a call at any batch,
`docs/results/gpu_findings.md`).

This module keeps everything the builder wrote (its fused norms, packed QKV, MatMulNBits
weights, fp16 for CUDA) and replaces only each GroupQueryAttention node with:

    q, k, v  = Split(qkv)                                   # [B, S, H*D], [B, S, Hkv*D] x2
    q, k     = RotaryEmbedding(q / k, position_ids)         # com.microsoft, as GQA's do_rotary
    present  = Concat(past, Transpose(Reshape(k/v)))        # [B, Hkv, T, D]
    q        = Reshape(Transpose(Reshape(q, [B,S,Hkv,G,D])), [B, Hkv, G*S, D]) * scale
    out      = Softmax(q @ present_k^T + bias) @ present_v  # [B, Hkv, G*S, D]
    out      = Reshape(Transpose(Reshape(out, [B,Hkv,G,S,D])), [B, S, H*D])

Every Reshape target is a constant (0 copies a dimension, -1 infers one), so no layer has shape
arithmetic. One mask bias per call, shared by all layers: key t is visible to new token s of
row b when attention_mask[b, t] = 1 and t <= T - S + s (the runtime pads the rows' pasts to
the longest with mask holes and puts every row's new tokens at the end; `forward_rows`). It is
tiled over the G query heads of each KV head: [B, 1, G*S, T]. The graph gets the concat form's
inputs and outputs (`input_ids`, `attention_mask`, `position_ids`, `past_key_values.{i}.*`
[B, Hkv, P, D] -> `present.{i}.*` [B, Hkv, P+S, D], `logits`).

Sliding windows (GroupQueryAttention's local_window_size) get a second bias: key t is also
within the window of new token s when position_ids[b, s] - (its true position) < window, the
true position counting the row's unmasked keys (CumSum of the mask), so holes do not shorten the
window. Refused with RewriteUnsupported (the caller falls back to the torch export): logit
soft-capping (Gemma 2).
"""

from __future__ import annotations

from typing import Any

from specedge.runtime.errors import ExportError

POSITION_IDS = "position_ids"
_PREFIX = "/specedge/concat"


class RewriteUnsupported(ExportError):
    """The builder's graph uses an attention feature the rewrite does not build."""


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _dtype_of(model: Any, name: str) -> int:
    for vi in list(model.graph.input) + list(model.graph.value_info):
        if vi.name == name:
            return int(vi.type.tensor_type.elem_type)
    raise ExportError(f"the builder's graph has no type for {name!r}")


def _rotary_dim(model: Any, cos_cache: str) -> int:
    """The rotated width: twice the cos cache's. The builder's cache is an initializer, or (long
    RoPE) the output of an If choosing between two caches of the same width."""
    from onnx import helper

    def widths_of(graph: Any, name: str) -> set[int]:  # an initializer or a Constant's value
        found = {int(i.dims[1]) for i in graph.initializer if i.name == name and len(i.dims) == 2}
        for n in graph.node:
            if n.op_type == "Constant" and name in n.output:
                found |= {int(a.t.dims[1]) for a in n.attribute
                          if a.name == "value" and len(a.t.dims) == 2}
        return found

    widths = widths_of(model.graph, cos_cache)
    for node in model.graph.node:  # long RoPE: If(long) then one cache else the other
        if node.op_type == "If" and cos_cache in node.output:
            at = list(node.output).index(cos_cache)
            for branch in node.attribute:
                sub = helper.get_attribute_value(branch)
                widths |= widths_of(sub, sub.output[at].name)
    if len(widths) != 1:
        raise RewriteUnsupported(f"{cos_cache}: cannot tell the rotary width")
    return 2 * widths.pop()


def gqa_to_concat(model: Any, head_dim: int) -> Any:
    """Rewrite a model-builder graph (GroupQueryAttention, shared KV buffers) of head size
    `head_dim` into the concat form, in place; returns the model. A graph without
    GroupQueryAttention is returned as is.

    Raises:
        RewriteUnsupported: soft-capping (see the module docstring).
        ExportError: the graph is not the builder's (its inputs are not where expected).
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    gqas = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    if not gqas:
        return model
    for gqa in gqas:
        attrs = _attrs(gqa)
        if float(attrs.get("softcap", 0.0)) != 0.0:
            raise RewriteUnsupported(f"{gqa.name}: attention logit soft-capping")
    dtype = _dtype_of(model, gqas[0].input[3])  # the past key's type: fp32 or fp16
    np_dtype = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    inputs = {i.name for i in graph.input}
    for required in ("input_ids", "attention_mask"):
        if required not in inputs:
            raise ExportError(f"the builder's graph has no {required!r} input")
    if POSITION_IDS not in inputs:
        graph.input.append(helper.make_tensor_value_info(
            POSITION_IDS, TensorProto.INT64, ["batch_size", "sequence_length"]))

    new_nodes: list[Any] = []
    new_inits: list[Any] = []

    def const(name: str, value: Any) -> str:
        full = f"{_PREFIX}/const/{name}"
        if not any(i.name == full for i in new_inits):
            new_inits.append(numpy_helper.from_array(np.asarray(value), full))
        return full

    def node(op: str, ins: list[str], name: str, domain: str = "", **kw: Any) -> str:
        out = f"{_PREFIX}/{name}/output_0"
        new_nodes.append(helper.make_node(op, ins, [out], name=f"{_PREFIX}/{name}",
                                          domain=domain, **kw))
        return out

    # The mask bias, once per call: [B, 1, S, T] (0 where visible, the lowest value elsewhere).
    s_len = node("Shape", ["input_ids"], "mask/new", start=1, end=2)  # [1]
    t_len = node("Shape", ["attention_mask"], "mask/total", start=1, end=2)  # [1]
    s_scalar = node("Squeeze", [s_len, const("axes0", np.array([0], np.int64))], "mask/s")
    t_scalar = node("Squeeze", [t_len, const("axes0", np.array([0], np.int64))], "mask/t")
    one = const("one", np.array(1, np.int64))
    zero = const("zero", np.array(0, np.int64))
    past = node("Sub", [t_scalar, s_scalar], "mask/past")
    q_at = node("Range", [past, t_scalar, one], "mask/q_at")  # [S]: T-S .. T-1
    k_at = node("Range", [zero, t_scalar, one], "mask/k_at")  # [T]
    causal = node("LessOrEqual", [
        node("Unsqueeze", [k_at, const("axes0", np.array([0], np.int64))], "mask/k_row"),
        node("Unsqueeze", [q_at, const("axes1", np.array([1], np.int64))], "mask/q_col"),
    ], "mask/causal")  # [S, T]
    keys = node("Cast", [node("Unsqueeze", ["attention_mask", const("axes12", np.array(
        [1, 2], np.int64))], "mask/keys4")], "mask/keys", to=TensorProto.BOOL)  # [B, 1, 1, T]
    visible = node("And", [causal, keys], "mask/visible")  # [B, 1, S, T]
    bias = node("Where", [visible, const("bias_open", np.array(0, np_dtype)),
                          const("bias_shut", np.array(np.finfo(np_dtype).min, np_dtype))],
                "mask/bias")
    biases: dict[int, str] = {0: bias}
    tiled: dict[tuple[int, int], str] = {}

    def windowed(window: int) -> str:  # [B, 1, S, T], keys within `window` positions too
        if window not in biases:
            # True positions, not indices: a row's past is padded with holes (masked keys).
            k_pos = node("Sub", [node("CumSum", [node("Cast", [
                "attention_mask"], "mask/mask64", to=TensorProto.INT64), one], "mask/count"),
                one], "mask/k_pos")  # [B, T]
            k_pos4 = node("Unsqueeze", [k_pos, const("axes12", np.array([1, 2], np.int64))],
                          "mask/k_pos4")  # [B, 1, 1, T]
            q_pos4 = node("Unsqueeze", [POSITION_IDS, const("axes13", np.array(
                [1, 3], np.int64))], "mask/q_pos4")  # [B, 1, S, 1]
            near = node("Less", [node("Sub", [q_pos4, k_pos4], f"mask/dist{window}"),
                                 const(f"window{window}", np.array(window, np.int64))],
                        f"mask/near{window}")  # HF: a key is seen while q - k < window
            biases[window] = node("Where", [
                node("And", [visible, near], f"mask/visible_w{window}"),
                const("bias_open", np.array(0, np_dtype)),
                const("bias_shut", np.array(np.finfo(np_dtype).min, np_dtype))],
                f"mask/bias_w{window}")
        return biases[window]

    def bias_for(groups: int, window: int) -> str:  # [B, 1, G*S, T]: row g*S + s is token s
        base = windowed(max(window, 0))
        if groups == 1:
            return base
        if (groups, window) not in tiled:
            tiled[groups, window] = node("Tile", [base, const(f"tile{groups}", np.array(
                [1, 1, groups, 1], np.int64))], f"mask/bias_g{groups}_w{max(window, 0)}")
        return tiled[groups, window]

    replaced: dict[str, list[Any]] = {}
    for gqa in gqas:
        attrs = _attrs(gqa)
        heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
        groups = heads // kv_heads
        ins = list(gqa.input) + [""] * (9 - len(gqa.input))
        past_k, past_v = ins[3], ins[4]
        scale = float(attrs.get("scale", 0.0)) or 1.0 / float(np.sqrt(head_dim))
        base = gqa.name.strip("/").replace("/", "_")
        start = len(new_nodes)
        if ins[1]:
            q, k, v = ins[0], ins[1], ins[2]
        else:  # packed QKV: [B, S, (H + 2 Hkv) * D]
            split = f"{_PREFIX}/{base}/qkv"
            q, k, v = (f"{split}/q", f"{split}/k", f"{split}/v")
            new_nodes.append(helper.make_node(
                "Split", [ins[0], const(f"split_{heads}_{kv_heads}_{head_dim}", np.array(
                    [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64))],
                [q, k, v], name=split, axis=-1))
        if int(attrs.get("do_rotary", 0)):
            rot_dim = _rotary_dim(model, ins[7])
            extra = {} if rot_dim == head_dim else {"rotary_embedding_dim": rot_dim}
            interleaved = int(attrs.get("rotary_interleaved", 0))
            q = node("RotaryEmbedding", [q, POSITION_IDS, ins[7], ins[8]], f"{base}/rotary_q",
                     domain="com.microsoft", interleaved=interleaved, num_heads=heads, **extra)
            k = node("RotaryEmbedding", [k, POSITION_IDS, ins[7], ins[8]], f"{base}/rotary_k",
                     domain="com.microsoft", interleaved=interleaved, num_heads=kv_heads,
                     **extra)
        kv_shape = const(f"kv_shape_{kv_heads}_{head_dim}",
                         np.array([0, 0, kv_heads, head_dim], np.int64))
        bhsd = [0, 2, 1, 3]
        k4 = node("Transpose", [node("Reshape", [k, kv_shape], f"{base}/k_heads")],
                  f"{base}/k_bhsd", perm=bhsd)
        v4 = node("Transpose", [node("Reshape", [v, kv_shape], f"{base}/v_heads")],
                  f"{base}/v_bhsd", perm=bhsd)
        new_nodes.append(helper.make_node("Concat", [past_k, k4], [gqa.output[1]],
                                          name=f"{_PREFIX}/{base}/present_k", axis=2))
        new_nodes.append(helper.make_node("Concat", [past_v, v4], [gqa.output[2]],
                                          name=f"{_PREFIX}/{base}/present_v", axis=2))
        q5 = node("Reshape", [q, const(f"q_shape_{kv_heads}_{groups}_{head_dim}", np.array(
            [0, 0, kv_heads, groups, head_dim], np.int64))], f"{base}/q_heads")  # [B,S,Hkv,G,D]
        q4 = node("Reshape", [
            node("Transpose", [q5], f"{base}/q_groups", perm=[0, 2, 3, 1, 4]),  # [B,Hkv,G,S,D]
            const(f"rows_{head_dim}", np.array([0, 0, -1, head_dim], np.int64))],
            f"{base}/q_rows")  # [B, Hkv, G*S, D]
        q4 = node("Mul", [q4, const(f"scale_{scale!r}", np.array(scale, np_dtype))],
                  f"{base}/q_scaled")
        keys_t = node("Transpose", [gqa.output[1]], f"{base}/k_t", perm=[0, 1, 3, 2])
        window = int(attrs.get("local_window_size", -1))
        mask_start = len(new_nodes)
        layer_bias = bias_for(groups, window)
        shared = new_nodes[mask_start:]  # built on first use: the call's mask nodes
        del new_nodes[mask_start:]
        new_nodes[start:start] = shared
        scores = node("Add", [node("MatMul", [q4, keys_t], f"{base}/scores"),
                              layer_bias], f"{base}/masked")  # [B, Hkv, G*S, T]
        probs = node("Softmax", [scores], f"{base}/probs", axis=-1)
        ctx = node("MatMul", [probs, gqa.output[2]], f"{base}/context")  # [B, Hkv, G*S, D]
        ctx5 = node("Reshape", [ctx, const(f"ctx_shape_{groups}_{head_dim}", np.array(
            [0, 0, groups, -1, head_dim], np.int64))], f"{base}/context_groups")
        ctx_t = node("Transpose", [ctx5], f"{base}/context_bshgd", perm=[0, 3, 1, 2, 4])
        new_nodes.append(helper.make_node(
            "Reshape", [ctx_t, const("merge_heads", np.array([0, 0, -1], np.int64))],
            [gqa.output[0]], name=f"{_PREFIX}/{base}/output"))
        replaced[gqa.name] = new_nodes[start:]
        del new_nodes[start:]

    mask_nodes = list(new_nodes)
    rebuilt: list[Any] = []
    for n in graph.node:
        if n.op_type == "GroupQueryAttention":
            if mask_nodes:
                rebuilt.extend(mask_nodes)
                mask_nodes = []
            rebuilt.extend(replaced[n.name])
        else:
            rebuilt.append(n)
    del graph.node[:]
    graph.node.extend(rebuilt)
    graph.initializer.extend(new_inits)
    _present_dims(model)
    _prune(model)
    return model


def _present_dims(model: Any) -> None:
    """present.* is [B, Hkv, past + new, D]: name the sequence axis as the torch export does."""
    for vi in model.graph.output:
        if vi.name != "logits":
            dims = vi.type.tensor_type.shape.dim
            if len(dims) == 4:
                dims[2].Clear()
                dims[2].dim_param = "total_sequence_length"


def _prune(model: Any) -> None:
    """Drop nodes (and initializers) nothing reads any more: the builder's seqlens_k and
    total_sequence_length subgraph, which only GroupQueryAttention used."""
    graph = model.graph
    needed = {o.name for o in graph.output}
    keep = []
    for n in reversed(list(graph.node)):
        if any(o in needed for o in n.output if o):
            keep.append(n)
            needed.update(i for i in n.input if i)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    inits = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
