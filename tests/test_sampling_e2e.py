"""Speculative sampling keeps the target's distribution, end to end through real ONNX models.

On the tiny seeded pair (vocabulary 320, int4 self-draft so that rejections happen) we run
thousands of generations per setting and compare the empirical distribution of the first and
second emitted tokens with the exact target distributions computed from the target model's
logits (the second by enumerating the first). Chi-square goodness-of-fit at a fixed seed.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams, warp_probs

RUNS = 2500


@pytest.fixture(scope="module")
def pair(tiny_pair: Pair) -> Pair:
    """The tiny pair without eos, so every run emits at least two tokens."""
    from dataclasses import replace

    return Pair(replace(tiny_pair.manifest, eos_token_ids=()), tiny_pair.tokenizer,
                tiny_pair.target, tiny_pair.draft)


def exact_first_two(pair: Pair, prompt: list[int], params: SamplingParams
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Exact distributions of the first and second generated token under the target."""
    model = pair.target
    cache = model.new_cache(1, 64)
    first = warp_probs(model.forward(cache, np.asarray([prompt], np.int64))[0, -1], params)
    second = np.zeros_like(first)
    for tok in np.flatnonzero(first):
        cache.rollback(len(prompt))
        logits = model.forward(cache, np.asarray([[tok]], np.int64))[0, -1]
        second += first[tok] * warp_probs(logits, params)
    return first, second


def gof(observed_tokens: list[int], probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square p-value, pooling categories with expected count < `min_expected`.

    The chi-square approximation is poor for small expected counts (heavy upper tail), so
    flat distributions over many tokens want a larger `min_expected`.
    """
    counts = np.bincount(observed_tokens, minlength=len(probs)).astype(float)
    expected = probs * len(observed_tokens)
    assert counts[expected == 0].sum() == 0, "a token with target probability 0 was emitted"
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("k, params, seeded", [
    (1, SamplingParams(temperature=1.0), False),
    (3, SamplingParams(temperature=0.8, top_k=20), False),
    (5, SamplingParams(temperature=1.2, top_p=0.9), False),
    (3, SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.02), False),
    (3, SamplingParams(temperature=0.8, top_k=20), True),
])
def test_speculative_sampling_matches_target(pair: Pair, k: int, params: SamplingParams,
                                             seeded: bool) -> None:
    """Unseeded rows verify by the rejection rule (Leviathan et al. / Chen et al.: accept with
    min(1, target / draft), else resample from the residual); seeded rows by the
    position-keyed race. Both must emit the target's distribution. (Every run was seeded
    before, so the rejection rule was never checked end to end through real models.)"""
    tiny_pair = pair
    prompt = tiny_pair.encode_prompt("The quick brown")
    first, second = exact_first_two(tiny_pair, prompt, params)
    rng = np.random.default_rng(12345)
    firsts, seconds, accepted, rejected = [], [], 0, 0
    for _ in range(RUNS):
        seed = int(rng.integers(2**31)) if seeded else None
        cfg = GenerationConfig(max_new_tokens=k + 2, num_draft_tokens=k, adaptive=False,
                               drafter="model",
                               sampling=SamplingParams(temperature=params.temperature,
                                                       top_k=params.top_k, top_p=params.top_p,
                                                       min_p=params.min_p, seed=seed))
        out, _, stats = tiny_pair.generate_ids(prompt, cfg)
        firsts.append(out[0])
        seconds.append(out[1])
        accepted += stats.accepted
        rejected += stats.proposed - stats.accepted
    assert accepted > 0 and rejected > 0, "no accepts or no rejections: the test proves little"
    assert gof(firsts, first) > 1e-3
    assert gof(seconds, second) > 1e-3


def test_the_check_can_fail(pair: Pair) -> None:
    """Control: the same test rejects plausible bugs (it has power at this sample size)."""
    params = SamplingParams(temperature=1.0)
    prompt = pair.encode_prompt("The quick brown")
    first, second = exact_first_two(pair, prompt, params)
    rng = np.random.default_rng(0)
    # Off-by-one position bug: the second position's distribution reported as the first.
    assert gof(list(rng.choice(len(first), size=RUNS, p=second)), first) < 1e-3
    # Temperature applied twice (T=1 → T=0.5): a too-peaked distribution.
    cache = pair.target.new_cache(1, 64)
    logits = pair.target.forward(cache, np.asarray([prompt]))[0, -1]
    peaked = warp_probs(logits, SamplingParams(temperature=0.5))
    assert gof(list(rng.choice(len(first), size=RUNS, p=peaked)), first) < 1e-3
    # And the true distribution passes.
    assert gof(list(rng.choice(len(first), size=RUNS, p=first)), first) > 1e-3
