"""Drafters behind one small interface.

A drafter proposes up to k tokens continuing the committed sequence, with the distribution each
was sampled from (None means a deterministic proposal, i.e. one-hot: the rejection rule then
accepts token d with probability target(d), which keeps sampling exact). After verification the
loop calls `commit(tokens)` with the new committed sequence so the drafter can roll back.

- `ModelDrafter`: the draft model with its own in-place KV cache (Leviathan et al. 2023).
- `NgramDrafter`: model-free prompt lookup (Saxena 2023, "Prompt Lookup Decoding"): find the
  latest earlier occurrence of the trailing n-gram and propose what followed it.
- `HybridDrafter`: the n-gram proposal when it hits, the draft model otherwise.

How many tokens to draft each round: `runtime/adaptive`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .adaptive import AdaptiveK
from .backend import OrtModel
from .fed_tokens import FedTokens
from .kvcache import KVCache
from .manifest import ModelSpec
from .prefix_cache import feed
from .rounds import RowSampler


@dataclass
class Proposal:
    """Draft tokens `[n]` (n <= k) and the distributions they were drawn from `[n, vocab]`."""

    tokens: np.ndarray
    probs: np.ndarray | None  # None: no draft distribution needed (greedy, seeded, n-gram)
    seconds: float = 0.0  # time inside the draft model's run calls
    calls: int = 0
    step_seconds: float = 0.0  # one-token calls after the first, which adaptive k models
    step_calls: int = 0  # drafted positions that cost is spread over
    first_width: int = 0  # tokens the first call fed (0: no call), and its seconds
    first_seconds: float = 0.0
    free: bool = False  # drafted at no model cost (n-gram lookup)


class Drafter(Protocol):
    """What the speculative loop needs from a drafter.

    `k` bounds drafts that cost model steps, `k_free` drafts that cost nothing to make (n-gram
    hits; only verifying them costs). `position` is the output position of the first proposed
    token (for position-keyed sampling, see `rounds.RowSampler`).
    """

    def propose(self, tokens: list[int], k: int, sampler: RowSampler, position: int,
                k_free: int) -> Proposal: ...

    def commit(self, tokens: list[int]) -> None: ...

    def prefill(self, tokens: list[int]) -> None: ...

    def catch_up(self, tokens: list[int]) -> int:
        """Tokens the drafter would feed before its first draft step (0 for free drafts)."""
        ...


class ModelDrafter:
    """Drafts with a small model and its own KV cache.

    Invariant after `commit(tokens)`: the cache holds a prefix of `view(tokens)` of length at
    most `len(view(tokens)) - 1`; `propose` feeds the missing tail (catch-up) then one token
    per step. `view(tokens)` is `tokens` until the draft lagged by more than `window` tokens
    (target-only rounds at k = 0, free n-gram hits): the catch-up then feeds only the last
    `window` of them, and the view skips the ones between (`fed_tokens`).
    """

    window = AdaptiveK.CATCH_UP_WINDOW  # the most tokens a catch-up feeds

    def __init__(self, model: OrtModel, cache: KVCache, p_min: float = 0.0,
                 fed: Sequence[int] = (), prompt_kv: KVCache | None = None) -> None:
        """`fed`: the tokens whose keys and values `cache` already holds (a reused prefix).
        `prompt_kv`: the target's cache, whose keys and values of the prompt the prefill takes
        instead of computing its own (a self-draft: the target's model, quantized)."""
        self.model, self.cache, self.p_min = model, cache, p_min
        self.prompt_kv = prompt_kv
        self.state = FedTokens()  # the tokens whose keys/values are in the cache
        self.state.reset(fed)
        assert int(cache.lengths[0]) == len(self.fed), "the cache holds exactly `fed`"

    def propose(self, tokens: list[int], k: int, sampler: RowSampler, position: int,
                k_free: int = 0) -> Proposal:
        if k <= 0:
            return Proposal(np.zeros(0, np.int64), None)
        self.state.cut(tokens, self.window)  # lagging: skip to the last `window`
        pending = self.view(tokens)[len(self.fed):]
        drafts: list[int] = []
        probs: list[np.ndarray] = []
        seconds = step_seconds = first_seconds = 0.0
        step_calls = calls = first_width = 0
        # Greedy without a confidence cut-off needs only the argmax: on a GPU the greedy head
        # takes it on the device (no vocabulary row crosses to the host), on the CPU it skips
        # the softmax that the confidence would cost.
        argmax_only = sampler.params.greedy and self.p_min <= 0 and not sampler.adjusts_logits
        history = tokens[len(tokens) - position:] if position else []  # the output so far
        while len(drafts) < k:
            if forced := sampler.forced(history + drafts, k - len(drafts)):
                # The grammar forces them: drafted without a call, fed with the next one.
                drafts.extend(forced)
                pending.extend(forced)
                probs.extend(p for t in forced if (p := sampler.certain(t)) is not None)
                continue
            calls += 1
            block = np.asarray([pending], np.int64)
            t0 = time.perf_counter()
            if argmax_only:
                pick = int(self.model.forward_argmax(self.cache, block, last=True)[0, 0])
            else:
                logits = self.model.forward(self.cache, block)[0, -1]
            spent = time.perf_counter() - t0
            seconds += spent
            if calls == 1:  # the tokens committed since the last round, and any catch-up
                first_width, first_seconds = len(pending), spent
            elif len(pending) == 1:
                step_seconds += spent
                step_calls += 1
            self.fed.extend(pending)
            if argmax_only:
                ids = self.model.vocab_ids
                token, p, confidence = (pick if ids is None else int(ids[pick])), None, 1.0
            else:
                token, p, confidence = sampler.draft_token(logits, position + len(drafts),
                                                           self.model.vocab_ids,
                                                           history + drafts)
            if confidence < self.p_min:
                break  # the draft doubts this token: verifying it is likely wasted
            if p is not None:
                probs.append(p)
            drafts.append(token)
            pending = [token]
        return Proposal(np.asarray(drafts, np.int64), np.stack(probs) if probs else None,
                        seconds, calls, step_seconds, step_calls, first_width, first_seconds)

    def prefill(self, tokens: list[int]) -> None:
        """Feed all but the last committed token, so the first round drafts at once."""
        if len(tokens) > 1 and len(self.fed) < len(tokens) - 1:
            assert self.fed == tokens[:len(self.fed)] and not self.skipped, "a reused prefix"
            if self.prompt_kv is not None:
                self.cache.copy_from(self.prompt_kv, len(self.fed), len(tokens) - 1)
            else:
                feed(self.model, self.cache, tokens[:-1])
            self.state.reset(tokens[:-1])

    @property
    def fed(self) -> list[int]:
        """The tokens whose keys and values are in the cache."""
        return self.state.tokens

    @property
    def skipped(self) -> int:
        """Committed tokens the draft's context skips (`FedTokens.view`)."""
        return self.state.skipped

    def view(self, tokens: list[int]) -> list[int]:
        """The committed `tokens` as the cache holds them (`FedTokens.view`)."""
        return self.state.view(tokens)

    def catch_up(self, tokens: list[int]) -> int:
        return self.state.catch_up(tokens, self.window)

    def commit(self, tokens: list[int]) -> None:
        self.cache.rollback(self.state.commit(tokens))


class NgramDrafter:
    """Prompt lookup: continue the latest earlier match of the trailing n-gram."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest trailing
        n-gram. A match that overlaps the tail (repeating text) continues with its own
        proposal, i.e. the repetition period, so it still proposes k tokens."""
        if k <= 0:
            return []
        arr = np.asarray(tokens, np.int64)
        n_tok = len(arr)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = arr[n_tok - n:]
            # windows[i] == arr[i:i+n]; search matches that end before the tail itself.
            windows = np.lib.stride_tricks.sliding_window_view(arr[: n_tok - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                out: list[int] = []
                for j in range(k):
                    at = start + j
                    out.append(int(arr[at]) if at < n_tok else out[at - n_tok])
                return out
        return []

    def propose(self, tokens: list[int], k: int, sampler: RowSampler, position: int,
                k_free: int = 0) -> Proposal:
        found = self.lookup(tokens, max(k, k_free))
        found = sampler.allowed(tokens[len(tokens) - position:] if position else [], found)
        # Free drafts: zero cost per drafted position, so adaptive k sees what they are worth.
        return Proposal(np.asarray(found, np.int64), None, step_calls=len(found), free=True)

    def commit(self, tokens: list[int]) -> None:
        return None

    def prefill(self, tokens: list[int]) -> None:
        return None

    def catch_up(self, tokens: list[int]) -> int:
        return 0


MIN_NGRAM_HIT = 3  # hybrid drafting takes an n-gram proposal of at least this many tokens


def take_ngram(hit: Sequence[int], k: int, min_hit: int = MIN_NGRAM_HIT) -> bool:
    """Hybrid drafting's rule: use an n-gram hit of at least min(min_hit, k) tokens."""
    return len(hit) > 0 and len(hit) >= min(min_hit, k)


class HybridDrafter:
    """N-gram lookup when it proposes at least `min_hit` tokens, the draft model otherwise."""

    def __init__(self, model: ModelDrafter, ngram: NgramDrafter,
                 min_hit: int = MIN_NGRAM_HIT) -> None:
        self.model, self.ngram, self.min_hit = model, ngram, min_hit

    def propose(self, tokens: list[int], k: int, sampler: RowSampler, position: int,
                k_free: int = 0) -> Proposal:
        hit = self.ngram.propose(tokens, 0, sampler, position, k_free)
        if take_ngram(list(hit.tokens), k_free, self.min_hit):
            return hit
        return self.model.propose(tokens, k, sampler, position)

    def commit(self, tokens: list[int]) -> None:
        self.model.commit(tokens)

    def prefill(self, tokens: list[int]) -> None:
        self.model.prefill(tokens)

    def catch_up(self, tokens: list[int]) -> int:
        return self.model.catch_up(tokens)


def ngram_for(drafter: str) -> NgramDrafter | None:
    """The n-gram lookup a drafter uses: every match for "ngram", and only matches of 2+
    tokens for "hybrid" (a 1-token match is mostly chance, the draft model does better)."""
    if drafter == "ngram":
        return NgramDrafter()
    if drafter == "hybrid":
        return NgramDrafter(min_ngram=2)
    return None


def draft_model_cache(drafter: Drafter | None) -> KVCache | None:
    """The draft model's cache of a batch-1 drafter (None for n-gram drafting or none)."""
    if isinstance(drafter, HybridDrafter):
        return drafter.model.cache
    return drafter.cache if isinstance(drafter, ModelDrafter) else None


def self_draft(target: ModelSpec, draft: ModelSpec) -> bool:
    """The draft is the target's own model at another precision (the same source, the same
    layers and heads), so the target's keys and values of a prompt are a close stand-in for
    the draft's own: drafting from them changes which tokens are proposed, never the output."""
    def origin(spec: ModelSpec) -> dict[str, object]:
        return {k: v for k, v in spec.source.items() if k != "quantization"}

    return bool(target.source) and origin(target) == origin(draft) and \
        draft.input_id_map is None and \
        (target.num_layers, target.num_kv_heads, target.head_dim) == \
        (draft.num_layers, draft.num_kv_heads, draft.head_dim)


def build_drafter(drafter: str, model: OrtModel | None, max_len: int,
                  p_min: float = 0.0, *, cache: KVCache | None = None,
                  fed: Sequence[int] = (), prompt_kv: KVCache | None = None) -> Drafter | None:
    """The batch-1 drafter for a plan's drafter name (None: target only); `p_min` is the
    draft model's confidence cut-off. `cache`: the draft model's cache to use (a reused one
    holding `fed`); None allocates one of `max_len`."""
    if drafter == "none":
        return None
    ngram = ngram_for(drafter)
    if drafter == "ngram":
        return ngram
    assert model is not None, "the plan checked that a draft model is loaded"
    if cache is None:
        cache, fed = model.new_cache(1, max_len), ()
    own = ModelDrafter(model, cache, p_min, fed,
                       prompt_kv if prompt_kv is not None and cache.same_layout(prompt_kv)
                       else None)
    return own if ngram is None else HybridDrafter(own, ngram)
