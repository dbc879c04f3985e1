"""Log-probabilities of generated tokens, as OpenAI's `logprobs` / `top_logprobs` report them.

A token's log-probability is read from the target's logits at the position that produced it:
the verification block for accepted drafts and for the corrected or bonus token, the prefill's
last position for the first token. It is the model's own distribution (log-softmax of the raw
logits, before temperature, top-k, top-p or min-p), as vLLM reports by default, so it is the
same whatever the sampling parameters, the drafter and K: speculative decoding changes no
figure beyond the rounding of a K+1-position call against a one-position call.

Pure functions over numpy arrays; the decode loops call `token_logprobs` on the rows they
already hold (a row that asks for logprobs gets its logits on the host, greedy or not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprob", "log_softmax", "token_logprobs"]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for `top_logprobs`


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and, when asked, the most likely alternatives.

    Attributes:
        token: the generated token id.
        logprob: its natural-log probability under the target's distribution.
        top: the `top_logprobs` most likely token ids with their log-probabilities, most likely
            first (ties: the lower id first); empty when none were asked for.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64 (stable: the row maximum is taken out
    before exponentiating)."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))  # type: ignore[no-any-return]


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int = 0
                   ) -> list[TokenLogprob]:
    """The log-probabilities of `tokens` `[n]`, each from its row of `logits` `[n, vocab]`
    (float16 or float32; computed in float64), with the `top` most likely tokens of each row.

    Raises:
        ValueError: `logits` and `tokens` disagree in length, or `top` is outside
            [0, MAX_TOP_LOGPROBS].
    """
    rows = np.asarray(logits)
    if rows.ndim != 2 or rows.shape[0] != len(tokens):
        raise ValueError(f"{len(tokens)} tokens need logits [{len(tokens)}, vocab], got "
                         f"{rows.shape}")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    lp = log_softmax(rows)  # [n, vocab]
    out = []
    for i, token in enumerate(tokens):
        best: tuple[tuple[int, float], ...] = ()
        if top:
            row = lp[i]
            # the `top` largest, then sorted by value (stable: the lower id first on a tie)
            cand = np.argpartition(-row, top - 1)[:top] if top < row.size else np.arange(row.size)
            cand = np.sort(cand)
            order = cand[np.argsort(-row[cand], kind="stable")]
            best = tuple((int(t), float(row[t])) for t in order)
        out.append(TokenLogprob(int(token), float(lp[i, int(token)]), best))
    return out
