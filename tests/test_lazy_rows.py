"""Speculative sampling warps a target row only when the rejection rule reaches it.

`RowSampler.verify` used to warp all k + 1 rows of the target's logits before the rule looked
at the first (temperature, top-k, top-p and min-p over the whole vocabulary: 0.1-0.7 ms a row of
49k on a CPU, and top-p over several rows cost more than row by row). The rule stops at the
first rejection (the unseeded rule) or the first mismatch (seeded rows, checked greedily
against the position's exponential race), so the rows after it were wasted work. These tests
check that verification now warps exactly the rows it examines and gives the tokens the eager
rule gives for the same draws.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.runtime import rounds
from specedge.runtime.acceptance import accept_greedy, accept_sample
from specedge.runtime.rounds import RowSampler
from specedge.runtime.sampling import SamplingParams, warp_probs

VOCAB = 64
PARAMS = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9),
          SamplingParams(temperature=0.7, top_k=8, min_p=0.05)]


def _case(seed: int, k: int, sharp: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Target logits `[k + 1, vocab]`, draft distributions `[k, vocab]` and drafts drawn from
    them (`sharp` scales the logits: large values make the target nearly certain, so drafts
    are often rejected and sometimes all accepted)."""
    gen = np.random.default_rng(seed)
    logits = (gen.standard_normal((k + 1, VOCAB)) * sharp).astype(np.float32)
    draft = warp_probs(logits[:k] + gen.standard_normal((k, VOCAB)).astype(np.float32),
                       SamplingParams(temperature=1.0))
    drafts = np.asarray([gen.choice(VOCAB, p=row) for row in draft], np.int64)
    return logits, draft, drafts


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(0, 8), sharp=st.sampled_from([0.5, 2, 6]),
       which=st.sampled_from(range(len(PARAMS))), ngram=st.booleans())
def test_lazy_verification_gives_the_eager_rules_tokens(seed: int, k: int, sharp: float,
                                                        which: int, ngram: bool) -> None:
    params = PARAMS[which]
    logits, draft, drafts = _case(seed, k, sharp)
    if ngram:  # a deterministic proposal: one-hot draft distributions
        draft = np.zeros((k, VOCAB))
        draft[np.arange(k), drafts] = 1.0
    sampler = RowSampler(params, VOCAB)
    sampler.rng = np.random.default_rng(seed)
    lazy = sampler.verify(drafts, None if ngram else draft, logits, 0)
    eager = accept_sample(drafts, draft, warp_probs(logits, params), np.random.default_rng(seed))
    assert lazy.tolist() == eager.tolist()


@pytest.mark.parametrize("params", PARAMS)
def test_only_the_examined_rows_are_warped(params: SamplingParams,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    warped: list[int] = []

    def counting(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
        warped.append(int(np.asarray(logits).reshape(-1, VOCAB).shape[0]))
        return warp_probs(logits, p)

    monkeypatch.setattr(rounds, "warp_probs", counting)
    rejected = 0
    for seed in range(60):
        logits, draft, drafts = _case(seed, 6, 6.0)
        sampler = RowSampler(params, VOCAB)
        sampler.rng = np.random.default_rng(seed)
        warped.clear()
        emitted = sampler.verify(drafts, draft, logits, 0)
        # a rows accepted and then the rejected one (or the bonus row): len(emitted) rows
        assert sum(warped) == len(emitted), (seed, warped, emitted)
        rejected += len(emitted) < 7
    assert rejected > 30  # the sharp targets reject early: most rows were never warped


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(0, 8), sharp=st.sampled_from([0.5, 2, 6]),
       which=st.sampled_from(range(len(PARAMS))), position=st.integers(0, 50))
def test_lazy_seeded_verification_gives_the_eager_rules_tokens(seed: int, k: int, sharp: float,
                                                               which: int, position: int) -> None:
    params = dataclasses.replace(PARAMS[which], seed=seed % 1000)
    logits, _, drafts = _case(seed, k, sharp)
    sampler = RowSampler(params, VOCAB)
    # drafts the race would pick, then one changed: every prefix length gets accepted
    race = [int(np.argmax(warp_probs(logits[i:i + 1], params)[0] / sampler.noise(position + i)))
            for i in range(k)]
    cut = seed % (k + 1)
    drafts = np.asarray(race[:cut] + [int(d) for d in drafts[cut:]], np.int64)
    noise = np.stack([sampler.noise(position + j) for j in range(k + 1)])
    eager = accept_greedy(drafts, warp_probs(logits, params) / noise)
    assert sampler.verify(drafts, None, logits, position).tolist() == eager.tolist()


def test_seeded_rows_warp_only_the_examined_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    warped: list[int] = []

    def counting(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
        warped.append(int(np.asarray(logits).reshape(-1, VOCAB).shape[0]))
        return warp_probs(logits, p)

    monkeypatch.setattr(rounds, "warp_probs", counting)
    logits, _, drafts = _case(7, 6, 6.0)
    params = SamplingParams(temperature=0.8, seed=3)
    sampler = RowSampler(params, VOCAB)
    race = int(np.argmax(warp_probs(logits[2:3], params)[0] / sampler.noise(2)))
    drafts[2] = (race + 1) % VOCAB  # a mismatch at position 2 at the latest
    emitted = sampler.verify(drafts, None, logits, 0)
    assert len(emitted) <= 3 and sum(warped) == len(emitted)
