"""The speculative decoding loop: propose → verify → accept → resample → commit/rollback.

Follows Leviathan et al. 2023 and Chen et al. 2023. Greedy mode accepts while the draft equals
the target's argmax; sampling mode uses the rejection rule of `sampling.accept_sample`, so the
output distribution is exactly the target's (warped) distribution. k = 0 is plain target
decoding through the same loop, which is what `--no-speculation` runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np

from .backend import KVCache, OrtModel
from .drafters import AdaptiveK, Drafter
from .sampling import SamplingParams, accept_greedy, accept_sample, warp_probs
from .stats import GenerationStats


@dataclass(frozen=True)
class LoopConfig:
    """Per-generation decoding settings, already validated."""

    max_new_tokens: int
    num_draft_tokens: int  # k (the maximum when adaptive)
    adaptive: bool
    eos_token_ids: tuple[int, ...]


def decode(target: OrtModel, target_cache: KVCache, drafter: Drafter | None, prompt: list[int],
           config: LoopConfig, params: SamplingParams, rng: np.random.Generator,
           stats: GenerationStats, stop: Callable[[list[int]], bool] | None = None
           ) -> Generator[list[int], None, str]:
    """Generate after `prompt`, yielding the tokens committed by each round.

    The caller decides about stop strings through `stop(new_tokens)`; eos, the token budget and
    the context limit are handled here. On return, `stats` is complete and the reason is in the
    generator's return value ("eos" | "max_new_tokens" | "context" | "stop").
    """
    tokens = list(prompt)
    limit = target_cache.max_len
    t0 = time.perf_counter()
    # Invariant: the target cache (and the draft's, after catch-up) holds exactly the committed
    # tokens but the last one, which is fed again at the start of the next round.
    if len(tokens) > 1:
        target.forward(target_cache, np.asarray([tokens[:-1]], np.int64))
    if drafter is not None:
        drafter.prefill(tokens)
    stats.prefill_s += time.perf_counter() - t0
    adaptive = AdaptiveK(config.num_draft_tokens) if config.adaptive and drafter else None
    k_max = config.num_draft_tokens if drafter else 0
    generated = 0
    decode_start = time.perf_counter()
    reason = "max_new_tokens"
    try:
        while generated < config.max_new_tokens:
            if len(tokens) >= limit:
                reason = "context"
                break
            room = limit - len(tokens) - 1  # a round adds at most k + 1 tokens
            k = adaptive.k if adaptive else k_max
            k = max(0, min(k, room, config.max_new_tokens - generated - 1))
            proposal = drafter.propose(tokens, k, params, rng) if drafter and k else None
            drafts = proposal.tokens if proposal is not None else np.zeros(0, np.int64)
            k_used = len(drafts)
            t1 = time.perf_counter()
            block = np.concatenate([[tokens[-1]], drafts]).astype(np.int64)[None]  # [1, k+1]
            logits = target.forward(target_cache, block)[0]
            verify_s = time.perf_counter() - t1
            # logits: [k_used + 1, vocab]
            if params.greedy:
                emitted = accept_greedy(drafts, logits)
            else:
                target_probs = warp_probs(logits, params)  # [k_used + 1, vocab]
                if proposal is not None and proposal.probs is not None:
                    draft_probs = proposal.probs
                else:  # deterministic proposals: one-hot draft distributions
                    draft_probs = np.zeros((k_used, logits.shape[-1]))
                    draft_probs[np.arange(k_used), drafts] = 1.0
                emitted = accept_sample(drafts, draft_probs, target_probs, rng)
            accepted = len(emitted) - 1
            new = [int(t) for t in emitted]
            # Commit: accepted drafts + one corrected/bonus token; roll caches back by length.
            tokens.extend(new)
            target_cache.rollback(len(tokens) - 1)
            if drafter is not None:
                drafter.commit(tokens)
            stats.rounds += 1
            stats.proposed += k_used
            stats.accepted += accepted
            stats.target_calls += 1
            stats.verify_s += verify_s
            stats.draft_lengths.append(k_used)
            stats.accepted_lengths.append(accepted)
            if proposal is not None:
                stats.draft_s += proposal.seconds
                stats.draft_calls += proposal.calls
            if adaptive is not None:
                adaptive.update(k_used, accepted, proposal.step_seconds if proposal else 0.0,
                                proposal.step_calls if proposal else 0, verify_s)
            cut = _first_eos(new, config.eos_token_ids)
            budget = config.max_new_tokens - generated
            out = new[: min(len(new), budget, cut + 1 if cut is not None else len(new))]
            generated += len(out)
            stats.new_tokens = generated
            yield out
            if cut is not None and cut < budget:
                reason = "eos"
                break
            if stop is not None and stop(out):
                reason = "stop"
                break
            if len(tokens) >= limit and generated < config.max_new_tokens:
                reason = "context"
                break
    finally:
        stats.decode_s += time.perf_counter() - decode_start
    return reason


def _first_eos(tokens: list[int], eos: tuple[int, ...]) -> int | None:
    for i, t in enumerate(tokens):
        if t in eos:
            return i
    return None
