"""Sampling parameters, and the warped distributions they make of logits, in pure numpy.

`SamplingParams` holds temperature, top-k, top-p (nucleus), min-p and the seed; `warp_probs`
turns logits into the distribution both the draft and the target sample from, applied
identically to both, so speculative output follows the target's warped distribution. The
verification math that uses these distributions is `acceptance`. Nothing here is random.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
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

__all__ = ["MAX_LOGIT_BIAS", "SamplingParams", "logit_bias_from_json", "warp_probs"]

MAX_LOGIT_BIAS = 1024  # token ids one request may bias


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
        presence_penalty: Subtracted from the logit of every token the output holds already
            (OpenAI's definition). In ``[-2, 2]``; ``0`` turns it off.
        frequency_penalty: Subtracted from a token's logit once per time the output holds it.
            In ``[-2, 2]``; ``0`` turns it off.
        repetition_penalty: The logit of every token the prompt or the output holds already is
            divided by it when positive and multiplied by it when negative (the CTRL paper's
            penalty, as transformers, vLLM and llama.cpp apply it). In ``(0, 10]``; ``1`` turns
            it off.
        logit_bias: ``(token id, bias)`` pairs (a dict is accepted too), each bias in
            ``[-100, 100]`` added to that token's logit (OpenAI's ``logit_bias``: -100 bans a
            token, 100 all but forces it); at most `MAX_LOGIT_BIAS` ids. Stored sorted by id.
            The bias, the repetition penalty, then the presence and frequency penalties apply in
            that order, before temperature, to greedy decoding too, and to the target's
            distribution at each position from the output before it (accepted drafts included),
            so speculation stays exact (`penalties.penalize`).
        min_tokens: The tokens that end a generation (eos, stop token ids) are banned until the
            output holds this many tokens (vLLM's ``min_tokens``; `penalties.suppress_stops`).
            ``0`` turns it off.

    Raises:
        InputError: If a field is out of range; the message names the field, the value found
            and the allowed range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= float(v) <= 2.0:
                raise InputError(f"{name} must be a number in [-2, 2] (0 turns it off), got "
                                 f"{v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not 0.0 < float(r) <= 10.0:
            raise InputError(f"repetition_penalty must be a number in (0, 10] (1 turns it off), "
                             f"got {r!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not _is_int(self.min_tokens) or not 0 <= int(self.min_tokens) <= 1_000_000:
            raise InputError(f"min_tokens must be an integer in [0, 1000000] (0 turns it off), "
                             f"got {self.min_tokens!r}")

    @property
    def adjusts_logits(self) -> bool:
        """True when a logit bias, a presence, frequency or repetition penalty or min_tokens is
        set: the logits then depend on the context (`runtime/penalties`), so no argmax
        shortcut."""
        return (float(self.presence_penalty) != 0.0 or float(self.frequency_penalty) != 0.0
                or float(self.repetition_penalty) != 1.0 or bool(self.logit_bias)
                or int(self.min_tokens) > 0)

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``: decoding takes the argmax."""
        return float(self.temperature) == 0.0

    def make_rng(self) -> np.random.Generator:
        """A new generator seeded with ``seed`` (fresh OS entropy when ``seed`` is None)."""
        return np.random.default_rng(self.seed)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted ``(token id, bias)`` pairs, checked."""
    items = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(items, list | tuple) or len(items) > MAX_LOGIT_BIAS:
        raise InputError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases, "
                         f"got {value!r:.80}")
    pairs: dict[int, float] = {}
    for item in items:
        ok = isinstance(item, list | tuple) and len(item) == 2 and _is_int(item[0]) \
            and int(item[0]) >= 0 and _is_real(item[1]) and -100.0 <= float(item[1]) <= 100.0
        if not ok or int(item[0]) in pairs:
            raise InputError(f"logit_bias entries must be distinct token ids >= 0, each with a "
                             f"bias in [-100, 100]; got {item!r:.60}")
        pairs[int(item[0])] = float(item[1])
    return tuple(sorted(pairs.items()))


def logit_bias_from_json(value: object) -> tuple[tuple[int, float], ...]:
    """A JSON ``logit_bias`` (OpenAI's shape: token ids as strings, as JSON keys are, to
    numbers) as `SamplingParams.logit_bias` pairs; None gives none.

    Raises:
        InputError: naming what is wrong (not an object, a key that is not a token id, a bias
            out of range, too many ids).
    """
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise InputError(f"logit_bias must be an object mapping token ids (as strings) to "
                         f"numbers in [-100, 100], got {value!r:.60}")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12):
            raise InputError(f"logit_bias keys must be token ids (strings of digits), got "
                             f"{key!r:.40}")
        pairs.append((int(key), bias))
    return _bias_pairs(pairs)


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
