"""Where a generation may end: vLLM's `min_tokens`, `ignore_eos` and `stop_token_ids`, exact
under speculation.

The tiny pairs rarely pick eos, so a logit bias on eos makes it come early; `min_tokens` then
bans it (and the stop token ids) from the positions before the minimum, in the draft and in each
verification row by its own position, so speculative output equals target-only output, which
is checked against a plain loop.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specedge.runtime.errors import InputError
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.penalties import suppress_stops
from specedge.runtime.sampling import SamplingParams

from .test_penalties import plain_greedy, rows_three_ways

PROMPTS = ["Hello there", "The quick brown fox", "1, 2, 3,"]
EOS_BIAS = 12.0


@pytest.fixture(scope="module")
def pair(fixtures_dir: Path) -> Pair:
    return Pair.load(fixtures_dir / "tiny-llama")


def _early(pair: Pair, temperature: float = 0.0, **kw: int) -> SamplingParams:
    """Sampling that makes eos likely: a bias on it."""
    eos = pair.manifest.eos_token_ids[0]
    return SamplingParams(temperature=temperature, seed=3 if temperature else None,
                          logit_bias={eos: EOS_BIAS}, **kw)


def _plain_loop(pair: Pair, prompt: str, n: int, min_tokens: int) -> list[int]:
    """The eos bias, and eos banned before `min_tokens`."""
    eos = list(pair.manifest.eos_token_ids)

    def adjust(row: np.ndarray, _: list[int], out: list[int]) -> np.ndarray:
        row[eos[0]] += EOS_BIAS
        if len(out) < min_tokens:
            row[eos] = -np.inf
        return row

    return plain_greedy(pair, prompt, n, adjust)


@settings(max_examples=100, deadline=None)
@given(logits=hnp.arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(3, 20)),
                         elements=st.floats(-10, 10)),
       position=st.integers(0, 10), min_tokens=st.integers(0, 12), data=st.data())
def test_suppress_stops_bans_rows_before_the_minimum(logits: np.ndarray, position: int,
                                                     min_tokens: int,
                                                     data: st.DataObject) -> None:
    vocab = logits.shape[1]
    stops = np.asarray(sorted(data.draw(st.sets(st.integers(0, vocab - 1), min_size=1,
                                                max_size=3))), np.int64)
    got = suppress_stops(logits, position, min_tokens, stops)
    for i in range(logits.shape[0]):
        want = logits[i].copy()
        others = np.isfinite(np.delete(logits[i], stops)).any()  # else it can only end
        if position + i < min_tokens and others:
            want[stops] = -np.inf
        np.testing.assert_array_equal(got[i], want)


def test_a_row_that_can_only_end_keeps_its_stops() -> None:
    row = np.full((1, 5), -np.inf)
    row[0, 2] = 1.0  # a grammar that allows only eos (2)
    np.testing.assert_array_equal(suppress_stops(row, 0, 10, np.asarray([2])), row)


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-llama-concat"])
def test_min_tokens_is_exact_and_holds(fixtures_dir: Path, fixture: str) -> None:
    pair = Pair.load(fixtures_dir / fixture)
    eos = set(pair.manifest.eos_token_ids)
    early = pair.generate(PROMPTS[0], GenerationConfig(max_new_tokens=32, drafter="none",
                                                       sampling=_early(pair)))
    assert early.stop_reason == "eos" and len(early.tokens) < 4  # the bias works
    for min_tokens in (1, 6, 15):
        for temperature in (0.0, 0.9):
            sampling = _early(pair, temperature, min_tokens=min_tokens)
            for prompt in PROMPTS:
                alone = pair.generate(prompt, GenerationConfig(max_new_tokens=32,
                                                               drafter="none",
                                                               sampling=sampling))
                assert not eos & set(alone.tokens[:min_tokens])
                assert len(alone.tokens) > min_tokens
                if temperature == 0.0:
                    assert alone.tokens == _plain_loop(pair, prompt, 32, min_tokens)
                for drafter in ("model", "ngram", "hybrid"):
                    spec = pair.generate(prompt, GenerationConfig(
                        max_new_tokens=32, drafter=drafter, num_draft_tokens=4,
                        adaptive=False, sampling=sampling))
                    assert spec.tokens == alone.tokens, (min_tokens, temperature, drafter)


def test_ignore_eos_and_stop_token_ids(pair: Pair) -> None:
    eos = pair.manifest.eos_token_ids[0]
    for drafter in ("none", "model"):
        config = GenerationConfig(max_new_tokens=24, drafter=drafter, sampling=_early(pair),
                                  ignore_eos=True, num_draft_tokens=3, adaptive=False)
        result = pair.generate(PROMPTS[1], config)
        assert len(result.tokens) == 24 and result.stop_reason == "max_new_tokens"
        assert eos in result.tokens
    free = pair.generate(PROMPTS[1], GenerationConfig(max_new_tokens=24, drafter="none"))
    stop = free.tokens[5]
    cut = free.tokens[:free.tokens.index(stop) + 1]
    for drafter in ("none", "model", "ngram"):
        result = pair.generate(PROMPTS[1], GenerationConfig(
            max_new_tokens=24, drafter=drafter, stop_token_ids=[stop], num_draft_tokens=3,
            adaptive=False))
        assert result.tokens == cut and result.stop_reason == "eos"
    with pytest.raises(InputError, match="stop_token_ids must be a list"):
        GenerationConfig(stop_token_ids=[-1])
    with pytest.raises(InputError, match="min_tokens must be an integer"):
        SamplingParams(min_tokens=-2)


def test_batches_and_continuous_batching(fixtures_dir: Path) -> None:
    concat = Pair.load(fixtures_dir / "tiny-llama-concat")
    base = GenerationConfig(max_new_tokens=20, drafter="model", num_draft_tokens=3,
                            adaptive=False)
    configs = [GenerationConfig(**{**base.__dict__, "sampling": _early(concat, min_tokens=8)}),
               GenerationConfig(**{**base.__dict__, "sampling": _early(concat),
                                   "ignore_eos": True}),
               GenerationConfig(**{**base.__dict__, "sampling": _early(concat, 0.9,
                                                                       min_tokens=5)}),
               base]
    solo = rows_three_ways(concat, PROMPTS + PROMPTS[:1], configs)
    assert len(solo[0].tokens) > 8 and len(solo[1].tokens) == 20
