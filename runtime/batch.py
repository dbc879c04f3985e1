"""Batched speculative decoding: many streams, one target call per round, ragged acceptance.

Every row has its own committed tokens, KV lengths, sampling parameters, RNG, token budget and
stop condition. A round:
1. drafts up to k tokens for every live row: the first draft call feeds each row's catch-up
   tokens (what the draft has not seen yet), the next ones feed one token per row; rows whose
   budget allows fewer drafts drop out of the later draft calls;
2. verifies every live row's block `[last committed token, drafts...]` in one target call;
3. accepts a different number of tokens per row (greedy: while the draft equals the argmax;
   sampling: the rejection rule of `sampling.accept_sample`, with the row's own RNG), so each
   row's output is exactly what batch-1 decoding gives it;
4. rolls each row's caches back to its own committed length (O(1), lengths only).
Finished rows leave the batch: with `compact=True` (default) they are no longer fed, so the
remaining rows stop paying for them; `compact=False` keeps them in the batch tensors with a
masked dummy token (measured slower; kept to show why).

k is shared by the rows of a round (one draft call per position). With `adaptive`, it is chosen
by `AdaptiveK` from the round's aggregate acceptance and the costs measured at the current batch
size, so it backs off to k = 0 (batched target-only) where verifying batch x (k + 1) tokens costs
more than the drafts save.

Needs concat-form graphs for both models (`OrtModel.forward_rows`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .backend import KVCache, OrtModel
from .drafters import AdaptiveK
from .errors import InputError
from .sampling import SamplingParams, accept_greedy, accept_sample, sample_token, warp_probs
from .stats import GenerationStats


@dataclass(frozen=True)
class RowRequest:
    """One stream of a batch."""

    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: Callable[[list[int]], bool] | None = None  # called with each round's new tokens


@dataclass
class BatchStats:
    """Aggregate counters of one batched generation (per-row stats are in each row)."""

    rows: int = 0
    rounds: int = 0
    new_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)
    live_rows: list[int] = field(default_factory=list)  # rows in each round

    @property
    def tokens_per_s(self) -> float:
        """Aggregate new tokens per second of decoding, all rows together."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class _Row:
    index: int
    request: RowRequest
    tokens: list[int]
    rng: np.random.Generator
    stats: GenerationStats
    generated: list[int] = field(default_factory=list)
    draft_fed: list[int] = field(default_factory=list)
    reason: str | None = None
    started: float = 0.0  # perf_counter after its prefill
    counted: int = 0  # generated tokens already added to the batch totals


