"""Batched speculative decoding: many streams, one target call per round, ragged acceptance.

Every row has its own committed tokens, KV lengths, sampling parameters, RNG, token budget and
stop condition. A round:
1. drafts up to k tokens for every live row: n-gram hits first ("ngram" / "hybrid"), then the
   draft model for the other rows: its first call feeds each row's catch-up tokens (what the
   draft has not seen yet, at most its last `AdaptiveK.CATCH_UP_WINDOW` once it holds its
   prompt: `fed_tokens`; a catch-up longer than a few tokens runs in a call of its own), the
   next ones one token per row; rows whose budget allows fewer drafts drop out of the later
   draft calls. With adaptive K at k = 0 when a row joins, its draft prefill waits until
   drafting resumes (it often never does at large batches);
2. verifies every live row's block `[last committed token, drafts...]` in one target call;
3. accepts a different number of tokens per row with the row's own `rounds.RowSampler` and
   cuts its output with its own `rounds.RowOutput` (the same pieces batch-1 decoding uses), so
   each row's output is exactly what batch-1 decoding gives it; greedy rows verify from the
   target's argmax ids (`OrtModel.forward_rows_greedy`, taken on the device when the backend
   does), sampled rows from their own logits rows;
4. rolls each row's caches back to its own committed length (O(1), lengths only).
Finished rows leave the batch: with `compact=True` (default) they are no longer fed, so the
remaining rows stop paying for them; `compact=False` keeps them in the batch tensors with a
masked dummy token (measured slower; kept to show why).

k is shared by the rows of a round (one draft call per position). With `adaptive`, it is chosen
by `AdaptiveK` from the round's aggregate acceptance and the costs measured at the current batch
size, so it backs off to k = 0 (batched target-only) where verifying batch x (k + 1) tokens costs
more than the drafts save.

Needs a concat-form target (`OrtModel.forward_rows`: batched verification); the draft may be
concat or gqa-shared, whose steps feed one token per row in place (`--draft-graph gqa-shared`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from .adaptive import AdaptiveK, new_tuner
from .backend import OrtModel
from .batch_calls import DraftCall, draft_rows, ragged_verify
from .batch_join import BatchRow as BatchRow
from .batch_join import BatchStats as BatchStats
from .batch_join import Joining, RowJoins
from .batch_join import RowRequest as RowRequest
from .drafters import ngram_for, take_ngram
from .errors import InputError
from .policy import DecodePlan
from .rounds import draft_budget, needs_logits, tokens_left
from .slot_prefix import SlotPrefixes

# A row whose draft lags by more tokens is caught up in a call of its own before the drafting
# calls (`BatchDecoder._catch_up`), which then feed one token a row.
SEPARATE_CATCH_UP = 8


class BatchDecoder(RowJoins):
    """A running batch with `capacity` row slots; rows may join between rounds.

    `add` prefills a request into a free slot (continuous batching: a slot frees when its
    finished row is `release`d; `join` and `prefill` split it, `runtime/batch_join`); `step`
    runs one round for every live row and returns the rows that finished in it. `decode_batch`
    is the fixed-batch use of it. A free slot keeps its last prompt's whole prefill chunks for
    a request that starts alike, and a joining row copies the chunks another row computed
    (`runtime/slot_prefix`; `keep_prefixes=False`: every row computes its whole prompt).
    """

    def __init__(self, target: OrtModel, draft: OrtModel | None, plan: DecodePlan, *,
                 capacity: int, max_len: int, compact: bool = True,
                 tuner: AdaptiveK | None = None, keep_prefixes: bool = True,
                 share_prompt_kv: bool = False) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InputError(f"batch capacity must be an integer >= 1, got {capacity!r}")
        if target.spec.graph != "concat":
            raise InputError(
                f"{target.spec.path}: batched speculative decoding needs a concat-form target "
                "(ONNX Runtime's GroupQueryAttention, CPU and CUDA, takes one row when several "
                "tokens follow a past); export the pair with --graph concat")
        self.target, self.plan = target, plan
        self.draft = draft if plan.uses_draft_model else None
        if plan.uses_draft_model and draft is None:
            raise InputError(f"drafter {plan.drafter!r} needs a draft model")
        self.ngram = ngram_for(plan.drafter)
        self.limit = min(plan.limit, max_len)
        self.t_cache = target.new_cache(capacity, self.limit)
        self.d_cache = self.draft.new_cache(capacity, self.limit) if self.draft else None
        # A self-draft takes a joining row's prompt from the target's cache (`Pair.load`).
        self.share_prompt_kv = share_prompt_kv and self.d_cache is not None and \
            self.d_cache.same_layout(self.t_cache)
        self.slots: list[BatchRow | None] = [None] * capacity
        self.joining: list[Joining] = []  # rows whose prefill is under way, oldest first
        self.prefixes = SlotPrefixes(capacity, keep=keep_prefixes)
        self.compact = compact
        # `tuner`: a warm AdaptiveK (costs and acceptance learned earlier at this batch size).
        self.tuner = (tuner or new_tuner(plan.drafter, plan.k)) if plan.adaptive \
            else None
        self.totals = BatchStats()

    def _catch_up(self, rows: list[BatchRow]) -> float:
        """Feed the draft, in one call, what rows whose draft lags by more than
        `SEPARATE_CATCH_UP` tokens have not fed it (a prefill deferred while adaptive K
        drafted nothing, or the last `CATCH_UP_WINDOW` tokens of k = 0 rounds: `fed_tokens`),
        so the drafting calls after it feed one token per row; its seconds.

        Kept apart from the drafting calls' time: the tuner weighs a catch-up on its own,
        and a prompt-long one counted as a draft step would make every later step look
        dear."""
        assert self.draft is not None and self.d_cache is not None
        for row in rows:
            row.draft_fed.cut(row.tokens, AdaptiveK.CATCH_UP_WINDOW, row.prompt_len - 1)
        lagging = [r for r in rows if _lag(r) > SEPARATE_CATCH_UP]
        if not lagging:
            return 0.0
        blocks = [r.draft_fed.view(r.tokens)[len(r.draft_fed.tokens):-1] for r in lagging]
        t0 = time.perf_counter()
        ragged_verify(self.draft, self.d_cache, lagging, blocks, [len(b) for b in blocks],
                       np.ones(len(lagging), bool), last=True)  # no logits reach the host
        for row, block in zip(lagging, blocks, strict=True):
            row.draft_fed.tokens.extend(block)
        seconds = time.perf_counter() - t0
        if self.tuner is not None:
            self.tuner.record_feed(len(blocks) * max(map(len, blocks)), seconds)
        return seconds

    def _propose(self, live: list[BatchRow], k: int
                 ) -> tuple[dict[int, list[int]], dict[int, np.ndarray], list[DraftCall],
                            set[int], float]:
        """Drafts per live row (n-gram hits, then the draft model for the rest), their draft
        probabilities (random sampling with the model), the drafting calls, the model-drafted
        rows and the seconds of a catch-up call before them (`_catch_up`)."""
        budgets = {r.index: draft_budget(self.plan, k, r.output, len(r.tokens), self.limit)
                   for r in live}
        ks = {i: own for i, (own, _) in budgets.items()}
        drafts: dict[int, list[int]] = {r.index: [] for r in live}
        model_rows = []
        for row in live:
            free = budgets[row.index][1]
            hit = row.sampler.allowed(row.generated, self.ngram.lookup(row.tokens, free)) \
                if self.ngram else []
            if self.plan.drafter == "ngram" or take_ngram(hit, free):
                drafts[row.index] = hit
            elif ks[row.index]:
                model_rows.append(row)
        if not model_rows or self.draft is None:
            return drafts, {}, [], set(), 0.0
        catch_up = self._catch_up(model_rows)
        model, probs, calls = draft_rows(self.draft, self.d_cache, model_rows, ks, self.compact,
                                       self.plan.draft_p_min)
        drafts.update(model)
        return drafts, probs, calls, {r.index for r in model_rows}, catch_up

    def step(self) -> list[BatchRow]:
        """One round for every live row; returns the rows that finished in it (and rows whose
        first token, from the prefill, already finished them)."""
        try:
            return self._step()
        except BaseException:
            self.prefixes.forget()  # a failed call: what the free rows hold is not trusted
            raise

    def _step(self) -> list[BatchRow]:
        finished = [r for r in self.slots if r is not None and r.output.done and
                    not r.reported]
        for row in finished:
            row.output.finish()
            row.reported = True
        live = self.live
        if not live:
            return finished
        t_start = time.perf_counter()
        fed = live if self.compact else [r for r in self.slots if r is not None]
        drafts, probs, calls, model_rows, catch_up_s = self._propose(
            live, self.tuner.k if self.tuner else self.plan.k)
        draft_s = sum(c.seconds for c in calls)
        k_round = max(len(d) for d in drafts.values())
        t1 = time.perf_counter()
        blocks = [[r.tokens[-1], *drafts[r.index]] if r.reason is None else [0] for r in fed]
        # Greedy rows get argmax ids (from the device when the backend takes them there); the
        # others (sampled, or keeping logprobs) get their logits rows, in order.
        greedy = np.asarray([not needs_logits(r.sampler, r.output) for r in fed], bool)
        ids, logits = ragged_verify(self.target, self.t_cache, fed, blocks,
                                     [len(b) if r.reason is None else 0
                                      for r, b in zip(fed, blocks, strict=True)], greedy)
        verify_s = time.perf_counter() - t1
        sampled_row = np.cumsum(~greedy) - 1  # fed row i -> its row in `logits`
        outcomes: list[tuple[int, int]] = []
        tuned: list[tuple[int, int]] = []  # the rows whose k came from the tuner
        for i, row in enumerate(fed):
            if row.reason is not None:
                continue
            mine = np.asarray(drafts[row.index], np.int64)
            n = len(mine)
            mine_logits = None if greedy[i] else logits[sampled_row[i], :n + 1]
            if mine_logits is None:
                emitted = row.sampler.verify_ids(mine, ids[i, :n + 1])
            else:
                emitted = row.sampler.verify(mine, probs.get(row.index), mine_logits,
                                             row.position, row.generated)
            accepted = len(emitted) - 1
            outcomes.append((n, accepted))
            if self.plan.drafter != "hybrid" or row.index in model_rows or not n:
                tuned.append((n, accepted))
            row.tokens.extend(int(t) for t in emitted)
            # The target holds every committed token but the last, which the next round feeds.
            self.t_cache.lengths[row.index] = len(row.tokens) - 1
            if self.d_cache is not None:
                self.d_cache.lengths[row.index] = row.draft_fed.commit(row.tokens)
            row.sampler.forget(row.position)
            # The whole calls of the round: the row waited for them (so its host_s is the
            # batch's host time in its rounds, not inflated by the other rows' shares).
            row.stats.record_round(n, accepted, verify_s=verify_s, draft_s=draft_s + catch_up_s,
                                   draft_calls=n if row.index in model_rows else 0)
            row.output.push(emitted, mine_logits)
            if not row.output.done and len(row.tokens) >= self.limit:
                row.output.stop_at("context")
            row.stats.new_tokens = len(row.generated)
            row.stats.decode_s = time.perf_counter() - row.started
            if row.output.done:
                row.output.finish()
                row.reported = True
                finished.append(row)
        round_s = time.perf_counter() - t_start - catch_up_s
        totals = self.totals
        totals.rounds += 1
        totals.live_rows.append(len(live))
        totals.draft_lengths.append(k_round)
        totals.proposed += sum(n for n, _ in outcomes)
        totals.accepted += sum(a for _, a in outcomes)
        round_tokens = sum(len(r.generated) - r.counted for r in live)
        totals.new_tokens += round_tokens
        for r in live:
            r.counted = len(r.generated)
        totals.draft_s += draft_s + catch_up_s
        totals.verify_s += verify_s
        totals.decode_s += time.perf_counter() - t_start
        if self.tuner is not None and tuned:
            # The round's draft calls: the first (what the rows committed since, and a short
            # catch-up; a long one ran apart, `_catch_up`) and the one-token steps after it, or
            # nothing for n-gram drafts, which are free.
            lags = [_lag(r) for r in live] if self.d_cache is not None else [-1]
            steps = [c.seconds for c in calls[1:] if c.width == 1]
            self.tuner.update_batch(
                k_round, tuned, sum(steps) if calls else 0.0, len(steps) if calls else k_round,
                verify_s, max(lags) + 1, catch_up_s, catch_up_tokens=_catch_up_size(lags),
                rows=len(fed), next_rows=len(self.live),
                first_call=(calls[0].rows, calls[0].width, calls[0].seconds) if calls else None,
                realized=(round_tokens, round_s),
                tokens_left=max((tokens_left(r.output, len(r.tokens), self.limit)
                                 for r in self.live), default=0))
        elif self.tuner is not None:  # free n-gram hits only: their k was not the tuner's
            self.tuner.free_round(k_round + 1, verify_s, round_tokens, round_s, len(fed))
        return finished


def decode_batch(target: OrtModel, draft: OrtModel | None, plan: DecodePlan,
                 requests: Sequence[RowRequest], *, max_len: int, compact: bool = True,
                 tuner: AdaptiveK | None = None, keep_prefixes: bool = True,
                 share_prompt_kv: bool = False) -> tuple[list[BatchRow], BatchStats]:
    """Generate for every request; returns the rows (in order, finished) and the totals.
    `keep_prefixes=False`: rows whose prompts start alike prefill them each (a measurement's
    control)."""
    if not requests:
        raise InputError("a batch needs at least one prompt")
    decoder = BatchDecoder(target, draft, plan, capacity=len(requests), max_len=max_len,
                           compact=compact, tuner=tuner, keep_prefixes=keep_prefixes,
                           share_prompt_kv=share_prompt_kv)
    rows = [decoder.add(r) for r in requests]
    start = time.perf_counter()  # decoding starts once every row is prefilled: a row's
    for row in rows:  # decode_s leaves out the prefills of the rows after it
        row.started = start
    while decoder.live:
        decoder.step()
    return rows, decoder.totals


def _catch_up_size(lags: list[int]) -> int:
    """Tokens a catch-up call for rows lagging by `lags` feeds: lagging rows x the widest."""
    far = [n for n in lags if n > SEPARATE_CATCH_UP]
    return len(far) * max(far, default=0)


def _lag(row: BatchRow) -> int:
    """Committed tokens the row's draft would be fed before drafting, but the last (which the
    next drafting call feeds anyway): what it lags by, cut to `CATCH_UP_WINDOW` once its draft
    holds its prompt (`FedTokens.catch_up`); `BatchDecoder._catch_up` feeds them when many."""
    return row.draft_fed.catch_up(row.tokens, AdaptiveK.CATCH_UP_WINDOW, row.prompt_len - 1) - 1


