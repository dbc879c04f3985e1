"""Sampling and speculative-decoding verification math, in pure numpy.

This module turns logits into warped sampling distributions (temperature, top-k, top-p, min-p),
samples tokens from them, and verifies a block of draft tokens against the target model by the
rejection-sampling rule of speculative decoding:

* Y. Leviathan, M. Kalman, Y. Matias. "Fast Inference from Transformers via Speculative
  Decoding". ICML 2023, arXiv:2211.17192.
* C. Chen, S. Borgeaud, G. Irving, J.-B. Lespiau, L. Sifre, J. Jumper. "Accelerating Large
  Language Model Decoding with Speculative Sampling". arXiv:2302.01318, 2023.

A draft token ``d`` drawn from the draft distribution is accepted with probability
``min(1, target[d] / draft[d])``; at the first rejection one token is drawn from the residual
distribution ``norm(max(0, target - draft))``; after a full accept a bonus token is drawn from the
target's next distribution. Every emitted token is then distributed exactly as the target
distribution, whatever the draft distribution is.

Nothing here touches a global random state: every random function takes a
``numpy.random.Generator``, and a given generator state always gives the same output.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .errors import InputError, ModelError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Nucleus (top-p) search. First the tokens above a threshold that the nucleus provably lies
# above (`_nucleus_by_threshold`: one compare over the vocabulary, then a small sort; at most
# this many candidates a row); then these many highest-probability candidates per row
# (argpartition + small sort, ~0.4 ms a row of 49k); every nonzero token sorted only when the
# nucleus is not provably inside them (very flat distributions).
_THRESHOLD_CANDIDATES = 4096
_NUCLEUS_CANDIDATES = (1024, 8192)

__all__ = [
    "SamplingParams",
    "accept_greedy",
    "accept_greedy_ids",
    "accept_probability",
    "accept_sample",
    "first_token_marginal",
    "residual_probs",
    "sample_token",
    "warp_probs",
]


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a sampling distribution.

    Attributes:
        temperature: Logits are divided by it. ``0`` means greedy decoding (argmax).
            Must be finite and ``>= 0``.
        top_k: Keep only the ``top_k`` most likely tokens (tokens tied with the k-th are kept
            too). ``0`` turns it off.
        top_p: Nucleus sampling: keep the smallest set of most likely tokens whose cumulative
            probability is ``>= top_p``. In ``(0, 1]``; ``1`` turns it off.
        min_p: Keep tokens whose probability is ``>= min_p * max probability``. In ``[0, 1)``;
            ``0`` turns it off.
        seed: Seed of the generator used for sampling, or ``None`` for a fresh one.

    Raises:
        InputError: If a field is out of range; the message names the field, the value found
            and the allowed range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(float(t)) or float(t) < 0.0:
            raise InputError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}"
            )
        if not _is_int(self.top_k) or int(self.top_k) < 0:
            raise InputError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        p = self.top_p
        if not _is_real(p) or not (0.0 < float(p) <= 1.0):
            raise InputError(f"top_p must be a number in (0, 1] (1 turns it off), got {p!r}")
        m = self.min_p
        if not _is_real(m) or not (0.0 <= float(m) < 1.0):
            raise InputError(f"min_p must be a number in [0, 1) (0 turns it off), got {m!r}")
        s = self.seed
        if s is not None and (not _is_int(s) or int(s) < 0):
            raise InputError(f"seed must be an integer >= 0 (or unset, for a random seed), "
                             f"got {s!r}")

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``: decoding takes the argmax."""
        return float(self.temperature) == 0.0

    def make_rng(self) -> np.random.Generator:
        """A new generator seeded with ``seed`` (fresh OS entropy when ``seed`` is None)."""
        return np.random.default_rng(self.seed)


# --------------------------------------------------------------------------------------------
# Warping


def _check_logits(logits: npt.ArrayLike) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]:
    """Return logits as an array and their row maxima ``[..., 1]``, rejecting bad input."""
    arr = np.asarray(logits)
    if arr.ndim < 1 or arr.shape[-1] < 1:
        raise InputError(f"logits must have shape [..., vocab] with vocab >= 1, got {arr.shape}")
    if arr.dtype.kind not in "fiu":
        raise InputError(f"logits must be a real numeric array, got dtype {arr.dtype}")
    row_max = arr.max(axis=-1, keepdims=True)
    # The max propagates NaN, is +inf when any logit is +inf, and -inf when a row is all -inf.
    if not np.isfinite(row_max).all():
        raise ModelError(
            "logits contain NaN or +inf, or a row where every logit is -inf; "
            "check the model outputs"
        )
    return arr, row_max


