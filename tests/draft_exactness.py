"""Exactness checks for a pair whose draft reads or proposes ids differently from its target
(a padded table, another tokenizer): shared by tests/test_padded_vocab.py and
tests/test_vocab_bridge.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.stats import GenerationStats


def seeded_equals_target_only(pair: Pair, prompts: Sequence[str]) -> None:
    """The position-keyed sampler gives a seeded row one text whatever drafts it: K=1 and 3
    equal target-only token for token."""
    params = SamplingParams(temperature=1.0, seed=77)
    for prompt in prompts:
        alone = pair.generate(prompt, GenerationConfig(max_new_tokens=24, drafter="none",
                                                       sampling=params))
        for k in (1, 3):
            spec = pair.generate(prompt, GenerationConfig(
                max_new_tokens=24, drafter="model", num_draft_tokens=k, adaptive=False,
                sampling=params))
            assert spec.tokens == alone.tokens, (prompt, k)


def sampling_keeps_the_target_distribution(loaded: Pair, unproposable: np.ndarray) -> None:
    """Unseeded sampling (the rejection rule, where the ids in `unproposable` have draft
    probability 0) gives the first two tokens the target's exact distribution (chi-square)."""
    from tests.test_sampling_e2e import exact_first_two, gof

    pair = Pair(replace(loaded.manifest, eos_token_ids=()), loaded.tokenizer, loaded.target,
                loaded.draft)
    params = SamplingParams(temperature=1.0, top_k=40)
    prompt = pair.encode_prompt("The quick brown")
    first, second = exact_first_two(pair, prompt, params)
    assert first[unproposable].sum() > 0.05, "ids the draft cannot propose carry target mass"
    firsts, seconds, rejected = [], [], 0
    for _ in range(1500):
        # Unseeded: a seeded row verifies by the position-keyed race and never reads the
        # draft's probabilities. 4 tokens: room for a round of 2 drafts after the prefill's.
        out, _, st = pair.generate_ids(prompt, GenerationConfig(
            max_new_tokens=4, num_draft_tokens=2, adaptive=False, drafter="model",
            sampling=params))
        firsts.append(out[0])
        seconds.append(out[1])
        rejected += st.proposed - st.accepted
    assert rejected > 0
    assert gof(firsts, first) > 1e-3 and gof(seconds, second) > 1e-3


def greedy_equals_target_only(pair: Pair, prompts: Sequence[str], k: int
                              ) -> list[tuple[list[int], GenerationStats]]:
    """Greedy speculative at fixed `k` == target-only on every prompt (32 tokens); each
    prompt's target-only tokens and the speculative run's statistics."""
    runs = []
    for prompt in prompts:
        ids = pair.encode_prompt(prompt)
        base, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=32, drafter="none"))
        spec, _, st = pair.generate_ids(ids, GenerationConfig(
            max_new_tokens=32, drafter="model", num_draft_tokens=k, adaptive=False))
        assert spec == base, prompt
        runs.append((base, st))
    return runs
