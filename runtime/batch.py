"""Batched speculative decoding: many streams, one target call per round, ragged acceptance.

Every row has its own committed tokens, KV lengths, sampling parameters, RNG, token budget and
stop condition. A round:
1. drafts up to k tokens for every live row: n-gram hits first ("ngram" / "hybrid"), then the
   draft model for the other rows: its first call feeds each row's catch-up tokens (what the
   draft has not seen yet; a catch-up longer than a few tokens runs in a call of its own), the
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
from dataclasses import dataclass, field, replace

import numpy as np

from .adaptive import AdaptiveK, new_tuner
from .backend import OrtModel
from .batch_calls import draft_rows, ragged_verify
from .drafters import ngram_for, take_ngram
from .errors import InputError
from .kvcache import KVCache
from .policy import DecodePlan
from .prefix_cache import kept_prefix, prefill_chunks
from .rounds import RowOutput, RowSampler, draft_budget, fed_prefix
from .sampling import SamplingParams
from .slot_prefix import Held, SlotPrefixes, extend_end, feed_row
from .stats import GenerationStats


@dataclass(frozen=True)
class RowRequest:
    """One stream of a batch: its prompt, sampling and output (budget, eos, stop strings)."""

    prompt: list[int]
    output: RowOutput
    params: SamplingParams = field(default_factory=SamplingParams)


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
    total_s: float = 0.0  # `generate_batch`: from the call to the end (encoding included)
    draft_lengths: list[int] = field(default_factory=list)
    live_rows: list[int] = field(default_factory=list)  # rows in each round

    @property
    def tokens_per_s(self) -> float:
        """Aggregate tokens per second of decoding, all rows together (each row's first token
        comes from its prefill and is not counted, as in `GenerationStats.tokens_per_s`)."""
        return max(0, self.new_tokens - self.rows) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def end_to_end_tokens_per_s(self) -> float:
        """All rows' new tokens over `total_s` (prefills and encoding included)."""
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class _Joining:
    """A row whose prefill is under way (`BatchDecoder.prefill`): its slot is taken, it is not
    in the rounds yet. `draft_from`: the draft prompt tokens its slot held."""

    row: BatchRow
    draft_from: int
    drafting: bool = False  # the target's prefill is done, the draft's under way
    seconds: float = 0.0
    draft_s: float = 0.0

    def add_time(self, seconds: float) -> None:
        self.seconds += seconds
        if self.drafting:
            self.draft_s += seconds


@dataclass
class BatchRow:
    """A row in a slot of the batch. `output` holds its kept tokens, text and stop reason."""

    index: int
    prompt_len: int
    tokens: list[int]  # prompt + committed tokens
    sampler: RowSampler
    output: RowOutput
    stats: GenerationStats
    draft_fed: list[int] = field(default_factory=list)
    draft_stable: int = 0  # draft_fed[:draft_stable] is known to be committed
    draft_prefilled: bool = False  # its draft was fed its prompt in chunks when it joined
    started: float = 0.0  # perf_counter after its prefill
    counted: int = 0  # generated tokens already added to the batch totals
    reported: bool = False  # returned by `BatchDecoder.step` as finished

    @property
    def reason(self) -> str | None:
        return self.output.reason

    @property
    def generated(self) -> list[int]:
        return self.output.tokens

    @property
    def position(self) -> int:
        """Output position of the next round's first token."""
        return len(self.tokens) - self.prompt_len


