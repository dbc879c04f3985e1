"""Exact greedy argmaxes from an int8 copy of the output head.

A decode step streams every weight once; the output head (hidden -> vocabulary) is a large
share of a small model's (113 of SmolLM2-135M's 540 MB). Greedy decoding needs only the argmax,
so a model whose head the exporter split off (`exporter/split_head.py`, manifest `head`) takes
it in two passes:

1. `shortlist.onnx`: ONNX Runtime's MatMulNBits with the head in int8 (a quarter of the bytes)
   gives approximate logits `approx` and a per-token bound `|exact - approx| <= bound` (from the
   weights' quantization error, the input's int8 rounding, and float rounding: see the
   exporter's module docstring); every token whose `approx + bound` reaches the best
   `approx - bound` is a candidate: the argmax is always among them.
2. The candidates' logits, exactly: their rows of the float head times the hidden state, in
   float64. The pick is the largest, ties to the lowest id (numpy's argmax rule). Both passes
   are one ONNX Runtime graph: after a decode step has streamed the weights through the caches,
   every numpy call on the host costs a tenth of a millisecond or more, so none is left here.

So the ids are the argmax of the logits computed without rounding from the model's hidden state;
the float32 head MatMul could pick otherwise only where two logits are within its own rounding
(~1e-6 relative). Sampling and `forward` use `head.onnx`, the head MatMul alone, whose logits are
the whole graph's bit for bit. `check` verifies the bound at load (random and outlier-heavy
inputs); a model fails over to the full head when it does not hold on this build of ONNX
Runtime (another CPU's int8 kernel could quantize its input more coarsely).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from .errors import ModelError
from .manifest import HeadSpec
from .providers import onnxruntime_too_old

log = logging.getLogger(__name__)

# Widest call that takes its argmaxes from the shortlist: the int8 head's cost grows by ~0.5 ms
# a row on the 2-core CPU (its int8 kernel is compute-bound past one row) while the float head
# reads its bytes once for any row count (docs/results/split_head.md); wider verification blocks
# take the argmax of the float head's logits.
MAX_ROWS = 4

class SplitHead:
    """The head of one model split off its body: full logits (`logits`) and exact greedy argmaxes
    from the int8 shortlist (`argmax`)."""

    def __init__(self, root: Path, spec: HeadSpec, options: ort.SessionOptions,
                 providers: list[Any]) -> None:
        self.spec = spec
        path = root / spec.logits
        try:
            self.full = ort.InferenceSession(str(path), options, providers=providers)
            path = root / spec.shortlist
            self.shortlist = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            fix = onnxruntime_too_old(ort.__version__) or \
                "re-export the pair, or run `specedge split-head --force` on it"
            raise ModelError(f"{path}: the split head could not load ({first}); {fix}") from None
        self.dtype = np.float16 if "16" in self.full.get_inputs()[0].type else np.float32
        self.max_rows = MAX_ROWS

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden `[batch, new, hidden_size]` -> logits `[batch, new, vocab]` (host, owned)."""
        out: np.ndarray = self.full.run(None, {"hidden": np.ascontiguousarray(hidden)})[0]
        return out

    def argmax(self, hidden: np.ndarray) -> np.ndarray:
        """hidden `[rows, hidden_size]` -> argmax ids `[rows]` int64, ties to the lowest id;
        -1 for a row whose hidden state or best logit is not finite."""
        out: np.ndarray = self.shortlist.run(["ids"], {"hidden": np.ascontiguousarray(
            hidden, dtype=self.dtype)})[0]
        return out

    def check(self, seed: int = 0) -> float:
        """The largest |logit - approx| / bound over the whole vocabulary for a few inputs; under
        1 when this build of ONNX Runtime's int8 kernel rounds its input per block of 32 as the
        bound assumes. Besides random inputs (some with outlier channels), one input is made to
        break a coarser rounding: a large first block and, elsewhere, values just under what a
        whole-row int8 step rounds to zero, signed as the largest head row, whose logit then
        misses the bound about threefold if the kernel quantized per row."""
        rng = np.random.default_rng(seed)
        size = self.spec.hidden_size
        inputs = rng.standard_normal((5, size))
        inputs[1, rng.choice(size, 3, replace=False)] *= 40.0  # outlier channels
        inputs[2] = rng.uniform(-3, 3, size)
        inputs[3] *= rng.random(size) < 0.1  # sparse
        probe = self.logits(np.eye(size, dtype=self.dtype)[None])[0]  # [hidden, vocab]: rows^T
        row = probe[:, int(np.abs(probe).sum(0).argmax())].astype(np.float64)
        big = 100.0
        inputs[4] = 0.9 * big / 254 * np.sign(row)
        inputs[4, :32] = big * np.sign(row[:32])
        hidden = inputs.astype(self.dtype)
        approx, b_hidden, b_input = self.shortlist.run(["approx", "b_hidden", "b_input"],
                                                       {"hidden": hidden})
        exact = self.logits(hidden[:, None, :])[:, 0].astype(np.float64)
        return float((np.abs(exact - approx) / (b_hidden + b_input)).max())
