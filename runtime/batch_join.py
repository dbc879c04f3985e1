"""How rows join a batch (`BatchDecoder`, `runtime/batch`): a slot for each request (the free
slot that holds the most of its prompt, `runtime/slot_prefix`), prompt chunks copied from another
row that computed them, and the prefill in chunks of 128 positions run between rounds
(`prefill(budget)`, chunked prefill); rows leave by `release`, their slot keeping their prompt's
whole chunks. Also the rows' types.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .adaptive import AdaptiveK
from .backend import OrtModel
from .errors import InputError
from .fed_tokens import FedTokens
from .grammar import GrammarState
from .kvcache import KVCache
from .policy import DecodePlan
from .prefix_cache import kept_prefix, prefill_chunks
from .rounds import RowOutput, RowSampler, needs_logits
from .sampling import SamplingParams
from .slot_prefix import Held, SlotPrefixes, extend_end, feed_row
from .stats import GenerationStats


@dataclass(frozen=True)
class RowRequest:
    """One stream of a batch: its prompt, sampling and output (budget, eos, stop strings)."""

    prompt: list[int]
    output: RowOutput
    params: SamplingParams = field(default_factory=SamplingParams)
    grammar: GrammarState | None = None  # structured output: this row's matcher


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
class BatchRow:
    """A row in a slot of the batch. `output` holds its kept tokens, text and stop reason."""

    index: int
    prompt_len: int
    tokens: list[int]  # prompt + committed tokens
    sampler: RowSampler
    output: RowOutput
    stats: GenerationStats
    draft_fed: FedTokens = field(default_factory=FedTokens)  # what its draft's cache holds
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


@dataclass
class Joining:
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


class RowJoins:
    """`BatchDecoder`'s rows coming and going (a mixin: the decoder sets the attributes)."""

    target: OrtModel
    draft: OrtModel | None
    plan: DecodePlan
    limit: int
    t_cache: KVCache
    d_cache: KVCache | None
    slots: list[BatchRow | None]
    joining: list[Joining]
    prefixes: SlotPrefixes
    tuner: AdaptiveK | None
    totals: BatchStats
    share_prompt_kv: bool

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
                       RowSampler(request.params, self.target.spec.vocab_size,
                                  request.prompt, request.grammar, request.output.eos),
                       request.output,
                       GenerationStats(prompt_tokens=len(request.prompt), cached_tokens=reused))
        draft_from = int(self.d_cache.lengths[slot]) if self.d_cache is not None else 0
        self.joining.append(Joining(row, draft_from))
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

    def _next_width(self, join: Joining) -> int:
        cache = self.d_cache if join.drafting else self.t_cache
        assert cache is not None
        a, b = prefill_chunks(int(cache.lengths[join.row.index]), join.row.prompt_len)[0]
        return b - a

    def _prefill_next(self, join: Joining) -> bool:
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
            row.draft_fed.reset(row.tokens[:-1])
            row.draft_prefilled = True
            if self.tuner is not None:
                self.tuner.add_probe_cost(join.draft_s)
                # one row's prompt (what a kept prefix did not hold)
                self.tuner.record_feed(end - join.draft_from, join.draft_s)
            return True
        first, logits = _first_token(model, cache, slot, row, block)
        row.tokens.extend(int(t) for t in first)
        row.output.push(first, logits)
        if not row.output.done and len(row.tokens) >= self.limit:
            row.output.stop_at("context")
        row.stats.new_tokens = len(row.generated)
        join.add_time(time.perf_counter() - t0)
        if self.d_cache is None or row.output.done:
            return True
        if self.share_prompt_kv:  # a self-draft: the target's prompt, no draft prefill
            self.d_cache.copy_from(self.t_cache, int(self.d_cache.lengths[slot]), end, slot)
            row.draft_fed.reset(row.tokens[:-1])
            row.draft_prefilled = True
            if self.tuner is not None and all(r is row for r in self.live):
                self.tuner.draft_fed()  # alone: a probe can run while its catch-up is cheap
            return True
        if self.tuner is not None and self.tuner.k == 0:
            self.d_cache.lengths[slot] = 0
            return True
        join.drafting = True
        return False

    def _share(self, join: Joining, cache: KVCache) -> None:
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

    def _prefilled(self, row: BatchRow, join: Joining | None, draft: bool) -> list[int]:
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

    def _go_live(self, join: Joining) -> None:
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
        prefills only what follows; the draft's row too where it holds their start (a
        self-draft's row copies the target's, as a joining row's does). Returns how many of
        `ids` the slot now holds (0: no free slot holds their start)."""
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
            start = (len(held.draft) if held.draft is not None
                     and tuple(ids[:len(held.draft)]) == held.draft else None)
            if self.draft is not None and self.d_cache is not None and \
                    (start is not None or self.share_prompt_kv):
                self.d_cache.lengths[slot] = start or 0
                if self.share_prompt_kv:
                    self.d_cache.copy_from(self.t_cache, start or 0, end, slot)
                else:
                    feed_row(self.draft, self.d_cache, slot, ids, end)
                draft = tuple(ids[:end])
        except BaseException:
            self.prefixes.forget()
            raise
        self.prefixes.held[slot] = Held(tuple(ids[:end]), draft, held.released)
        self._hold(slot, self.prefixes.held[slot])
        return end


def _first_token(model: OrtModel, cache: KVCache, index: int, row: BatchRow,
                 block: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Feed row `index` the last chunk `block` `[1, n]` of its prompt; returns its first token
    `[1]` and the logits `[1, vocab]` it came from (None for a greedy row that keeps no
    logprobs: its argmax ids are enough, so the logits need not reach the host)."""
    ids_only = not needs_logits(row.sampler, row.output)
    ids, logits = model.forward_rows_greedy(cache, np.asarray([index]), block,
                                            np.asarray([block.shape[1]]),
                                            np.asarray([ids_only]), last=True)
    if ids_only:
        return row.sampler.verify_ids(np.zeros(0, np.int64), ids[0]), None
    mine = logits[0, -1:]
    return row.sampler.verify(np.zeros(0, np.int64), None, mine, 0), mine
