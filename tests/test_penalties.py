"""Presence and frequency penalties (OpenAI's definitions), exact under speculation.

The penalty of a verification row counts the output before that row's position (the drafts
before it included), so speculative output equals target-only output with the same penalties:
greedy token for token, seeded sampling token for token, in batch 1, batches and continuous
batching. Target-only decoding itself is checked against a plain loop that recomputes the whole
sequence every step and applies the formula with a Counter.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specedge.runtime.errors import InputError
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams, penalize
from specedge.runtime.serving import ContinuousBatch

PROMPTS = ["a b a b a b a b", "The quick brown fox", "1, 2, 3, 1, 2, 3,", "Hello there"]
GREEDY = SamplingParams(presence_penalty=0.6, frequency_penalty=1.2)
SEEDED = SamplingParams(temperature=0.8, seed=9, presence_penalty=-0.4, frequency_penalty=0.9)


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


def test_no_penalty_is_the_identity() -> None:
    logits = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert penalize(logits, [1, 1, 2], [3], SamplingParams()) is logits


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("bad", [2.5, -2.01, float("nan"), True, "1"])
def test_penalties_out_of_range_are_refused(field: str, bad: object) -> None:
    with pytest.raises(InputError, match=f"{field} must be a number in \\[-2, 2\\]"):
        SamplingParams(**{field: bad})  # type: ignore[arg-type]


def _plain_loop(pair: Pair, prompt: str, n: int, params: SamplingParams) -> list[int]:
    """Greedy target-only decoding with penalties, the naive way: the whole sequence every
    step, the formula applied with a Counter."""
    ids = pair.encode_prompt(prompt)
    out: list[int] = []
    eos = set(pair.manifest.eos_token_ids)
    for _ in range(n):
        cache = pair.target.new_cache(1, len(ids) + len(out) + 1)
        row = pair.target.forward(cache, np.asarray([ids + out], np.int64))[0, -1]
        row = row.astype(np.float64)
        for token, count in Counter(out).items():
            row[token] -= params.frequency_penalty * count + params.presence_penalty
        out.append(int(np.argmax(row)))
        if out[-1] in eos:
            break
    return out


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-llama-concat"])
def test_speculative_equals_target_only_and_the_plain_loop(fixtures_dir: Path,
                                                           fixture: str) -> None:
    pair = Pair.load(fixtures_dir / fixture)
    for sampling in (GREEDY, SEEDED):
        for prompt in PROMPTS:
            base = GenerationConfig(max_new_tokens=32, sampling=sampling, drafter="model",
                                    num_draft_tokens=3, adaptive=False)
            spec = pair.generate(prompt, base)
            alone = pair.generate(prompt, GenerationConfig(max_new_tokens=32, sampling=sampling,
                                                           drafter="none"))
            assert spec.tokens == alone.tokens, (sampling, prompt)
            assert spec.stats.proposed > 0
            if sampling is GREEDY:
                assert alone.tokens == _plain_loop(pair, prompt, 32, sampling)
    unpenalized = pair.generate(PROMPTS[0], GenerationConfig(max_new_tokens=32, drafter="none"))
    penalized = pair.generate(PROMPTS[0], GenerationConfig(max_new_tokens=32, drafter="none",
                                                           sampling=GREEDY))
    assert unpenalized.tokens != penalized.tokens  # the penalties do something
    assert len(set(penalized.tokens)) > len(set(unpenalized.tokens))


def test_batches_and_continuous_batching_penalize_per_row(concat_pair: Pair) -> None:
    configs = [GenerationConfig(max_new_tokens=24, sampling=s, drafter="model",
                                num_draft_tokens=3, adaptive=False)
               for s in (GREEDY, SamplingParams(), SEEDED, GREEDY)]
    solo = [concat_pair.generate(p, c) for p, c in zip(PROMPTS, configs, strict=True)]
    batch = concat_pair.generate_batch(PROMPTS, configs).results
    server = ContinuousBatch(concat_pair, capacity=2, drafter="model", num_draft_tokens=3,
                             adaptive=False)
    ids = [server.submit(p, c) for p, c in zip(PROMPTS, configs, strict=True)]
    served = server.run()
    for one, row, rid in zip(solo, batch, ids, strict=True):
        assert row.tokens == one.tokens == served[rid].tokens
