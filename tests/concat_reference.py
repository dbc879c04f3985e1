"""A concat-form call checked against `session.run` fed the same padded pasts: shared by
tests/test_device_greedy.py and tests/test_kv_room.py."""

from __future__ import annotations

import numpy as np

from specedge.runtime.backend import OrtModel
from specedge.runtime.kvcache import KVCache


def pasts_of(cache: KVCache, rows: np.ndarray) -> list[np.ndarray]:
    """Each KV buffer's `rows` as the host cache holds them now `[rows, heads, room, dim]`."""
    assert cache.host is not None
    return [buf[rows].copy() for buf in cache.host]


def assert_equals_session_run(model: OrtModel, cache: KVCache, rows: np.ndarray,
                              pasts: list[np.ndarray], lengths: np.ndarray, tokens: np.ndarray,
                              lens: np.ndarray, past: int, got: np.ndarray) -> None:
    """`got` (the logits of `forward_rows(cache, rows, tokens, lens)`) and the new positions
    it left in `cache` equal, bit for bit, what `session.run` gives fed `pasts` (taken before
    the call, `pasts_of`) padded to `past`, the rows' valid `lengths`, and per-row positions."""
    spec, width = model.spec, tokens.shape[1]
    at = np.arange(past + width)[None, :]
    feeds: dict[str, object] = {
        spec.input_ids: tokens.astype(np.int64),
        spec.attention_mask: ((at < lengths[:, None]) | ((at >= past) & (
            at < past + lens[:, None]))).astype(np.int64)}
    if spec.position_ids:
        feeds[spec.position_ids] = lengths[:, None] + np.arange(width)[None, :]
    for (name, _), buf in zip(model._kv_names, pasts, strict=True):
        feeds[name] = np.ascontiguousarray(buf[:, :, :past])
    want = model.session.run([spec.logits, *[p for _, p in model._kv_names]], feeds)
    fed = np.arange(width)[None, :] < lens[:, None]
    assert np.array_equal(got[fed], want[0][fed])
    assert cache.host is not None
    for buf, present in zip(cache.host, want[1:], strict=True):
        for i, row in enumerate(rows):
            n, start = int(lens[i]), int(lengths[i])
            assert np.array_equal(buf[row, :, start:start + n], present[i, :, past:past + n])
    assert np.array_equal(cache.lengths[rows], lengths + lens)
