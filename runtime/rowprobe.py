"""Does a model compute a position alike in a decode step and in a verification block?

Speculative decoding reproduces target-only decoding token for token only if the target's
logits for a position do not depend on how many tokens the call fed. Measured on ONNX Runtime
1.32's CPU kernels (docs/results/batch_invariance.md): every call of two or more new tokens gives
bit-identical logits, whatever its width, but a one-token call after a past does not — layer 0's
GroupQueryAttention output is one float ulp away, fp32 models carry that as ~4e-5 logits, and
int8 activation quantization (MatMulNBits at accuracy level 4: int4 / int8 targets) amplifies it
to ~0.6 logits, enough to change greedy tokens. A per-tensor dynamic activation scale (QDQ int8)
is not invariant even between blocks.

`probe_rows` measures a model when a pair loads; `RowProbe` holds what it measured and decides
whether the model's one-token steps should run as two rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import ModelError
from .kvcache import KVCache

if TYPE_CHECKING:
    from .backend import OrtModel

log = logging.getLogger(__name__)

ROW_TOLERANCE = 1e-3  # logit differences under this x the logits' scale are rounding
# Pasts the row probe computes a position after (`probe_rows`), per device: GPU kernels
# change their split of the keys with the past's length (CUDA's did between 34 and 66 on the
# H200); the CPU's one-row difference shows after a short past already, and a long one would add
# ~0.5 s to loading the reference pair on a small CPU.
# (66 and 130: the pasts at which the H200's steps differed, diag `exact`, the same tokens.)
ROW_PROBE_PASTS = {"cpu": (4,), "cuda": (4, 66, 130)}


@dataclass(frozen=True)
class RowProbe:
    """How a model's logits for one position depend on how many rows the call had.

    Attributes:
        single: the largest |logit| difference between a one-token step and the same position
            computed as the second row of a two-token block.
        block: the same between a two-token and a three-token block (several-row calls).
        scale: the largest |logit| there (differences are judged relative to it).
    """

    single: float
    block: float
    scale: float

    @classmethod
    def worst(cls, probes: Sequence[RowProbe]) -> RowProbe:
        """One verdict over probes at several pasts: the largest differences, judged against
        the smallest logits' scale (a difference at any past is enough to flip a near-tie)."""
        return cls(single=max(p.single for p in probes), block=max(p.block for p in probes),
                   scale=min(p.scale for p in probes))

    @property
    def blocks_agree(self) -> bool:
        """Several-row calls give the same logits (to rounding) whatever their width."""
        return self.block <= ROW_TOLERANCE * self.scale

    @property
    def needs_two_rows(self) -> bool:
        """One-row calls differ beyond rounding and several-row calls agree: running every
        step with at least two rows makes decoding and verification the same computation."""
        return self.single > ROW_TOLERANCE * self.scale and self.blocks_agree

    def describe(self) -> str:
        if self.needs_two_rows:
            return (f"steps run as two rows (a one-row step differs by {self.single:.2g} "
                    f"logits from a block; blocks agree to {self.block:.1g})")
        if not self.blocks_agree:
            return (f"not batch-invariant: blocks of 2 and 3 rows differ by {self.block:.2g} "
                    "logits, so greedy speculation can differ from target-only")
        return f"batch-invariant (one row vs a block: {self.single:.1g} logits)"


def probe_rows(model: OrtModel) -> RowProbe | None:
    """Compute one position alone, as the second row of a two-token block and as the third
    of a three-token one (fresh caches, plain runs, arbitrary tokens) after the pasts of
    `ROW_PROBE_PASTS` (a short one, and on a GPU longer ones), and compare its logits; None
    when the model's context is shorter than five tokens, or when it cannot run them (NaN
    logits, say: its first generation then reports why).

    The long pasts matter on GPUs: on the H200, the CUDA EP's kernels computed a
    one-token step exactly as a block after 6, 18 and 34 past tokens, but not after 66 or 130
    (docs/results/gpu_diag.md), and greedy speculation then differed at fp16 near-ties."""
    spec = model.spec
    if spec.max_seq_len < 5:
        return None
    probes = []
    on, model.two_row_steps = model.two_row_steps, False
    try:
        pasts = ROW_PROBE_PASTS[model.config.device]
        for n in sorted({min(past + 1, spec.max_seq_len) for past in pasts}):
            probes.append(_probe_at(model, n))
    except ModelError as exc:
        log.debug("row probe of the %s model skipped: %s", model.name, exc)
        return None
    finally:
        model.two_row_steps = on
    return RowProbe.worst(probes)


def _probe_at(model: OrtModel, n: int) -> RowProbe:
    """The row probe on `n` arbitrary tokens: the last one alone after n - 1, and as the
    last row of blocks of two and three."""
    spec = model.spec
    ids = (np.arange(n, dtype=np.int64) * 7919 + 11) % spec.vocab_size
    # At least the cache a generation gets (a sliding-window model refuses a shorter one).
    length = min(spec.max_seq_len, max(n, spec.min_cache_len))

    def last(split: int) -> np.ndarray:
        cache = KVCache(model, 1, length, fixed=False)
        model.forward(cache, ids[None, :split])
        return model.forward(cache, ids[None, split:])[0, -1].astype(np.float64)

    alone, two, three = last(n - 1), last(n - 2), last(n - 3)
    return RowProbe(single=float(np.abs(alone - two).max()),
                    block=float(np.abs(two - three).max()),
                    scale=float(np.abs(two).max()))
