"""Continuous batching: requests join a running speculative batch between rounds.

    server = ContinuousBatch(pair, capacity=4)
    first = server.submit("Hello", GenerationConfig(max_new_tokens=32))
    for request_id, result in server.step():   # one round; finished requests come back
        ...
    server.submit("Another prompt")             # joins at the next round
    results = server.run()                      # until every request is finished

Up to `capacity` requests decode together (one target call per round for all of them); more
wait in a queue and take the slot of the next finished request. Each request keeps its own
sampling parameters, seed, budget and stop strings, and gets exactly its batch-1 output (greedy
and seeded sampling: token for token). The drafter, K and adaptivity belong to the server and
are resolved by the same policy as `Pair.generate`. Needs a `--graph concat` pair.

A finished request's slot keeps its prompt's keys and values, so a request that starts alike
(the next turn of a chat re-sending its history) joins in that slot and prefills only what is
new, with the same output token for token (`runtime/slot_prefix`); `prefill_ahead` prefills a
conversation so far into it while the batch is idle.

A joining request's prefill runs between rounds in chunks of 128 positions, at most
`prefill_budget` prompt tokens between two rounds while other rows decode (all at once when
none does), so a long prompt joining does not stall the streams already running (chunked
prefill, as vLLM and llama.cpp's server schedule it). Its calls, and so its output, are the
same whatever the budget.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .batch import BatchDecoder, BatchRow, RowRequest
from .errors import InputError
from .pair import GenerationConfig, GenerationResult, Pair, Prompt, as_config
from .prefix_cache import PREFILL_CHUNK
from .rounds import RowOutput

# Prompt tokens prefilled between two rounds while rows decode: two chunks (on the 2-core CPU,
# 0.3 s of the fp32 reference target, against ~0.05 s for a round of a few rows).
PREFILL_BUDGET = 2 * PREFILL_CHUNK


@dataclass
class _Pending:
    request_id: int
    request: RowRequest
    submitted: float = field(default_factory=time.perf_counter)  # its stats' total_s start


class ContinuousBatch:
    """A running batch that takes new requests between rounds."""

    def __init__(self, pair: Pair, *, capacity: int = 8, max_len: int = 2048,
                 drafter: str | None = None, num_draft_tokens: int | None = None,
                 adaptive: bool | None = None, compact: bool = True,
                 draft_p_min: float | None = None, keep_prefixes: bool = True,
                 prefill_budget: int | None = PREFILL_BUDGET) -> None:
        if prefill_budget is not None and (isinstance(prefill_budget, bool) or
                                           not isinstance(prefill_budget, int) or
                                           prefill_budget < 1):
            raise InputError(f"prefill_budget must be an integer >= 1 or None, got "
                             f"{prefill_budget!r}")
        self.prefill_budget = prefill_budget
        self.pair = pair
        self._shared = GenerationConfig(drafter=drafter, num_draft_tokens=num_draft_tokens,
                                        adaptive=adaptive, draft_p_min=draft_p_min)
        self.plan = pair.plan(self._shared)
        self.max_len = min(max_len, self.plan.limit)
        self.decoder = BatchDecoder(pair.target, pair.draft, self.plan, capacity=capacity,
                                    max_len=self.max_len, compact=compact,
                                    keep_prefixes=keep_prefixes,
                                    share_prompt_kv=pair.shares_prompt_kv)
        self.queue: deque[_Pending] = deque()
        self.running: dict[int, tuple[_Pending, BatchRow]] = {}  # slot -> request
        self.next_id = 0

    def submit(self, prompt: Prompt, config: GenerationConfig | None = None) -> int:
        """Queue a request; it joins the batch at the next round with a free slot."""
        return self.submit_ids(*self.pair.prompts.prepare(prompt, as_config(config)))

    def submit_ids(self, ids: Sequence[int], config: GenerationConfig | None = None) -> int:
        """`submit` for prompt token ids (as `Pair.generate_ids`)."""
        config = as_config(config)
        self._check_shared(config)
        ids = self.pair.check_ids(ids)
        if len(ids) >= self.max_len:
            raise InputError(f"the prompt has {len(ids)} tokens but the server's context is "
                             f"{self.max_len}; shorten it")
        request = RowRequest(prompt=ids, output=self.pair.new_output(ids, config),
                             params=config.sampling, grammar=self.pair.grammar_state(config))
        pending = _Pending(self.next_id, request)
        self.next_id += 1
        self.queue.append(pending)
        return pending.request_id

    def _check_shared(self, config: GenerationConfig) -> None:
        """Refuse a request whose drafter, K, adaptivity or draft cut-off (where it sets them)
        would decode otherwise than the batch: the rows share them (`generate_batch` refuses
        mixed rows likewise)."""
        fields = ("drafter", "num_draft_tokens", "adaptive", "draft_p_min")
        merged = replace(config, **{f: getattr(self._shared, f) for f in fields
                                    if getattr(config, f) is None})
        asked = self.pair.plan(merged)
        shared = (self.plan.drafter, self.plan.k, self.plan.adaptive, self.plan.draft_p_min)
        if (asked.drafter, asked.k, asked.adaptive, asked.draft_p_min) != shared:
            raise InputError(
                f"this batch decodes with drafter {self.plan.drafter}, K={self.plan.k}, "
                f"adaptive {self.plan.adaptive}, draft_p_min {self.plan.draft_p_min}, which its "
                "rows share; leave them unset in the request (per request: sampling, seed, "
                "max_new_tokens, stop, chat)")

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self.queue)

    def output(self, request_id: int) -> RowOutput | None:
        """The live output of a queued or running request (text and tokens so far, `delta()`
        for streaming); None once it has finished and been returned by `step`."""
        for p in self.queue:
            if p.request_id == request_id:
                return p.request.output
        for p, _ in self.running.values():
            if p.request_id == request_id:
                return p.request.output
        return None

    def cancel(self, request_id: int) -> bool:
        """Drop a request (e.g. its client went away): a queued one leaves the queue, a running
        one frees its slot now, so a waiting request joins at the next round. True if found."""
        for p in list(self.queue):
            if p.request_id == request_id:
                self.queue.remove(p)
                p.request.output.stop_at("cancelled")
                return True
        for slot, (p, row) in list(self.running.items()):
            if p.request_id == request_id:
                row.output.stop_at("cancelled")
                del self.running[slot]
                self.decoder.release(row)
                return True
        return False

    def step(self) -> list[tuple[int, GenerationResult]]:
        """Admit queued requests into free slots, run one round, return what finished."""
        self.admit()
        return self.decode()

    def admit(self) -> None:
        """Join queued requests into free slots and run their prefill calls (within the
        budget); a row whose prefill ends has its first token in its output."""
        while self.queue and self.decoder.has_room():
            p = self.queue.popleft()
            row = self.decoder.join(p.request)
            self.running[row.index] = (p, row)
        self.decoder.prefill(self.prefill_budget if self.decoder.live else None)

    def decode(self) -> list[tuple[int, GenerationResult]]:
        """One round of the running rows; returns what finished."""
        done = []
        for row in self.decoder.step():
            p, _ = self.running.pop(row.index)
            self.decoder.release(row)
            row.stats.total_s = time.perf_counter() - p.submitted  # queueing included
            done.append((p.request_id, GenerationResult.of(row.output, p.request.prompt,
                                                           row.stats)))
        return done

    def prefill_ahead(self, ids: Sequence[int]) -> int:
        """Prefill `ids` (e.g. `pair.conversation_ids(messages, reply)`) into the free slot that
        holds their start, so that a request starting with them prefills only what follows;
        returns how many of them the slot holds (`BatchDecoder.prefill_ahead`). For idle time:
        it runs the models."""
        return self.decoder.prefill_ahead(self.pair.check_ids(ids))

    def run(self) -> dict[int, GenerationResult]:
        """Step until every queued and running request is finished."""
        results: dict[int, GenerationResult] = {}
        while self.busy:
            results.update(self.step())
        return results