class BatchDecoder:
    """A running batch with `capacity` row slots; rows may join between rounds.

    `add` prefills a request into a free slot (continuous batching: a slot frees when its
    finished row is `release`d); `step` runs one round for every live row and returns the rows
    that finished in it. `decode_batch` is the fixed-batch use of it. A free slot keeps its
    last prompt's whole prefill chunks for a request that starts alike (`runtime/slot_prefix`;
    `keep_prefixes=False`: every row starts from empty).
    """

    def __init__(self, target: OrtModel, draft: OrtModel | None, plan: DecodePlan, *,
                 capacity: int, max_len: int, compact: bool = True,
                 tuner: AdaptiveK | None = None, keep_prefixes: bool = True) -> None:
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
        self.slots: list[BatchRow | None] = [None] * capacity
        self.joining: list[_Joining] = []  # rows whose prefill is under way, oldest first
        self.prefixes = SlotPrefixes(capacity, keep=keep_prefixes)
        self.compact = compact
        # `tuner`: a warm AdaptiveK (costs and acceptance learned earlier at this batch size).
        self.tuner = (tuner or new_tuner(plan.drafter, plan.k)) if plan.adaptive else None
        self.totals = BatchStats()

    @property
    def live(self) -> list[BatchRow]:
        return [r for r in self.slots if r is not None and r.reason is None]

    def has_room(self) -> bool:
        return bool(self.free)

    @property
    def free(self) -> list[int]:
        """Slots neither decoding nor joining."""
        taken = {j.row.index for j in self.joining}
        return [i for i, r in enumerate(self.slots) if r is None and i not in taken]

    def add(self, request: RowRequest) -> BatchRow:
        """Prefill `request` into a free slot (the one that holds the most of its prompt); it
        takes part from the next round on. (`join` and `prefill`, with nothing else joining.)"""
        row = self.join(request)
        self.prefill()
        return row

    def join(self, request: RowRequest) -> BatchRow:
        """Take a free slot for `request` (the one that holds the most of its prompt); its
        prefill runs in `prefill`, after which it takes part in the rounds."""
        if not self.free:
            raise InputError(f"the batch is full ({len(self.slots)} rows); release a finished "
                             "row first")
        if not request.prompt:
            raise InputError("the prompt has no tokens")
        replace(self.plan, limit=self.limit).check_prompt(len(request.prompt))
        slot, reused = self.prefixes.choose(self.free, request.prompt)
        draft_reused = self.prefixes.draft_reuse(slot, request.prompt)
        self.prefixes.take(slot)
        self.t_cache.lengths[slot] = reused
        if self.d_cache is not None:  # a batched draft step may feed the slot a dummy there
            self.d_cache.lengths[slot] = draft_reused
        row = BatchRow(slot, len(request.prompt), list(request.prompt),
                       RowSampler(request.params, self.target.spec.vocab_size), request.output,
                       GenerationStats(prompt_tokens=len(request.prompt), cached_tokens=reused))
        draft_from = int(self.d_cache.lengths[slot]) if self.d_cache is not None else 0
        self.joining.append(_Joining(row, draft_from))
        return row

    def prefill(self, budget: int | None = None) -> list[BatchRow]:
        """Run the joining rows' prefill calls in chunks, up to `budget` tokens (None: all; at
        least one call); returns the rows that joined the rounds. The target's calls of every
        joining row come first, oldest row first (their last call gives each row its first
        token), then the drafts'. A budget keeps the live rows' rounds coming while a long
        prompt joins (chunked prefill); each row's calls are the same whatever the budget and
        the order (rows of a batch never share a call here)."""
        joined: list[BatchRow] = []
        spent = 0
        while self.joining:
            join = next((j for j in self.joining if not j.drafting), self.joining[0])
            width = self._next_width(join)
            if spent and budget is not None and spent + width > budget:
                break
            spent += width
            try:
                ready = self._prefill_next(join)
            except BaseException:
                self.joining.remove(join)
                self.prefixes.forget()  # a failed call: what the free rows hold is not trusted
                raise
            if ready:
                self.joining.remove(join)
                self._go_live(join)
                joined.append(join.row)
        return joined

    def _next_width(self, join: _Joining) -> int:
        cache = self.d_cache if join.drafting else self.t_cache
        assert cache is not None
        a, b = prefill_chunks(int(cache.lengths[join.row.index]), join.row.prompt_len)[0]
        return b - a

    def _prefill_next(self, join: _Joining) -> bool:
        """One prefill call of a joining row; True when the row is ready for the rounds. The
        target's last call gives the first token (as in batch 1: no extra call); the draft is
        then fed the prompt unless the row is finished already or adaptive K drafts nothing
        (the draft's first call, if drafting resumes, feeds it: a catch-up the tuner weighs)."""
        row, t0 = join.row, time.perf_counter()
        slot, end = row.index, row.prompt_len
        model, cache = ((self.draft, self.d_cache) if join.drafting else
                        (self.target, self.t_cache))
        assert model is not None and cache is not None
        self._share(join, cache)
        a, b = prefill_chunks(int(cache.lengths[slot]), end)[0]
        block = np.asarray([row.tokens[a:b]], np.int64)
        if b < end:
            model.feed_rows(cache, np.asarray([slot]), block, np.asarray([b - a]))
            join.add_time(time.perf_counter() - t0)
            return False
        if join.drafting:
            model.feed_rows(cache, np.asarray([slot]), block, np.asarray([b - a]))
            join.add_time(time.perf_counter() - t0)
            row.draft_fed = list(row.tokens[:-1])
            row.draft_stable = len(row.draft_fed)
            row.draft_prefilled = True
            if self.tuner is not None:
                self.tuner.add_probe_cost(join.draft_s)
                # one row's prompt (what a kept prefix did not hold)
                self.tuner.record_feed(end - join.draft_from, join.draft_s)
            return True
        first = _first_token(model, cache, slot, row, block)
        row.tokens.extend(int(t) for t in first)
        row.output.push(first)
        if not row.output.done and len(row.tokens) >= self.limit:
            row.output.stop_at("context")
        row.stats.new_tokens = len(row.generated)
        join.add_time(time.perf_counter() - t0)
        if self.d_cache is None or row.output.done:
            return True
        if self.tuner is not None and self.tuner.k == 0:
            self.d_cache.lengths[slot] = 0
            return True
        join.drafting = True
        return False

    def _share(self, join: _Joining, cache: KVCache) -> None:
        """Copy into the joining row what another row already computed of its prompt: the
        whole prefill chunks its cache holds (`SlotPrefixes.sharing`), when they reach beyond
        the joining row's own (a document or system prompt that rows share is computed
        once)."""
        have = int(cache.lengths[join.row.index])
        held = [(j.row.index, self._prefilled(j.row, j, join.drafting))
                for j in self.joining if j is not join]
        held += [(r.index, self._prefilled(r, None, join.drafting))
                 for r in self.slots if r is not None]
        source, n = self.prefixes.sharing(held, join.row.tokens[:join.row.prompt_len])
        if n > have:
            cache.copy_prefix(source, join.row.index, n)
            if join.drafting:
                join.draft_from = n
            else:
                join.row.stats.cached_tokens += n - have

    def _prefilled(self, row: BatchRow, join: _Joining | None, draft: bool) -> list[int]:
        """The prompt tokens whose keys and values `row`'s target (or draft) row holds as its
        own prefill calls wrote them: whole chunks, never its prompt's last two positions once
        it decodes (`kept_prefix`); a joining row's, as far as its chunks have gone."""
        prompt = row.tokens[:row.prompt_len]
        if join is None:  # in the rounds (or finished, not yet released)
            return list(kept_prefix(prompt)) if row.draft_prefilled or not draft else []
        if draft:
            assert self.d_cache is not None
            return prompt[:int(self.d_cache.lengths[row.index])] if join.drafting else []
        return (list(kept_prefix(prompt)) if join.drafting else
                prompt[:int(self.t_cache.lengths[row.index])])

    def _go_live(self, join: _Joining) -> None:
        row = join.row
        row.stats.prefill_s = join.seconds
        row.started = time.perf_counter()
        self.totals.prefill_s += join.seconds
        self.totals.rows += 1
        self.totals.new_tokens += len(row.generated)
        row.counted = len(row.generated)
        self.slots[row.index] = row
        if self.tuner is not None:  # its next choice compares costs at the rows live now
            self.tuner.rows = len(self.live)

    def release(self, row: BatchRow) -> None:
        """Free a finished row's slot for a new request; the slot keeps the whole prefill
        chunks of the row's prompt (nothing, for a row released while it was joining)."""
        joining = next((j for j in self.joining if j.row is row), None)
        if joining is not None:
            self.joining.remove(joining)
            self._hold(row.index, self.prefixes.release(row.index, (), draft_prefilled=False))
        elif self.slots[row.index] is row:
            self.slots[row.index] = None
            held = self.prefixes.release(row.index, row.tokens[:row.prompt_len],
                                         draft_prefilled=row.draft_prefilled)
            self._hold(row.index, held)

    def _hold(self, slot: int, held: Held) -> None:
        """A free row's lengths: what it holds (a batched call that feeds a dummy token to a
        row it does not ask for, as the in-place draft's do, writes there)."""
        self.t_cache.lengths[slot] = len(held.target)
        if self.d_cache is not None:
            self.d_cache.lengths[slot] = len(held.draft or ())

    def prefill_ahead(self, ids: Sequence[int]) -> int:
        """Prefill the whole chunks of `ids` (a conversation so far) into the free slot that
        holds their start (`SlotPrefixes.extendable`), so that a request starting with them
        prefills only what follows; the draft's row too where it holds their start. Returns
        how many of `ids` the slot now holds (0: no free slot holds their start)."""
        slot = self.prefixes.extendable(self.free, ids)
        if slot is None:
            return 0
        held = self.prefixes.held[slot]
        end = extend_end(ids, self.limit)
        if end <= len(held.target):
            return len(held.target)
        draft = None
        try:
            self.t_cache.lengths[slot] = len(held.target)
            feed_row(self.target, self.t_cache, slot, ids, end)
            if (self.draft is not None and self.d_cache is not None and held.draft is not None
                    and tuple(ids[:len(held.draft)]) == held.draft):
                self.d_cache.lengths[slot] = len(held.draft)
                feed_row(self.draft, self.d_cache, slot, ids, end)
                draft = tuple(ids[:end])
        except BaseException:
            self.prefixes.forget()
            raise
        self.prefixes.held[slot] = Held(tuple(ids[:end]), draft, held.released)
        self._hold(slot, self.prefixes.held[slot])
        return end

    def _catch_up(self, rows: list[BatchRow]) -> float:
        """Feed the draft, in one call, what rows whose draft lags by more than a few tokens
        have not fed it (a prefill deferred while adaptive K drafted nothing, or the tokens of
        k = 0 rounds), so the drafting calls after it feed one token per row; its seconds.

        Kept apart from the drafting calls' time: the tuner weighs a catch-up on its own
        (`AdaptiveK.MAX_PROBE_CATCH_UP`), and a prompt-long one counted as a draft step would
        make every later step look dear."""
        assert self.draft is not None and self.d_cache is not None
        lagging = [r for r in rows if _lag(r) > AdaptiveK.MAX_PROBE_CATCH_UP]
        if not lagging:
            return 0.0
        blocks = [r.tokens[len(r.draft_fed):-1] for r in lagging]
        t0 = time.perf_counter()
        ragged_verify(self.draft, self.d_cache, lagging, blocks, [len(b) for b in blocks],
                       np.ones(len(lagging), bool), last=True)  # no logits reach the host
        for row, block in zip(lagging, blocks, strict=True):
            row.draft_fed.extend(block)
        seconds = time.perf_counter() - t0
        if self.tuner is not None:
            self.tuner.record_feed(len(blocks) * max(map(len, blocks)), seconds)
        return seconds

    def _propose(self, live: list[BatchRow], k: int
                 ) -> tuple[dict[int, list[int]], dict[int, np.ndarray], float, set[int],
                            float]:
        """Drafts per live row (n-gram hits, then the draft model for the rest), their draft
        probabilities (random sampling with the model), the drafting calls' seconds, the
        model-drafted rows and the seconds of a catch-up call before them (`_catch_up`)."""
        budgets = {r.index: draft_budget(self.plan, k, r.output, len(r.tokens), self.limit)
                   for r in live}
        ks = {i: own for i, (own, _) in budgets.items()}
        drafts: dict[int, list[int]] = {r.index: [] for r in live}
        model_rows = []
        for row in live:
            free = budgets[row.index][1]
            hit = self.ngram.lookup(row.tokens, free) if self.ngram else []
            if self.plan.drafter == "ngram" or take_ngram(hit, free):
                drafts[row.index] = hit
            elif ks[row.index]:
                model_rows.append(row)
        if not model_rows or self.draft is None:
            return drafts, {}, 0.0, set(), 0.0
        catch_up = self._catch_up(model_rows)
        model, probs, seconds = draft_rows(self.draft, self.d_cache, model_rows, ks, self.compact,
                                       self.plan.draft_p_min)
        drafts.update(model)
        return drafts, probs, seconds, {r.index for r in model_rows}, catch_up

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
        drafts, probs, draft_s, model_rows, catch_up_s = self._propose(
            live, self.tuner.k if self.tuner else self.plan.k)
        k_round = max(len(d) for d in drafts.values())
        t1 = time.perf_counter()
        blocks = [[r.tokens[-1], *drafts[r.index]] if r.reason is None else [0] for r in fed]
        # Greedy rows get argmax ids (from the device when the backend takes them there); the
        # others get their logits rows, in order.
        greedy = np.asarray([r.sampler.greedy for r in fed], bool)
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
            if greedy[i]:
                emitted = row.sampler.verify_ids(mine, ids[i, :n + 1])
            else:
                emitted = row.sampler.verify(mine, probs.get(row.index),
                                             logits[sampled_row[i], :n + 1], row.position)
            accepted = len(emitted) - 1
            outcomes.append((n, accepted))
            if self.plan.drafter != "hybrid" or row.index in model_rows or not n:
                tuned.append((n, accepted))
            row.tokens.extend(int(t) for t in emitted)
            # The target holds every committed token but the last, which the next round feeds.
            self.t_cache.lengths[row.index] = len(row.tokens) - 1
            if self.d_cache is not None:
                keep = fed_prefix(row.draft_fed, row.tokens, row.draft_stable)
                del row.draft_fed[keep:]
                row.draft_stable = keep
                self.d_cache.lengths[row.index] = keep
            row.sampler.forget(row.position)
            # The whole calls of the round: the row waited for them (so its host_s is the
            # batch's host time in its rounds, not inflated by the other rows' shares).
            row.stats.record_round(n, accepted, verify_s=verify_s, draft_s=draft_s + catch_up_s,
                                   draft_calls=n if row.index in model_rows else 0)
            row.output.push(emitted)
            if not row.output.done and len(row.tokens) >= self.limit:
                row.output.stop_at("context")
            row.stats.new_tokens = len(row.generated)
            row.stats.decode_s = time.perf_counter() - row.started
            if row.output.done:
                row.output.finish()
                row.reported = True
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
        totals.draft_s += draft_s + catch_up_s
        totals.verify_s += verify_s
        totals.decode_s += time.perf_counter() - t_start
        if self.tuner is not None and tuned:
            # Cost per drafted position of the round: the model's drafting calls (a long
            # catch-up ran apart, `_catch_up`), or nothing for n-gram drafts, which are free.
            lags = [_lag(r) for r in live] if self.d_cache is not None else [-1]
            self.tuner.update_batch(
                k_round, tuned, draft_s, k_round, verify_s, max(lags) + 1, catch_up_s,
                catch_up_tokens=_catch_up_size(lags),
                rows=len(fed), next_rows=len(self.live))
        elif self.tuner is not None:  # free n-gram hits only: their k was not the tuner's
            self.tuner.record_verify(k_round + 1, verify_s, len(fed))
        return finished