class BatchDecoder:
    """A running batch with `capacity` row slots; rows may join between rounds.

    `add` prefills a request into a free slot (continuous batching: a slot frees when its
    finished row is `release`d); `step` runs one round for every live row and returns the rows
    that finished in it. `decode_batch` is the fixed-batch use of it.
    """

    def __init__(self, target: OrtModel, draft: OrtModel | None, *, capacity: int,
                 num_draft_tokens: int, adaptive: bool, eos_token_ids: tuple[int, ...],
                 max_len: int, compact: bool = True, tuner: AdaptiveK | None = None) -> None:
        if capacity < 1:
            raise InputError(f"batch capacity must be >= 1, got {capacity}")
        self.target, self.draft = target, draft
        self.k_max = num_draft_tokens if draft is not None else 0
        self.t_cache = target.new_cache(capacity, max_len)
        self.d_cache = draft.new_cache(capacity, max_len) if draft is not None else None
        self.slots: list[_Row | None] = [None] * capacity
        self.max_len, self.eos, self.compact = max_len, eos_token_ids, compact
        # `tuner`: a warm AdaptiveK (costs and acceptance learned earlier at this batch size).
        self.tuner = (tuner or AdaptiveK(self.k_max)) if adaptive and self.k_max else None
        self.totals = BatchStats()

    @property
    def live(self) -> list[_Row]:
        return [r for r in self.slots if r is not None and r.reason is None]

    def has_room(self) -> bool:
        return any(r is None for r in self.slots)

    def add(self, request: RowRequest, rng: np.random.Generator) -> _Row:
        """Prefill `request` into a free slot; it takes part from the next round on."""
        slot = next((i for i, r in enumerate(self.slots) if r is None), None)
        if slot is None:
            raise InputError(f"the batch is full ({len(self.slots)} rows); release a finished "
                             "row first")
        if len(request.prompt) < 1 or len(request.prompt) + 1 >= self.max_len:
            raise InputError(f"a prompt of {len(request.prompt)} tokens does not fit the batch "
                             f"context of {self.max_len}")
        row = _Row(slot, request, list(request.prompt), rng,
                   GenerationStats(prompt_tokens=len(request.prompt)))
        t0 = time.perf_counter()
        self.t_cache.lengths[slot] = 0
        _prefill(self.target, self.t_cache, slot, row.tokens[:-1])
        if self.draft is not None and self.d_cache is not None:
            self.d_cache.lengths[slot] = 0
            _prefill(self.draft, self.d_cache, slot, row.tokens[:-1])
            row.draft_fed = list(row.tokens[:-1])
        row.stats.prefill_s = time.perf_counter() - t0
        row.started = time.perf_counter()
        self.totals.prefill_s += row.stats.prefill_s
        self.totals.rows += 1
        self.slots[slot] = row
        return row

    def release(self, row: _Row) -> None:
        """Free a finished row's slot for a new request."""
        if self.slots[row.index] is row:
            self.slots[row.index] = None

    def step(self) -> list[_Row]:
        """One round for every live row; returns the rows that finished in it."""
        live = self.live
        if not live:
            return []
        t_start = time.perf_counter()
        target, draft, t_cache, d_cache = self.target, self.draft, self.t_cache, self.d_cache
        fed = live if self.compact else [r for r in self.slots if r is not None]
        k = self.tuner.k if self.tuner else self.k_max
        ks = {r.index: max(0, min(k, r.request.max_new_tokens - len(r.generated) - 1,
                                  self.max_len - len(r.tokens) - 1)) for r in live}
        k_round = max(ks.values())
        drafts, probs, draft_s, draft_calls = _draft(
            draft, d_cache, live, ks, k_round, self.compact) if k_round and draft else (
            {r.index: [] for r in live}, {}, 0.0, 0)
        t1 = time.perf_counter()
        blocks = [[r.tokens[-1], *drafts.get(r.index, [])] if r.reason is None else [0]
                  for r in fed]
        logits = _ragged(target, t_cache, fed, blocks,
                         [len(b) if r.reason is None else 0 for r, b in zip(fed, blocks,
                                                                           strict=True)])
        verify_s = time.perf_counter() - t1
        outcomes: list[tuple[int, int]] = []
        finished: list[_Row] = []
        for i, row in enumerate(fed):
            if row.reason is not None:
                continue
            mine = drafts[row.index]
            n = len(mine)
            block_logits = logits[i, :n + 1]
            params = row.request.params
            if params.greedy:
                emitted = accept_greedy(np.asarray(mine, np.int64), block_logits)
            else:
                target_probs = warp_probs(block_logits, params)
                if n:
                    emitted = accept_sample(np.asarray(mine, np.int64), probs[row.index],
                                            target_probs, row.rng)
                else:
                    emitted = np.asarray([sample_token(target_probs[0], row.rng)], np.int64)
            accepted = len(emitted) - 1
            outcomes.append((n, accepted))
            old = len(row.tokens)
            row.tokens.extend(int(t) for t in emitted)
            # The target holds every committed token but the last, which the next round feeds.
            t_cache.lengths[row.index] = len(row.tokens) - 1
            if d_cache is not None:
                keep = old + min(accepted, max(n - 1, 0)) if n else len(row.draft_fed)
                keep = min(keep, len(row.tokens) - 1, len(row.draft_fed))
                del row.draft_fed[keep:]
                d_cache.lengths[row.index] = keep
            _commit(row, [int(t) for t in emitted], self.eos, self.max_len)
            st = row.stats
            st.rounds += 1
            st.proposed += n
            st.accepted += accepted
            st.draft_calls += n
            st.target_calls += 1
            st.draft_lengths.append(n)
            st.accepted_lengths.append(accepted)
            st.verify_s += verify_s / len(live)
            st.draft_s += draft_s / len(live)
            st.new_tokens = len(row.generated)
            st.decode_s = time.perf_counter() - row.started
            if row.reason is not None:
                finished.append(row)
        totals = self.totals
        totals.rounds += 1
        totals.live_rows.append(len(live))
        totals.draft_lengths.append(k_round)
        totals.proposed += sum(n for n, _ in outcomes)
        totals.accepted += sum(a for _, a in outcomes)
        totals.new_tokens += sum(len(r.generated) - r.counted for r in live)
        for r in live:
            r.counted = len(r.generated)
        totals.draft_s += draft_s
        totals.verify_s += verify_s
        totals.decode_s += time.perf_counter() - t_start
        if self.tuner is not None:
            # The draft cost per call includes the catch-up call (rows that accepted every
            # draft feed 2 tokens): at batch 8 that call costs much more than a 1-token step.
            self.tuner.update_batch(k_round, outcomes, draft_s, draft_calls, verify_s)
        return finished


