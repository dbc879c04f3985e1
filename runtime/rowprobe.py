"""Does a model compute a position alike in a decode step and in a verification block?

Speculative decoding reproduces target-only decoding token for token only if the target's
logits for a position do not depend on how many tokens the call fed. Measured on ONNX Runtime
1.32's CPU kernels (docs/results/batch_invariance.md): every call of two or more new tokens gives
bit-identical logits, whatever its width, but a one-token call after a past does not — layer 0's
GroupQueryAttention output is one float ulp away, fp32 models carry that as ~4e-5 logits, and
int8 activation quantization (MatMulNBits at accuracy level 4: int4 / int8 targets) amplifies it
to ~0.6 logits, enough to change greedy tokens. A per-tensor dynamic activation scale (QDQ int8)
is not invariant even between blocks.

`RowProbe` holds what `OrtModel.probe_rows` measured and decides whether a model's one-token
steps should run as two rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROW_TOLERANCE = 1e-3  # logit differences under this x the logits' scale are rounding


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