def decode_batch(target: OrtModel, draft: OrtModel | None, plan: DecodePlan,
                 requests: Sequence[RowRequest], *, max_len: int, compact: bool = True,
                 tuner: AdaptiveK | None = None, keep_prefixes: bool = True
                 ) -> tuple[list[BatchRow], BatchStats]:
    """Generate for every request; returns the rows (in order, finished) and the totals.
    `keep_prefixes=False`: rows whose prompts start alike prefill them each (a measurement's
    control)."""
    if not requests:
        raise InputError("a batch needs at least one prompt")
    decoder = BatchDecoder(target, draft, plan, capacity=len(requests), max_len=max_len,
                           compact=compact, tuner=tuner, keep_prefixes=keep_prefixes)
    rows = [decoder.add(r) for r in requests]
    start = time.perf_counter()  # decoding starts once every row is prefilled: a row's
    for row in rows:  # decode_s leaves out the prefills of the rows after it
        row.started = start
    while decoder.live:
        decoder.step()
    return rows, decoder.totals


def _catch_up_size(lags: list[int]) -> int:
    """Tokens a catch-up call for rows lagging by `lags` feeds: lagging rows x the widest."""
    far = [n for n in lags if n > AdaptiveK.MAX_PROBE_CATCH_UP]
    return len(far) * max(far, default=0)


def _lag(row: BatchRow) -> int:
    """Committed tokens the row's draft has not been fed, but the last (which the next
    drafting call feeds anyway); `BatchDecoder._catch_up` feeds them when many."""
    return len(row.tokens) - 1 - len(row.draft_fed)


def _first_token(model: OrtModel, cache: KVCache, index: int, row: BatchRow,
                 block: np.ndarray) -> np.ndarray:
    """Feed row `index` the last chunk `block` `[1, n]` of its prompt; returns its first token
    `[1]` (from argmax ids for a greedy row, so the logits need not reach the host)."""
    ids, logits = model.forward_rows_greedy(cache, np.asarray([index]), block,
                                            np.asarray([block.shape[1]]),
                                            np.asarray([row.sampler.greedy]), last=True)
    if row.sampler.greedy:
        return row.sampler.verify_ids(np.zeros(0, np.int64), ids[0])
    return row.sampler.verify(np.zeros(0, np.int64), None, logits[0, -1:], 0)
