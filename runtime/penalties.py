"""Logit bias and repetition, presence and frequency penalties, exact under speculation.

`penalize` adjusts a block of target logits (or one row of draft logits) as `SamplingParams`
asks: OpenAI's ``logit_bias``, the CTRL repetition penalty over the prompt and the output, and
OpenAI's presence and frequency penalties over the output; `suppress_stops` bans the tokens that
end a generation before vLLM's ``min_tokens``. Row i of a verification block is
adjusted for exactly the output before it (the history and the first i drafts), so each row is
what target-only decoding would have seen at that position, and speculative output stays the
target's (greedy: token for token). Pure numpy; nothing here is random.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .sampling import SamplingParams

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

__all__ = ["penalize", "prompt_tokens", "suppress_stops"]


def prompt_tokens(prompt: npt.ArrayLike, params: SamplingParams) -> IntArray:
    """The distinct prompt tokens the repetition penalty counts (none when it is off): what a
    row keeps once, so that each round need not re-read a long prompt."""
    if float(params.repetition_penalty) == 1.0:
        return np.zeros(0, np.int64)
    return np.unique(np.asarray(prompt, np.int64))


def _bias(out: FloatArray, params: SamplingParams) -> None:
    ids = np.asarray([t for t, _ in params.logit_bias], np.int64)
    values = np.asarray([b for _, b in params.logit_bias], np.float64)
    keep = ids < out.shape[1]
    out[:, ids[keep]] += values[keep]


def _repeat(out: FloatArray, prompt: IntArray, before: IntArray, block: IntArray,
            penalty: float) -> None:
    """Row i: every token of the prompt, the history and the first i drafts, once."""
    vocab = out.shape[1]
    seen = np.union1d(prompt, before)
    for i in range(out.shape[0]):
        ids = np.union1d(seen, block[:i])
        ids = ids[ids < vocab]
        v = out[i, ids]
        out[i, ids] = np.where(v > 0, v / penalty, v * penalty)


def _presence_frequency(out: FloatArray, before: IntArray, block: IntArray,
                        params: SamplingParams) -> None:
    """OpenAI's formula, row i counting the history and the first i drafts: ``logit[t] -=
    frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``."""
    n, vocab = out.shape
    ids, where = np.unique(np.concatenate([before, block]), return_inverse=True)
    counts = np.zeros((n, len(ids)), np.int64)
    for i in range(n):
        np.add.at(counts[i], where[:len(before) + i], 1)
    penalty = (float(params.frequency_penalty) * counts
               + float(params.presence_penalty) * (counts > 0))
    out[:, ids[ids < vocab]] -= penalty[:, ids < vocab]


def penalize(logits: npt.ArrayLike, history: npt.ArrayLike, drafts: npt.ArrayLike,
             params: SamplingParams, prompt: npt.ArrayLike = ()) -> FloatArray:
    """Apply the logit bias, then the repetition penalty, then the presence and frequency
    penalties to a verification block's logits (this order is vLLM's).

    Args:
        logits: ``[n, vocab]`` the block's logits; row i scores the output position after
            ``history`` and ``drafts[:i]``.
        history: the output's tokens before the block (not the prompt's).
        drafts: ``[n - 1]`` (or more: only the first ``n - 1`` are read) the block's drafts.
        params: what to apply (no copy is made when nothing is set: `adjusts_logits`).
        prompt: the prompt's tokens (only the repetition penalty reads them; `prompt_tokens`
            gives them once).

    Returns:
        ``[n, vocab]`` float64 logits.
    """
    arr = np.asarray(logits)
    if not params.adjusts_logits:
        return arr  # type: ignore[return-value]
    out = np.array(arr, dtype=np.float64)  # [n, vocab]
    before = np.asarray(history, np.int64)
    block = np.asarray(drafts, np.int64)[:max(0, out.shape[0] - 1)]
    if params.logit_bias:
        _bias(out, params)
    if float(params.repetition_penalty) != 1.0:
        _repeat(out, np.asarray(prompt, np.int64), before, block,
                float(params.repetition_penalty))
    if float(params.presence_penalty) != 0.0 or float(params.frequency_penalty) != 0.0:
        _presence_frequency(out, before, block, params)
    return out


def suppress_stops(logits: npt.ArrayLike, position: int, min_tokens: int,
                   stop_ids: IntArray) -> FloatArray:
    """Ban the tokens that end a generation (`stop_ids`) from rows whose output position is
    below `min_tokens` (row i of a block is position ``position + i``). A row where they are
    all that is left (a grammar that can only end) keeps them, so it can end."""
    out = np.asarray(logits)
    rows = min(out.shape[0], max(0, min_tokens - position))
    if not rows or not len(stop_ids):
        return out  # type: ignore[return-value]
    out = np.array(out, dtype=np.float64)
    keep = np.ones(out.shape[1], bool)
    keep[stop_ids[stop_ids < out.shape[1]]] = False
    for i in range(rows):
        if np.isfinite(out[i, keep]).any():
            out[i, ~keep] = -np.inf
    return out
