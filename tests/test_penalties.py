"""Logit bias and presence, frequency and repetition penalties, exact under speculation.

The penalty of a verification row counts the output before that row's position (the drafts
before it included; the repetition penalty the prompt too), so speculative output equals
target-only output with the same penalties: greedy token for token, seeded sampling token for
token, in batch 1, batches and continuous batching. Target-only decoding itself is checked
against a plain loop that recomputes the whole sequence every step and applies the formulas
with a Counter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specedge.runtime.errors import InputError
from specedge.runtime.pair import GenerationConfig, GenerationResult, Pair
from specedge.runtime.penalties import penalize
from specedge.runtime.sampling import MAX_LOGIT_BIAS, SamplingParams, logit_bias_from_json
from specedge.runtime.serving import ContinuousBatch

PROMPTS = ["a b a b a b a b", "The quick brown fox", "1, 2, 3, 1, 2, 3,", "Hello there"]
GREEDY = SamplingParams(presence_penalty=0.6, frequency_penalty=1.2)
SEEDED = SamplingParams(temperature=0.8, seed=9, presence_penalty=-0.4, frequency_penalty=0.9)
REPEAT = SamplingParams(repetition_penalty=1.8, logit_bias=((5, -100.0), (7, 2.5)))
REPEAT_SEEDED = SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.3,
                               logit_bias={11: 3.0}, frequency_penalty=0.3)


@pytest.fixture(scope="module")
def concat_pair(fixtures_dir: Path) -> Pair:
    return Pair.load(fixtures_dir / "tiny-llama-concat")


@settings(max_examples=150, deadline=None)
@given(logits=hnp.arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(2, 30)),
                         elements=st.floats(-10, 10, width=32)),
       presence=st.floats(-2, 2), frequency=st.floats(-2, 2), data=st.data())
def test_each_row_counts_the_output_before_it(logits: np.ndarray, presence: float,
                                              frequency: float, data: st.DataObject) -> None:
    n, vocab = logits.shape
    history = data.draw(st.lists(st.integers(0, vocab - 1), max_size=12))
    drafts = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n - 1, max_size=n - 1))
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    got = penalize(logits, history, drafts, params)
    for i in range(n):
        seen = Counter(history + drafts[:i])
        want = logits[i].astype(np.float64).copy()
        for token, count in seen.items():
            want[token] -= frequency * count + presence
        np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-9)


def _reference(row: np.ndarray, prompt: list[int], output: list[int],
               params: SamplingParams) -> np.ndarray:
    """One position's adjusted logits, the plain way: the bias, then the repetition penalty
    over the prompt and the output, then the presence and frequency penalties."""
    want = row.astype(np.float64).copy()
    for token, bias in params.logit_bias:
        want[token] += bias
    p = params.repetition_penalty
    for token in set(prompt) | set(output):
        want[token] = want[token] / p if want[token] > 0 else want[token] * p
    for token, count in Counter(output).items():
        want[token] -= params.frequency_penalty * count + params.presence_penalty
    return want


@settings(max_examples=150, deadline=None)
@given(logits=hnp.arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(2, 30)),
                         elements=st.floats(-10, 10, width=32)),
       repetition=st.floats(0.05, 10), presence=st.floats(-2, 2), data=st.data())
def test_bias_then_repetition_then_presence_each_row(logits: np.ndarray, repetition: float,
                                                     presence: float,
                                                     data: st.DataObject) -> None:
    n, vocab = logits.shape
    token = st.integers(0, vocab - 1)
    prompt = data.draw(st.lists(token, max_size=12))
    history = data.draw(st.lists(token, max_size=12))
    drafts = data.draw(st.lists(token, min_size=n - 1, max_size=n - 1))
    bias = data.draw(st.dictionaries(token, st.floats(-100, 100), max_size=5))
    params = SamplingParams(repetition_penalty=repetition, presence_penalty=presence,
                            logit_bias=bias)
    got = penalize(logits, history, drafts, params, prompt)
    for i in range(n):
        want = _reference(logits[i], prompt, history + drafts[:i], params)
        np.testing.assert_allclose(got[i], want, rtol=1e-12, atol=1e-9)


def test_logit_bias_and_repetition_penalty_are_checked() -> None:
    assert SamplingParams(logit_bias={9: 1, 2: -3.5}).logit_bias == ((2, -3.5), (9, 1.0))
    assert SamplingParams(logit_bias={9: 1}) == SamplingParams(logit_bias=[(9, 1.0)])
    assert not SamplingParams(repetition_penalty=1.0, logit_bias={}).adjusts_logits
    for bad in ({-1: 1.0}, {1: 101.0}, {1: float("nan")}, {True: 1.0}, [(1, 2), (1, 3)],
                [(1,)], "1:2", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}):
        with pytest.raises(InputError, match="logit_bias"):
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]
    for value in (0, -1, 10.5, float("inf"), "2"):
        with pytest.raises(InputError, match=r"repetition_penalty must be a number in \(0, 10\]"):
            SamplingParams(repetition_penalty=value)  # type: ignore[arg-type]
    assert logit_bias_from_json({"50": 2, "3": -100}) == ((3, -100.0), (50, 2.0))
    assert logit_bias_from_json(None) == ()
    for bad_json in ({"a": 1}, {"-1": 1}, {" 1": 1}, {"1": "2"}, [1, 2], {"1": 1e9}):
        with pytest.raises(InputError, match="logit_bias"):
            logit_bias_from_json(bad_json)


def test_a_bias_outside_the_vocabulary_is_refused(fixtures_dir: Path) -> None:
    pair = Pair.load(fixtures_dir / "tiny-llama")
    vocab = pair.target.spec.vocab_size
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(logit_bias={vocab: 5}))
    with pytest.raises(InputError, match=f"logit_bias names token id {vocab}, but the "
                                         f"vocabulary has {vocab} ids"):
        pair.generate("Hi", config)


def test_no_penalty_is_the_identity() -> None:
    logits = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert penalize(logits, [1, 1, 2], [3], SamplingParams()) is logits


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("bad", [2.5, -2.01, float("nan"), True, "1"])
def test_penalties_out_of_range_are_refused(field: str, bad: object) -> None:
    with pytest.raises(InputError, match=f"{field} must be a number in \\[-2, 2\\]"):
        SamplingParams(**{field: bad})  # type: ignore[arg-type]


def plain_greedy(pair: Pair, prompt: str, n: int,
                 adjust: Callable[[np.ndarray, list[int], list[int]], np.ndarray]) -> list[int]:
    """Greedy target-only decoding the naive way: the whole sequence through the target every
    step, its last logits adjusted by `adjust(logits, prompt ids, output so far)`, the argmax
    taken, until eos or `n` tokens."""
    ids = pair.encode_prompt(prompt)
    out: list[int] = []
    eos = set(pair.manifest.eos_token_ids)
    for _ in range(n):
        cache = pair.target.new_cache(1, len(ids) + len(out) + 1)
        row = pair.target.forward(cache, np.asarray([ids + out], np.int64))[0, -1]
        out.append(int(np.argmax(adjust(row.astype(np.float64), ids, out))))
        if out[-1] in eos:
            break
    return out


def _plain_loop(pair: Pair, prompt: str, n: int, params: SamplingParams) -> list[int]:
    """With the penalties applied by the formulas (`_reference`)."""
    return plain_greedy(pair, prompt, n, lambda row, ids, out: _reference(row, ids, out, params))


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-llama-concat"])
def test_speculative_equals_target_only_and_the_plain_loop(fixtures_dir: Path,
                                                           fixture: str) -> None:
    pair = Pair.load(fixtures_dir / fixture)
    for sampling in (GREEDY, SEEDED, REPEAT, REPEAT_SEEDED):
        for prompt in PROMPTS:
            base = GenerationConfig(max_new_tokens=32, sampling=sampling, drafter="model",
                                    num_draft_tokens=3, adaptive=False)
            spec = pair.generate(prompt, base)
            alone = pair.generate(prompt, GenerationConfig(max_new_tokens=32, sampling=sampling,
                                                           drafter="none"))
            assert spec.tokens == alone.tokens, (sampling, prompt)
            assert spec.stats.proposed > 0
            if sampling.greedy:
                assert alone.tokens == _plain_loop(pair, prompt, 32, sampling)
            if sampling is REPEAT:
                assert 5 not in alone.tokens  # banned by its bias
    unpenalized = pair.generate(PROMPTS[0], GenerationConfig(max_new_tokens=32, drafter="none"))
    penalized = pair.generate(PROMPTS[0], GenerationConfig(max_new_tokens=32, drafter="none",
                                                           sampling=GREEDY))
    assert unpenalized.tokens != penalized.tokens  # the penalties do something
    assert len(set(penalized.tokens)) > len(set(unpenalized.tokens))
    repeated = pair.generate(PROMPTS[0], GenerationConfig(max_new_tokens=32, drafter="none",
                                                          sampling=REPEAT))
    assert repeated.tokens != unpenalized.tokens


def test_a_large_bias_forces_its_token(fixtures_dir: Path) -> None:
    pair = Pair.load(fixtures_dir / "tiny-llama")
    plain = pair.generate("Hello there", GenerationConfig(max_new_tokens=8, drafter="none"))
    token = next(t for t in range(100, 300) if t not in plain.tokens)
    forced = pair.generate("Hello there", GenerationConfig(
        max_new_tokens=8, drafter="model", num_draft_tokens=3, adaptive=False,
        sampling=SamplingParams(logit_bias={token: 100})))
    assert forced.tokens == [token] * 8


def test_batches_and_continuous_batching_penalize_per_row(concat_pair: Pair) -> None:
    configs = [GenerationConfig(max_new_tokens=24, sampling=s, drafter="model",
                                num_draft_tokens=3, adaptive=False)
               for s in (GREEDY, SamplingParams(), SEEDED, REPEAT, REPEAT_SEEDED, GREEDY)]
    rows_three_ways(concat_pair, PROMPTS + PROMPTS[:2], configs)


def rows_three_ways(pair: Pair, prompts: list[str],
                    configs: list[GenerationConfig]) -> list[GenerationResult]:
    """Each row decoded alone, in one batch, and through a continuous batch of two slots (the
    configs draft with the model, K=3, fixed); checks the three agree token for token and
    returns the rows decoded alone."""
    solo = [pair.generate(p, c) for p, c in zip(prompts, configs, strict=True)]
    batch = pair.generate_batch(prompts, configs).results
    server = ContinuousBatch(pair, capacity=2, drafter="model", num_draft_tokens=3,
                             adaptive=False)
    ids = [server.submit(p, c) for p, c in zip(prompts, configs, strict=True)]
    served = server.run()
    for one, row, rid in zip(solo, batch, ids, strict=True):
        assert row.tokens == one.tokens == served[rid].tokens
    return solo
