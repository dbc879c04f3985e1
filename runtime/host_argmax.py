"""Greedy argmaxes of logits in host memory: the ids and finiteness rules of numpy's float
argmax, fast for float16.

A GPU model's fp16 logits reach the host for blocks, prefills and batches. numpy's float16
argmax is not vectorized, and converting to float32 first costs a pass that writes twice the
bytes: for a batch of 8 rows verifying 3 positions over a 152,064-token vocabulary (a
Qwen2.5-7B target), the former path took 14.3 ms against 2.3 ms on order keys
(docs/results/host_argmax.txt, the 2-core development CPU), next to a ~4 ms target call on an
H200. So float16 logits are argmaxed on
int16 *order keys*: the sign-magnitude bits mapped to two's complement, so that keys compare as
the values do. Equal values have equal keys (-0 and +0 too), so ties still go to the lowest id;
+-inf are the keys +-0x7C00 and NaNs lie beyond them.
"""

from __future__ import annotations

import numpy as np

INF_KEY = 0x7C00  # the key of +inf (-inf: -INF_KEY); NaNs beyond


def order_keys(logits: np.ndarray) -> np.ndarray:
    """float16 logits as int16 keys in the same order; other dtypes as they are (no copy)."""
    if logits.dtype != np.float16:
        return logits
    bits = np.ascontiguousarray(logits).view(np.int16)
    sign = bits >> 15  # -1 where the sign bit is set, else 0
    return ((bits & np.int16(0x7FFF)) ^ sign) - sign  # -magnitude for negatives: -0 is 0


def argmax(keys: np.ndarray) -> np.ndarray:
    """Ids of the largest value along the last axis, ties to the lowest (int64)."""
    return keys.argmax(axis=-1).astype(np.int64, copy=False)


def rows_argmax(keys: np.ndarray, greedy: np.ndarray, new_lens: np.ndarray, *,
                last: bool = False) -> np.ndarray:
    """The argmax at each fed position (the first `new_lens[i]`) of each greedy row, -1
    elsewhere: `[rows, width]` int64, or `[rows, 1]` with `last` (each row's last fed position
    only: a prefill's others are not argmaxed). Row by row over views: no copy of the logits."""
    ids = np.full((len(greedy), 1) if last else keys.shape[:2], -1, np.int64)
    for i in np.flatnonzero(greedy):
        n = int(new_lens[i])
        if last:
            ids[i, 0] = np.argmax(keys[i, n - 1])
        else:
            ids[i, :n] = np.argmax(keys[i, :n], axis=-1)
    return ids


def picked_finite(keys: np.ndarray, ids: np.ndarray) -> bool:
    """numpy's float rule for `argmax(keys)`: the picked values are finite. (Its argmax picks
    a NaN or a +inf wherever there is one; a negative NaN, which the keys order below -inf, is
    looked for everywhere.)"""
    picked = np.take_along_axis(keys, ids[..., None], -1)
    if keys.dtype != np.int16:
        return bool(np.isfinite(picked).all())
    return bool(np.abs(picked.astype(np.int32)).max() < INF_KEY
                and keys.min() >= -INF_KEY)


def finite_at(keys: np.ndarray, valid: np.ndarray) -> bool:
    """Every value at the positions `valid` (`keys.shape[:-1]`, bool) is finite."""
    if keys.dtype != np.int16:  # a NaN or an inf makes its position's max or min one
        with np.errstate(invalid="ignore"):
            return bool(np.isfinite(keys.max(axis=-1)[valid]).all()
                        and np.isfinite(keys.min(axis=-1)[valid]).all())
    return bool((keys.max(axis=-1)[valid] < INF_KEY).all()
                and (keys.min(axis=-1)[valid] > -INF_KEY).all())


def floats(logits: np.ndarray) -> np.ndarray:
    """Logits for sampling: float16 as float32 (exact), others as they are."""
    return logits.astype(np.float32) if logits.dtype == np.float16 else logits