def _normalize_(p: FloatArray) -> FloatArray:
    """Divide each row of ``p`` by its sum, in place, and return it."""
    p /= p.sum(axis=-1, keepdims=True)
    return p


def _nucleus_by_threshold(p2: FloatArray, total: FloatArray, threshold: FloatArray,
                          nonzero: IntArray) -> npt.NDArray[np.bool_] | None:
    """The nucleus mask from the tokens at or above `tau = (total - threshold) / nonzero` per
    row, or None when a row has more than `_THRESHOLD_CANDIDATES` of them or rounding leaves its
    nucleus short of `threshold` (the caller then searches otherwise).

    Exact: the tokens below `tau` hold less than `nonzero * tau = total - threshold` together,
    so the candidates hold more than `threshold` and the nucleus ends inside them; every token
    tied with the nucleus's last one is at or above `tau` too, and sorting the candidates in id
    order by descending probability (stable) gives the full sort's prefix, so the same cumulative
    sums and the same ties (towards the lower id).

    Args:
        p2: Probabilities `[rows, vocab]`.
        total: Row sums `[rows]`.
        threshold: The mass the nucleus must reach, `top_p * total` `[rows]`.
        nonzero: Nonzero tokens per row `[rows]`.
    """
    rows, vocab = p2.shape
    tau = (total - threshold) / np.maximum(nonzero, 1)
    above = p2 >= tau[:, None]
    if int(np.count_nonzero(above, axis=-1).max()) > _THRESHOLD_CANDIDATES:
        return None
    mask = np.zeros((rows, vocab), dtype=bool)
    for r in range(rows):
        ids = np.flatnonzero(above[r])  # in id order
        vals = p2[r, ids]
        order = np.argsort(-vals, kind="stable")
        cum = np.cumsum(vals[order])
        n_keep = min(int(np.count_nonzero(cum < threshold[r])) + 1, len(ids))
        if n_keep == 0 or cum[n_keep - 1] < threshold[r]:
            return None
        mask[r, ids[order[:n_keep]]] = True
    return mask


def _nucleus_mask(p2: FloatArray, top_p: float) -> npt.NDArray[np.bool_]:
    """Mask of the smallest most-likely set with cumulative probability ``>= top_p``, per row.

    Args:
        p2: Normalized probabilities ``[rows, vocab]``.
        top_p: In ``(0, 1)``.

    Returns:
        Boolean mask ``[rows, vocab]``. Ties are broken towards the lower token id.
    """
    total = p2.sum(axis=-1)
    threshold = top_p * total
    nonzero = np.count_nonzero(p2, axis=-1)
    fast = _nucleus_by_threshold(p2, total, threshold, nonzero)
    return fast if fast is not None else _nucleus_by_sorting(p2, threshold, nonzero)