def decode_batch(target: OrtModel, draft: OrtModel | None, requests: Sequence[RowRequest], *,
                 num_draft_tokens: int, adaptive: bool, eos_token_ids: tuple[int, ...],
                 rngs: Sequence[np.random.Generator], max_len: int, compact: bool = True,
                 tuner: AdaptiveK | None = None
                 ) -> tuple[list[tuple[list[int], str, GenerationStats]], BatchStats]:
    """Generate for every request; returns per row (new tokens, stop reason, stats) and totals."""
    if not requests:
        raise InputError("a batch needs at least one prompt")
    decoder = BatchDecoder(target, draft, capacity=len(requests),
                           num_draft_tokens=num_draft_tokens, adaptive=adaptive,
                           eos_token_ids=eos_token_ids, max_len=max_len, compact=compact,
                           tuner=tuner)
    rows = [decoder.add(r, rngs[i]) for i, r in enumerate(requests)]
    while decoder.live:
        decoder.step()
    return [(r.generated, r.reason or "max_new_tokens", r.stats) for r in rows], decoder.totals


def _prefill(model: OrtModel, cache: KVCache, index: int, tokens: list[int]) -> None:
    if tokens:
        model.forward_rows(cache, np.asarray([index]), np.asarray([tokens], np.int64),
                           np.asarray([len(tokens)]))


def _draft(model: OrtModel, cache: KVCache | None, live: list[_Row], ks: dict[int, int],
           k_round: int, compact: bool
           ) -> tuple[dict[int, list[int]], dict[int, np.ndarray], float, int]:
    """Propose ks[row] tokens for each live row; returns drafts, draft probabilities (sampled
    rows), seconds in the draft model and the number of draft calls.

    With `compact`, a draft call feeds only the rows still drafting at that position; otherwise
    every live row stays in the call (the others with a masked dummy token)."""
    assert cache is not None
    drafts: dict[int, list[int]] = {r.index: [] for r in live}
    probs: dict[int, list[np.ndarray]] = {r.index: [] for r in live}
    seconds = 0.0
    calls = 0
    ids = model.vocab_ids
    for position in range(k_round):
        active = [r for r in live if ks[r.index] > position]
        if not active:
            break
        feed_rows = active if compact else live
        blocks = []
        for row in feed_rows:
            if ks[row.index] <= position:
                blocks.append([0])
            elif position == 0:
                blocks.append(row.tokens[len(row.draft_fed):])
            else:
                blocks.append([drafts[row.index][-1]])
        lens = [len(b) if ks[r.index] > position else 0
                for r, b in zip(feed_rows, blocks, strict=True)]
        t0 = time.perf_counter()
        logits = _ragged(model, cache, feed_rows, blocks, lens)
        seconds += time.perf_counter() - t0
        calls += 1
        for i, row in enumerate(feed_rows):
            if lens[i] == 0:
                continue
            row.draft_fed.extend(blocks[i])
            last = logits[i, lens[i] - 1]
            params = row.request.params
            if params.greedy:
                best = int(np.argmax(last))
                token = best if ids is None else int(ids[best])
            else:
                p = warp_probs(last, params)
                pick = sample_token(p, row.rng)
                token = pick if ids is None else int(ids[pick])
                if ids is not None:  # the draft distribution over the full vocabulary
                    full = np.zeros(model.spec.vocab_size)
                    full[ids] = p
                    p = full
                probs[row.index].append(p)
            drafts[row.index].append(token)
    stacked = {i: np.stack(p) for i, p in probs.items() if p}
    return drafts, stacked, seconds, calls


def _ragged(model: OrtModel, cache: KVCache, feed_rows: list[_Row], blocks: list[list[int]],
            lens: list[int]) -> np.ndarray:
    """One call: row `feed_rows[i]` gets `blocks[i][:lens[i]]`; a row with lens 0 is fed a
    masked dummy token whose keys/values are not kept (compact=False)."""
    width = max(len(b) for b in blocks)
    tokens = np.zeros((len(feed_rows), width), np.int64)
    for i, block in enumerate(blocks):
        tokens[i, :len(block)] = block
    index = np.asarray([r.index for r in feed_rows])
    lens_arr = np.asarray(lens, np.int64)
    if (lens_arr == 0).any():
        saved = cache.lengths.copy()
        logits = model.forward_rows(cache, index, tokens, np.maximum(lens_arr, 1))
        dead = index[lens_arr == 0]
        cache.lengths[dead] = saved[dead]
        return logits
    return model.forward_rows(cache, index, tokens, lens_arr)


def _commit(row: _Row, new: list[int], eos: tuple[int, ...], max_len: int) -> None:
    """Append a round's tokens to the row's output and decide whether the row is finished."""
    budget = row.request.max_new_tokens - len(row.generated)
    cut = next((i for i, t in enumerate(new) if t in eos), None)
    out = new[: min(len(new), budget, cut + 1 if cut is not None else len(new))]
    row.generated.extend(out)
    # The stop callback sees every round (a stop string in the last round wins over eos, as
    # in `Pair.stream`, which searches each chunk's text before the loop reports eos).
    if row.request.stop is not None and row.request.stop(out):
        row.reason = "stop"
    elif cut is not None and cut < budget:
        row.reason = "eos"
    elif len(row.generated) >= row.request.max_new_tokens:
        row.reason = "max_new_tokens"
    elif len(row.tokens) >= max_len - 1:
        row.reason = "context"
