"""The model calls of a batch's round: drafting for many rows, and ragged calls in which each
row is fed its own block (`BatchDecoder`, `runtime/batch`).

A row fed nothing in a call (`compact=False`, or a finished row) gets a masked dummy token
whose keys and values are not kept: its length is restored after the call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # types only (batch imports this module)
    from .backend import OrtModel
    from .batch import BatchRow
    from .kvcache import KVCache


class DraftCall(NamedTuple):
    """One draft model call of a batch: rows fed, the widest block, seconds."""

    rows: int
    width: int
    seconds: float


def draft_rows(model: OrtModel, cache: KVCache | None, rows: list[BatchRow], ks: dict[int, int],
           compact: bool, p_min: float
           ) -> tuple[dict[int, list[int]], dict[int, np.ndarray], list[DraftCall]]:
    """Propose ks[row] tokens with the draft model for each of `rows`; returns drafts, draft
    probabilities (random-sampling rows) and the draft model's calls, in order.

    With `compact`, a draft call feeds only the rows still drafting; otherwise every row stays
    in the call (the others with a masked dummy token). A row whose draft's confidence falls
    under `p_min` stops drafting there (`ks` is updated). The tokens a row's grammar forces are
    drafted without a call and fed with its next one (`RowSampler.forced`)."""
    assert cache is not None
    drafts: dict[int, list[int]] = {r.index: [] for r in rows}
    probs: dict[int, list[np.ndarray]] = {r.index: [] for r in rows}
    calls: list[DraftCall] = []
    while True:
        for row in rows:
            mine = drafts[row.index]
            if forced := row.sampler.forced(row.generated + mine, ks[row.index] - len(mine)):
                mine.extend(forced)
                probs[row.index].extend(p for t in forced
                                        if (p := row.sampler.certain(t)) is not None)
        drafting = {r.index for r in rows if len(drafts[r.index]) < ks[r.index]}
        if not drafting:
            break
        feed_rows = [r for r in rows if r.index in drafting] if compact else rows
        # Each drafting row is fed what its draft has not seen: the round's catch-up and last
        # committed token at first, then its last draft (and any forced tokens after it).
        blocks = [(r.draft_fed.view(r.tokens) + drafts[r.index])[len(r.draft_fed.tokens):]
                  if r.index in drafting else [0] for r in feed_rows]
        lens = [len(b) if r.index in drafting else 0
                for r, b in zip(feed_rows, blocks, strict=True)]
        # Greedy rows without a confidence cut-off need only the argmax of their last fed
        # position (taken on the device when the backend does): the same token draft_token
        # picks, whose confidence nothing compares.
        greedy = np.asarray([r.sampler.greedy and p_min <= 0
                             and not r.sampler.adjusts_logits for r in feed_rows], bool)
        t0 = time.perf_counter()
        if greedy.any():
            ids, logits = ragged_verify(model, cache, feed_rows, blocks, lens, greedy,
                                         last=True)
        else:
            ids, logits = np.zeros((len(feed_rows), 1), np.int64), ragged(
                model, cache, feed_rows, blocks, lens)
        calls.append(DraftCall(len(feed_rows), max(lens), time.perf_counter() - t0))
        sampled_row = np.cumsum(~greedy) - 1  # feed row i -> its row in `logits`
        for i, row in enumerate(feed_rows):
            if lens[i] == 0:
                continue
            row.draft_fed.tokens.extend(blocks[i])
            if greedy[i]:
                pick = int(ids[i, 0])
                token = pick if model.vocab_ids is None else int(model.vocab_ids[pick])
                drafts[row.index].append(token)
                continue
            token, p, confidence = row.sampler.draft_token(
                logits[sampled_row[i], lens[i] - 1], row.position + len(drafts[row.index]),
                model.vocab_ids, row.generated + drafts[row.index])
            if confidence < p_min:  # the draft doubts it: this row stops drafting
                ks[row.index] = len(drafts[row.index])
                continue
            if p is not None:
                probs[row.index].append(p)
            drafts[row.index].append(token)
    stacked = {i: np.stack(p) for i, p in probs.items() if p}
    return drafts, stacked, calls


def ragged_verify(model: OrtModel, cache: KVCache, feed_rows: list[BatchRow],
                   blocks: list[list[int]], lens: list[int], greedy: np.ndarray,
                   last: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """`ragged` for greedy rows: argmax ids `[rows, width]` (`[rows, 1]`, each row's last fed
    position, with `last`) for the greedy rows and the logits of the others
    `[count(~greedy), width, vocab]` (`OrtModel.forward_rows_greedy`)."""
    tokens, index, lens_arr = _block_arrays(feed_rows, blocks, lens)
    if (lens_arr == 0).any():
        saved = cache.lengths.copy()
        out = model.forward_rows_greedy(cache, index, tokens, np.maximum(lens_arr, 1), greedy,
                                        last=last)
        dead = index[lens_arr == 0]
        cache.lengths[dead] = saved[dead]
        return out
    return model.forward_rows_greedy(cache, index, tokens, lens_arr, greedy, last=last)


def _block_arrays(feed_rows: list[BatchRow], blocks: list[list[int]], lens: list[int]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Padded tokens `[rows, width]`, the rows' cache slots and their lengths fed."""
    width = max(len(b) for b in blocks)
    tokens = np.zeros((len(feed_rows), width), np.int64)
    for i, block in enumerate(blocks):
        tokens[i, :len(block)] = block
    return tokens, np.asarray([r.index for r in feed_rows]), np.asarray(lens, np.int64)


def ragged(model: OrtModel, cache: KVCache, feed_rows: list[BatchRow], blocks: list[list[int]],
            lens: list[int]) -> np.ndarray:
    """One call: row `feed_rows[i]` gets `blocks[i][:lens[i]]`; a row with lens 0 is fed a
    masked dummy token whose keys/values are not kept (compact=False)."""
    tokens, index, lens_arr = _block_arrays(feed_rows, blocks, lens)
    if (lens_arr == 0).any():
        saved = cache.lengths.copy()
        logits = model.forward_rows(cache, index, tokens, np.maximum(lens_arr, 1))
        dead = index[lens_arr == 0]
        cache.lengths[dead] = saved[dead]
        return logits
    return model.forward_rows(cache, index, tokens, lens_arr)
