"""The speculative-decoding verification math, in pure numpy: sample a token, verify a block of
drafts greedily or by the rejection rule, and the residual and marginal distributions the
rule's exactness is stated with.

* Y. Leviathan, M. Kalman, Y. Matias. "Fast Inference from Transformers via Speculative
  Decoding". ICML 2023, arXiv:2211.17192.
* C. Chen, S. Borgeaud, G. Irving, J.-B. Lespiau, L. Sifre, J. Jumper. "Accelerating Large
  Language Model Decoding with Speculative Sampling". arXiv:2302.01318, 2023.

A draft token ``d`` drawn from the draft distribution is accepted with probability
``min(1, target[d] / draft[d])``; at the first rejection one token is drawn from the residual
distribution ``norm(max(0, target - draft))``; after a full accept a bonus token is drawn from the
target's next distribution. Every emitted token is then distributed exactly as the target
distribution, whatever the draft distribution is. The distributions come from
`sampling.warp_probs`.

Nothing here touches a global random state: every random function takes a
``numpy.random.Generator``, and a given generator state always gives the same output.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from .errors import InputError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

__all__ = [
    "accept_greedy",
    "accept_greedy_ids",
    "accept_greedy_rows",
    "accept_probability",
    "accept_sample",
    "accept_sample_rows",
    "first_token_marginal",
    "residual_probs",
    "sample_token",
]


def _check_probs_1d(probs: npt.ArrayLike, name: str) -> FloatArray:
    arr = np.asarray(probs, dtype=np.float64)
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise InputError(f"{name} must have shape [vocab] with vocab >= 1, got {arr.shape}")
    return arr


def _check_pair(draft_probs: npt.ArrayLike, target_probs: npt.ArrayLike
                ) -> tuple[FloatArray, FloatArray]:
    """Both distributions checked (`_check_probs_1d`) and of one shape."""
    draft = _check_probs_1d(draft_probs, "draft_probs")
    target = _check_probs_1d(target_probs, "target_probs")
    if draft.shape != target.shape:
        raise InputError(
            f"draft_probs and target_probs must have the same shape, "
            f"got {draft.shape} and {target.shape}"
        )
    return draft, target


def sample_token(probs: npt.ArrayLike, rng: np.random.Generator) -> int:
    """Draw one token id from a distribution by inverse CDF, with one ``rng.random()`` draw.

    The distribution need not be exactly normalized (the draw is scaled by its sum). A token of
    probability 0 is never drawn, even when rounding pushes the draw past the last CDF step.

    Args:
        probs: ``[vocab]`` non-negative probabilities with a positive, finite sum.
        rng: Random generator; exactly one ``rng.random()`` is consumed.

    Returns:
        The token id, in ``[0, vocab)``.

    Raises:
        InputError: If ``probs`` is not 1-D, has a negative or NaN entry, or sums to 0 or inf.
    """
    p = _check_probs_1d(probs, "probs")
    cdf = np.cumsum(p)
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0.0) or bool((p < 0.0).any()):
        raise InputError(
            f"probs must be non-negative with a positive finite sum, got sum {total!r}"
        )
    u = rng.random() * total
    idx = int(np.searchsorted(cdf, u, side="right"))
    if idx >= p.shape[0]:
        idx = int(np.flatnonzero(p)[-1])
    return idx


def residual_probs(target_probs: npt.ArrayLike, draft_probs: npt.ArrayLike) -> FloatArray:
    """Residual distribution ``norm(max(0, target - draft))`` sampled after a rejection.

    Args:
        target_probs: ``[..., vocab]`` target distribution(s).
        draft_probs: ``[..., vocab]`` draft distribution(s), same shape.

    Returns:
        ``[..., vocab]`` float64. Rows whose residual mass is 0 (draft == target) return the
        target row instead: a rejection cannot happen there, so any valid distribution works.

    Raises:
        InputError: If the shapes differ.
    """
    target = np.asarray(target_probs, dtype=np.float64)
    draft = np.asarray(draft_probs, dtype=np.float64)
    if target.shape != draft.shape or target.ndim < 1:
        raise InputError(
            f"target_probs and draft_probs must have the same shape [..., vocab], "
            f"got {target.shape} and {draft.shape}"
        )
    residual = np.maximum(target - draft, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    has_mass = mass > 0.0
    out: FloatArray = np.where(has_mass, residual / np.where(has_mass, mass, 1.0), target)
    return out


def accept_greedy(draft_tokens: npt.ArrayLike, target_logits: npt.ArrayLike) -> IntArray:
    """Greedy verification: keep drafts while they equal the target's argmax.

    Args:
        draft_tokens: ``[k]`` integer draft token ids (``k >= 0``).
        target_logits: ``[k + 1, vocab]`` target logits (or probabilities) at each draft
            position and one past the last.

    Returns:
        ``[a + 1]`` int64: the longest prefix of ``a`` drafts equal to the target argmax, then the
        target argmax at position ``a`` (the correction at the first mismatch, or the bonus
        token when ``a == k``).

    Raises:
        InputError: If the shapes do not match or a draft token is out of range.
    """
    drafts = _check_tokens(draft_tokens)
    logits = np.asarray(target_logits)
    k = drafts.shape[0]
    if logits.ndim != 2 or logits.shape[0] != k + 1 or logits.shape[1] < 1:
        raise InputError(
            f"target_logits must have shape [k + 1, vocab] = [{k + 1}, vocab], got {logits.shape}"
        )
    _check_token_range(drafts, logits.shape[1])
    return accept_greedy_ids(drafts, np.argmax(logits, axis=-1))


def accept_greedy_ids(draft_tokens: npt.ArrayLike, target_ids: npt.ArrayLike) -> IntArray:
    """Greedy verification from the target's argmax ids alone (what a device-side argmax
    returns): the same rule and result as `accept_greedy` on the logits they came from.

    Args:
        draft_tokens: ``[k]`` integer draft token ids.
        target_ids: ``[k + 1]`` the target's argmax at each draft position and one past the last.

    Returns:
        ``[a + 1]`` int64: the accepted drafts, then the target's token at position ``a``.

    Raises:
        InputError: If the shapes do not match.
    """
    drafts = _check_tokens(draft_tokens)
    best = np.asarray(target_ids).astype(np.int64)
    k = drafts.shape[0]
    if best.shape != (k + 1,):
        raise InputError(f"target_ids must have shape [k + 1] = [{k + 1}], got {best.shape}")
    if k == 0:  # a plain decode step
        return best[:1].copy()
    mismatch = np.flatnonzero(drafts != best[:k])
    accepted = int(mismatch[0]) if mismatch.size else k
    out: IntArray = best[: accepted + 1].copy()
    return out


def accept_greedy_rows(draft_tokens: IntArray, pick: Callable[[int], int]) -> IntArray:
    """`accept_greedy` with each position's target choice asked for only when the rule reaches
    it (`pick(i)`: the target's token at position i, i <= k): the same tokens, and no work for
    the positions after the first mismatch (seeded sampling warps a row of logits for each).

    Returns:
        ``[a + 1]`` int64: the accepted drafts, then the target's token at position ``a``.
    """
    emitted: list[int] = []
    for i in range(draft_tokens.shape[0]):
        token = pick(i)
        emitted.append(token)
        if token != int(draft_tokens[i]):
            return np.asarray(emitted, dtype=np.int64)
    emitted.append(pick(draft_tokens.shape[0]))
    return np.asarray(emitted, dtype=np.int64)


def _check_tokens(draft_tokens: npt.ArrayLike) -> IntArray:
    arr = np.asarray(draft_tokens)
    if arr.ndim != 1:
        raise InputError(f"draft_tokens must have shape [k], got {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InputError(f"draft_tokens must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_token_range(drafts: IntArray, vocab: int) -> None:
    if drafts.size and (int(drafts.min()) < 0 or int(drafts.max()) >= vocab):
        raise InputError(
            f"draft_tokens must be in [0, {vocab}), got values in "
            f"[{int(drafts.min())}, {int(drafts.max())}]"
        )


def accept_sample(
    draft_tokens: npt.ArrayLike,
    draft_probs: npt.ArrayLike,
    target_probs: npt.ArrayLike,
    rng: np.random.Generator,
) -> IntArray:
    """Speculative-sampling verification (Leviathan et al. 2023, Chen et al. 2023).

    For ``i`` in ``0..k-1`` draw ``u = rng.random()`` and accept ``d_i`` if
    ``u * draft[i, d_i] < target[i, d_i]``, i.e. with probability
    ``min(1, target[i, d_i] / draft[i, d_i])`` (a draft of probability 0 is accepted when the
    target gives it a positive probability; a token the target gives probability 0 is never
    accepted, even when ``u == 0``). At the first rejection one token is drawn from
    ``residual_probs(target[i], draft[i])`` and verification stops; after a full accept a bonus
    token is drawn from ``target[k]``. Exactly one ``rng.random()`` is used per examined position,
    plus one for the final token, so equal generator states give equal outputs.

    Args:
        draft_tokens: ``[k]`` draft token ids, ``d_i`` drawn from ``draft_probs[i]``.
        draft_probs: ``[k, vocab]`` warped draft distributions the drafts were drawn from.
        target_probs: ``[k + 1, vocab]`` warped target distributions.
        rng: Random generator.

    Returns:
        ``[a + 1]`` int64 with ``0 <= a <= k``: the ``a`` accepted drafts then one more token.

    Raises:
        InputError: If the shapes do not match, a draft token is out of range, or a probability
            is not finite.
    """
    drafts = _check_tokens(draft_tokens)
    k = drafts.shape[0]
    draft = np.asarray(draft_probs, dtype=np.float64)
    target = np.asarray(target_probs, dtype=np.float64)
    if target.ndim != 2 or target.shape[0] != k + 1 or target.shape[1] < 1:
        raise InputError(
            f"target_probs must have shape [k + 1, vocab] = [{k + 1}, vocab], got {target.shape}"
        )
    vocab = target.shape[1]
    if k == 0 and draft.size == 0:
        draft = draft.reshape(0, vocab)
    if draft.shape != (k, vocab):
        raise InputError(
            f"draft_probs must have shape [k, vocab] = [{k}, {vocab}], got {draft.shape}"
        )
    _check_token_range(drafts, vocab)
    if not (np.isfinite(draft).all() and np.isfinite(target).all()):
        raise InputError("draft_probs and target_probs must be finite (no NaN or inf)")
    return accept_sample_rows(drafts, draft.__getitem__, target.__getitem__, rng)


def accept_sample_rows(draft_tokens: IntArray, draft_row: Callable[[int], FloatArray],
                       target_row: Callable[[int], FloatArray], rng: np.random.Generator
                       ) -> IntArray:
    """`accept_sample` with each position's distributions asked for only when the rule
    reaches that position: the same draws, the same tokens, and no work for the positions after
    the first rejection (warping a row of logits costs 0.1-0.7 ms on a CPU for a 49k
    vocabulary; the target scores k + 1 of them a round).

    Args:
        draft_tokens: ``[k]`` int64 draft token ids.
        draft_row: ``i -> [vocab]`` the draft distribution ``d_i`` was drawn from (i < k).
        target_row: ``i -> [vocab]`` the warped target distribution at position i (i <= k).
        rng: Random generator, used exactly as `accept_sample` uses it.

    Raises:
        InputError: a draft token outside a row's vocabulary.
    """
    emitted: list[int] = []
    k = draft_tokens.shape[0]
    for i in range(k):
        token = int(draft_tokens[i])
        target, draft = target_row(i), draft_row(i)
        if not 0 <= token < target.shape[-1]:
            raise InputError(f"draft_tokens must be in [0, {target.shape[-1]}), got {token}")
        u = rng.random()
        if u * draft[token] < target[token]:
            emitted.append(token)
            continue
        emitted.append(sample_token(residual_probs(target, draft), rng))
        return np.asarray(emitted, dtype=np.int64)
    emitted.append(sample_token(target_row(k), rng))
    return np.asarray(emitted, dtype=np.int64)


def accept_probability(draft_probs: npt.ArrayLike, target_probs: npt.ArrayLike) -> float:
    """Expected probability that one draft position is accepted: ``sum(min(draft, target))``.

    Args:
        draft_probs: ``[vocab]`` draft distribution.
        target_probs: ``[vocab]`` target distribution.

    Returns:
        The acceptance probability, in ``[0, 1]`` for normalized inputs.

    Raises:
        InputError: If the shapes differ or are not 1-D.
    """
    draft, target = _check_pair(draft_probs, target_probs)
    return float(np.minimum(draft, target).sum())


def first_token_marginal(draft_probs: npt.ArrayLike, target_probs: npt.ArrayLike) -> FloatArray:
    """Exact distribution of the first token emitted by one verified draft position.

    ``P(x) = draft(x) * min(1, target(x) / draft(x)) + reject * residual(x)`` where
    ``reject = sum_y draft(y) * (1 - min(1, target(y) / draft(y)))``
    (``= 1 - sum_y min(draft(y), target(y))`` for normalized inputs). For normalized inputs this
    equals ``target_probs``: the point of speculative sampling.

    Args:
        draft_probs: ``[vocab]`` draft distribution the draft token is drawn from.
        target_probs: ``[vocab]`` target distribution it is verified against.

    Returns:
        ``[vocab]`` float64 distribution of the first emitted token.

    Raises:
        InputError: If the shapes differ or are not 1-D.
    """
    draft, target = _check_pair(draft_probs, target_probs)
    accepted = np.minimum(draft, target)  # draft * min(1, target / draft), 0 where draft == 0
    reject = float(np.maximum(draft - target, 0.0).sum())
    out: FloatArray = accepted + reject * residual_probs(target, draft)
    return out