def _nucleus_by_sorting(p2: FloatArray, threshold: FloatArray, nonzero: IntArray
                        ) -> npt.NDArray[np.bool_]:
    """The nucleus mask by sorting: the highest-probability `_NUCLEUS_CANDIDATES` per row
    first, every nonzero token when the nucleus is not provably inside them (arguments as
    `_nucleus_by_threshold`'s)."""
    rows, vocab = p2.shape
    nonzero_max = int(nonzero.max())
    # Candidates in token-id order: every nonzero token of each row (zero-padded to the same
    # width). A stable argsort of a boolean key is linear and, unlike argpartition, is not slowed
    # down by the many equal zeros that top-k leaves behind.
    cand: npt.NDArray[np.intp] | None = None  # None: every token, in id order
    pc = p2
    if nonzero_max < vocab:
        cand = np.argsort(p2 == 0.0, axis=-1, kind="stable")[:, :nonzero_max]
        pc = np.take_along_axis(p2, cand, axis=-1)
    tries = [m for m in _NUCLEUS_CANDIDATES if m < nonzero_max] + [nonzero_max]
    cand_m: npt.NDArray[np.intp] | None
    for m in tries:
        if m < nonzero_max:
            sub = np.argpartition(pc, nonzero_max - m, axis=-1)[:, nonzero_max - m :]
            sub.sort(axis=-1)  # keep token-id order, so the stable sort breaks ties by lower id
            cand_m = sub if cand is None else np.take_along_axis(cand, sub, axis=-1)
            pc_m = np.take_along_axis(pc, sub, axis=-1)
        else:
            cand_m, pc_m = cand, pc
        order = np.argsort(-pc_m, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(pc_m, order, axis=-1)
        cum = np.cumsum(sorted_p, axis=-1)
        n_keep = np.minimum((cum < threshold[:, None]).sum(axis=-1) + 1, m)
        if m < nonzero_max:
            # Exact only if the nucleus is complete inside the candidates and ends on a
            # probability strictly above everything left out (a full sort picks the same set).
            last = n_keep - 1
            reached = cum[np.arange(rows), last] >= threshold
            above = sorted_p[np.arange(rows), last] > sorted_p[:, -1]
            if not (reached.all() and above.all()):
                continue
        sorted_ids = order if cand_m is None else np.take_along_axis(cand_m, order, axis=-1)
        keep_sorted = np.arange(m)[None, :] < n_keep[:, None]
        mask = np.zeros((rows, vocab), dtype=bool)
        np.put_along_axis(mask, sorted_ids, keep_sorted, axis=-1)
        return mask
    raise AssertionError("unreachable: the last try covers every nonzero token")


def warp_probs(logits: npt.ArrayLike, params: SamplingParams) -> FloatArray:
    """Turn logits into the sampling distribution that ``params`` describe.

    Steps, in order: temperature, top-k, top-p (nucleus), min-p, renormalization. Greedy params
    give a one-hot of the argmax (ties go to the lowest token id, like ``np.argmax``).

    Args:
        logits: ``[..., vocab]`` real logits (float32 or float64; ``-inf`` masks a token).
        params: The sampling parameters.

    Returns:
        ``[..., vocab]`` float64 probabilities; each row sums to 1.

    Raises:
        InputError: If ``logits`` has no vocabulary axis or is not numeric.
        ModelError: If ``logits`` hold NaN or ``+inf``, or a row is entirely ``-inf``.
    """
    arr, row_max = _check_logits(logits)
    shape = arr.shape
    vocab = shape[-1]
    if params.greedy:
        out = np.zeros(shape, dtype=np.float64)
        np.put_along_axis(out, np.argmax(arr, axis=-1)[..., None], 1.0, axis=-1)
        return out

    # Subtract the max first: no overflow, even for tiny temperatures (the max maps to 0).
    # Every step below works in place on this one fresh float64 buffer.
    p2 = np.subtract(arr, row_max, dtype=np.float64).reshape(-1, vocab)
    temperature = float(params.temperature)
    if temperature != 1.0:
        with np.errstate(over="ignore"):  # -inf for a tiny temperature: exp() makes it 0
            p2 /= temperature
    k = int(params.top_k)
    dropped = None
    if 0 < k < vocab:
        kth = np.partition(p2, vocab - k, axis=-1)[:, vocab - k : vocab - k + 1]
        dropped = p2 < kth  # tokens tied with the k-th largest are kept
    np.exp(p2, out=p2)
    if dropped is not None:
        p2[dropped] = 0.0
    _normalize_(p2)

    top_p = float(params.top_p)
    if top_p < 1.0:
        keep = _nucleus_mask(p2, top_p)
        # The logits' argmax always stays: logits closer than exp's resolution give equal
        # probabilities, and the nucleus would break that tie towards a lower id instead.
        keep[np.arange(len(p2)), np.argmax(arr.reshape(-1, vocab), axis=-1)] = True
        p2[~keep] = 0.0
        _normalize_(p2)

    min_p = float(params.min_p)
    if min_p > 0.0:
        p2[p2 < min_p * p2.max(axis=-1, keepdims=True)] = 0.0
        _normalize_(p2)

    out2: FloatArray = p2.reshape(shape)
    return out2


# --------------------------------------------------------------------------------------------
# Sampling and verification


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

    emitted: list[int] = []
    for i in range(k):
        token = int(drafts[i])
        u = rng.random()
        if u * draft[i, token] < target[i, token]:
            emitted.append(token)
            continue
        emitted.append(sample_token(residual_probs(target[i], draft[i]), rng))
        return np.asarray(emitted, dtype=np.int64)
    emitted.append(sample_token(target[k], rng))
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
