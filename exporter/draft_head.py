"""A draft whose LM head covers only a subset of the vocabulary (the most frequent tokens).

The LM head of a small model is a large share of a draft step (SmolLM2-135M: 576 x 49152, about a
fifth of the multiply-adds). Keeping only the V' most frequent tokens of calibration text makes
every draft step cheaper. Exactness is kept: the draft's distribution is still a valid
distribution over the full vocabulary (zero outside the subset), and the rejection rule only
needs the probability the draft actually sampled from. Tokens outside the subset are never
proposed, which costs acceptance when the target wants them; `specedge draft` measures both.

The graph surgery handles an LM head that is a MatMulNBits (int4/int8 weight-only, weights
`[N, blocks, blob]`, scales `[N, blocks]`, optional zero points) or a plain MatMul (`[K, N]`).
Weights shared with the embedding (tied) are copied, never changed in place.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from specedge.runtime.errors import ExportError


def frequent_tokens(token_streams: Iterable[list[int]], size: int, vocab_size: int,
                    always: Iterable[int] = ()) -> np.ndarray:
    """The `size` most frequent token ids (sorted), always including `always` (eos, ...)."""
    counts: Counter[int] = Counter()
    for stream in token_streams:
        counts.update(stream)
    keep = set(int(t) for t in always)
    for token, _ in counts.most_common():
        if len(keep) >= size:
            break
        keep.add(int(token))
    # Fill up with the lowest ids (bytes and common merges in BPE vocabularies) if text ran out.
    fill = iter(range(vocab_size))
    while len(keep) < min(size, vocab_size):
        keep.add(next(fill))
    return np.asarray(sorted(keep), dtype=np.int64)


def restrict_lm_head(src: Path, dst: Path, keep: np.ndarray, logits: str = "logits") -> None:
    """Write a copy of the ONNX model at `src` whose `logits` cover only the ids in `keep`."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    inits = {i.name: i for i in model.graph.initializer}
    node = next((n for n in model.graph.node if logits in n.output), None)
    if node is None or node.op_type not in ("MatMulNBits", "MatMul"):
        raise ExportError(f"{src}: the logits come from {node.op_type if node else 'nothing'}, "
                          "not a MatMul/MatMulNBits LM head; cannot restrict the vocabulary")
    size = len(keep)

    def add(name: str, array: np.ndarray) -> str:
        new = f"{name}.vocab{size}"
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), new))
        return new

    if node.op_type == "MatMulNBits":
        for slot in (1, 2, 3):  # weights [N, blocks, blob], scales [N, blocks], zero points
            if slot < len(node.input) and node.input[slot] in inits:
                full = numpy_helper.to_array(inits[node.input[slot]])
                rows = full.reshape(-1, *full.shape[1:]) if slot == 1 else full
                if slot > 1 and rows.ndim == 1:  # flat [N * blocks] layouts
                    rows = rows.reshape(-1, rows.size // int(_attr(node, "N")))
                    node.input[slot] = add(node.input[slot], rows[keep].reshape(-1))
                    continue
                node.input[slot] = add(node.input[slot], rows[keep])
        for attr in node.attribute:
            if attr.name == "N":
                attr.i = size
    else:
        weight = node.input[1]
        if weight not in inits:
            raise ExportError(f"{src}: the LM head weight {weight!r} is not a constant")
        full = numpy_helper.to_array(inits[weight])
        node.input[1] = add(weight, full[:, keep])
    for out in model.graph.output:
        if out.name == logits:
            out.type.tensor_type.shape.dim[-1].Clear()
            out.type.tensor_type.shape.dim[-1].dim_value = size
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.name + ".data")


def _attr(node: object, name: str) -> int:
    for attr in node.attribute:  # type: ignore[attr-defined]
        if attr.name == name:
            return int(attr.i)
    raise ExportError(f"MatMulNBits node without attribute {name}")
