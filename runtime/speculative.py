"""The batch-1 speculative loop: propose → verify → accept → resample → commit/rollback.

Follows Leviathan et al. 2023 and Chen et al. 2023. The round's pieces (the row's sampler and
its verification, the eos / budget / stop cut) live in `rounds` and are shared with batched
decoding; this module only schedules them for one row. k = 0 is plain target decoding through
the same loop, which is what `--drafter none` runs.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import numpy as np

from .adaptive import AdaptiveK, new_tuner
from .backend import OrtModel
from .drafters import Drafter
from .kvcache import KVCache
from .policy import DecodePlan
from .prefix_cache import prefill
from .rounds import RowOutput, RowSampler, draft_budget, needs_logits, tokens_left, tuned_round
from .stats import GenerationStats

_NO_DRAFTS = np.zeros(0, np.int64)


def decode(target: OrtModel, target_cache: KVCache, drafter: Drafter | None, prompt: list[int],
           plan: DecodePlan, sampler: RowSampler, output: RowOutput, stats: GenerationStats,
           *, tuner: AdaptiveK | None = None) -> Generator[list[int], None, str]:
    """Generate after `prompt`, yielding the tokens each round keeps (see `RowOutput.push`).

    `tuner`: for an adaptive plan, a warm `AdaptiveK` (what earlier generations measured; it
    goes on learning here); None starts a new one.

    On return, `stats` is complete and the reason is the generator's return value ("eos" |
    "max_new_tokens" | "context" | "stop").
    """
    tokens = list(prompt)
    limit = min(plan.limit, target_cache.max_len)
    t0 = time.perf_counter()
    # The prefill's last logits give the first token: no extra target call for it. It feeds
    # the prompt after what the cache holds (a prefix reused from an earlier generation).
    with_logits = needs_logits(sampler, output)  # else argmax ids (maybe from the device)
    logits: np.ndarray | None = None
    if not with_logits:
        first = sampler.verify_ids(_NO_DRAFTS, prefill(target, target_cache, tokens,
                                                       argmax=True))
    else:
        logits = prefill(target, target_cache, tokens, argmax=False)  # [1, vocab]
        first = sampler.verify(_NO_DRAFTS, None, logits, 0)
    tokens.extend(int(t) for t in first)
    # Invariant: the target cache (and the draft's, after catch-up) holds exactly the committed
    # tokens but the last one, which is fed again at the start of the next round.
    if drafter is not None:
        drafter.prefill(tokens)
    stats.prefill_s += time.perf_counter() - t0
    kept = output.push(first, logits)
    stats.new_tokens = len(output.tokens)
    yield kept
    adaptive = (tuner or new_tuner(plan.drafter, plan.k)) if plan.adaptive and drafter else None
    decode_start = time.perf_counter()
    suspended: float | None = None
    try:
        while not output.done:
            if len(tokens) >= limit:
                output.stop_at("context")
                break
            position = len(tokens) - len(prompt)  # output position of the round's first token
            k, k_free = draft_budget(plan, adaptive.k if adaptive else plan.k, output,
                                     len(tokens), limit,
                                     adaptive is not None and adaptive.free_hits_pay())
            proposal = (drafter.propose(tokens, k, sampler, position, k_free)
                        if drafter and (k or k_free) else None)
            drafts = proposal.tokens if proposal is not None else _NO_DRAFTS
            t1 = time.perf_counter()
            # [1, n + 1]; few numpy calls: between two target runs each one costs ~0.1 ms.
            block = (np.concatenate([[tokens[-1]], drafts]).astype(np.int64)[None]
                     if len(drafts) else np.array([[tokens[-1]]], np.int64))
            if not with_logits:  # argmax ids only (taken on the device when the backend can)
                ids = target.forward_argmax(target_cache, block)[0]  # [n + 1]
                verify_s = time.perf_counter() - t1
                emitted = sampler.verify_ids(drafts, ids)
            else:
                logits = target.forward(target_cache, block)[0]  # [n + 1, vocab]
                verify_s = time.perf_counter() - t1
                emitted = sampler.verify(drafts, proposal.probs if proposal else None, logits,
                                         position, tokens[len(prompt):])
            # Commit: accepted drafts + one corrected/bonus token; roll caches back by length.
            tokens.extend(int(t) for t in emitted)
            target_cache.rollback(len(tokens) - 1)
            if drafter is not None:
                drafter.commit(tokens)
            sampler.forget(len(tokens) - len(prompt))
            accepted = len(emitted) - 1
            stats.record_round(len(drafts), accepted, verify_s=verify_s,
                               draft_s=proposal.seconds if proposal else 0.0,
                               draft_calls=proposal.calls if proposal else 0)
            kept = output.push(emitted, logits)
            if adaptive is not None and tuned_round(plan, proposal):
                adaptive.update(len(drafts), accepted,
                                proposal.step_seconds if proposal else 0.0,
                                proposal.step_calls if proposal else 0, verify_s,
                                drafter.catch_up(tokens) if drafter else 0,
                                first_call=(1, proposal.first_width, proposal.first_seconds)
                                if proposal and proposal.first_width else None,
                                tokens_left=tokens_left(output, len(tokens), limit))
            elif adaptive is not None:
                adaptive.free_round(len(drafts) + 1, verify_s, len(emitted), verify_s)
            stats.new_tokens = len(output.tokens)
            suspended = time.perf_counter()
            yield kept
            decode_start += time.perf_counter() - suspended  # the caller's time is not ours
            suspended = None
    finally:  # closed at a yield: decoding ended when it was suspended
        stats.decode_s += (suspended or time.perf_counter()) - decode_start
    if not output.done and len(tokens) >= limit:
        output.stop_at("context")
    return output.finish()
