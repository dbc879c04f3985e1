"""Log-probabilities of generated tokens (`GenerationConfig.logprobs`, the server's `logprobs`).

The math is checked against an independent log-softmax; the decode paths against one target
call over the whole sequence (an independent reference: no decode loop, no verification block);
and asking for logprobs must change no token, speculative or not, greedy or seeded, batch 1,
batches and continuous batching alike.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.special import logsumexp

from specedge.runtime.errors import InputError
from specedge.runtime.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from specedge.runtime.openai_logprobs import logprobs_json
from specedge.runtime.pair import GenerationConfig, GenerationResult, Pair
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.serving import ContinuousBatch
from specedge.runtime.token_bytes import token_bytes

PROMPTS = ["The quick brown", "Once upon a time", "def add(a, b):", "1, 2, 3,"]
SEEDED = SamplingParams(temperature=0.8, seed=77)


@pytest.fixture(scope="module")
def concat_pair(fixtures_dir: Path) -> Pair:
    return Pair.load(fixtures_dir / "tiny-llama-concat")


def _log_softmax(row: np.ndarray) -> np.ndarray:
    """An independent reference (scipy's logsumexp), not the runtime's `log_softmax`."""
    row = row.astype(np.float64)
    return row - logsumexp(row)


# ----------------------------------------------------------------------------- the math


@settings(max_examples=200, deadline=None)
@given(logits=hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(2, 40)),
                         elements=st.floats(-30, 30, width=32)),
       top=st.integers(0, MAX_TOP_LOGPROBS), data=st.data())
def test_token_logprobs_are_the_log_softmax(logits: np.ndarray, top: int,
                                            data: st.DataObject) -> None:
    n, vocab = logits.shape
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    got = token_logprobs(logits, tokens, top)
    for row, token, entry in zip(logits, tokens, got, strict=True):
        want = _log_softmax(row)
        assert entry.token == token
        assert entry.logprob == pytest.approx(want[token], abs=1e-9)
        assert len(entry.top) == min(top, vocab)
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        for t, lp in entry.top:
            assert lp == pytest.approx(want[t], abs=1e-9)
        if entry.top:  # the best, and nothing left out beats the last one shown
            assert entry.top[0][1] == pytest.approx(want.max(), abs=1e-9)
            shown = {t for t, _ in entry.top}
            rest = [want[t] for t in range(vocab) if t not in shown]
            assert not rest or max(rest) <= values[-1] + 1e-12
        assert np.exp(want).sum() == pytest.approx(1.0)


def test_token_logprobs_float16_and_extreme_logits() -> None:
    logits = np.array([[1e4, 0.0, -1e4], [0.0, 0.0, 0.0]], np.float16)
    got = token_logprobs(logits, [1, 2], 3)
    assert got[0].logprob < -1e3 and got[0].top[0] == (0, 0.0)
    assert got[1].logprob == pytest.approx(-np.log(3.0))
    assert [t for t, _ in got[1].top] == [0, 1, 2]  # a tie: the lower id first
    assert all(np.isfinite(e.logprob) for e in got)
    with pytest.raises(ValueError, match="tokens need logits"):
        token_logprobs(logits, [1], 0)
    with pytest.raises(ValueError, match="top must be"):
        token_logprobs(logits, [1, 2], MAX_TOP_LOGPROBS + 1)


@pytest.mark.parametrize("bad", [-1, MAX_TOP_LOGPROBS + 1, True, 1.5, "2"])
def test_generation_config_refuses_bad_logprobs(bad: object) -> None:
    with pytest.raises(InputError, match="logprobs must be None or an integer"):
        GenerationConfig(logprobs=bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- token bytes


def test_token_bytes_rebuild_the_text_byte_level(tiny_pair: Pair) -> None:
    backend = tokenizers.Tokenizer.from_file(str(tiny_pair.manifest.root / "tokenizer.json"))
    text = " Hello wörld — ✓\n\nnaïve 😀"
    ids = backend.encode(text).ids
    parts = [token_bytes(backend, i) for i in ids]
    assert b"".join(parts).decode("utf-8") == backend.decode(ids, skip_special_tokens=False)
    assert tiny_pair.tokenizer.token_bytes(ids[0]) == parts[0]
    assert token_bytes(backend, 10**9) == b""


def test_token_bytes_sentencepiece_style() -> None:
    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁hi": 4, "there": 5}
    model = tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    backend = tokenizers.Tokenizer(model)
    backend.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(),
        tokenizers.decoders.Fuse(), tokenizers.decoders.Strip(" ", 1, 0)])
    assert [token_bytes(backend, i) for i in (4, 5, 1, 2, 3)] == [
        b" hi", b"there", b"\n", b"\xc3", b"\xa9"]
    assert backend.decode([4]) == "hi"  # what decoding one token alone would have lost


def test_logprobs_json_shapes() -> None:
    entries = token_logprobs(np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])), [1, 2], 2)
    alphabet = {0: b"a", 1: b"\xc3", 2: b"\xa9"}
    chat = logprobs_json("chat", entries, alphabet.__getitem__)
    assert chat["refusal"] is None
    first = chat["content"][0]
    assert (first["token"], first["bytes"]) == ("\ufffd", [0xC3])
    assert first["logprob"] == pytest.approx(np.log(0.25))
    assert [t["token"] for t in first["top_logprobs"]] == ["a", "\ufffd"]
    text = logprobs_json("text", entries, alphabet.__getitem__, before=b"xy")
    assert text["token_logprobs"] == [e.logprob for e in entries]
    assert text["text_offset"] == [2, 2]  # "é" is one character once both bytes are there
    # the top tokens and the chosen one, keyed by their text (two partial characters share one)
    assert set(text["top_logprobs"][0]) == {"a", "\ufffd"}
    assert text["top_logprobs"][0]["a"] == pytest.approx(np.log(0.5))


# ----------------------------------------------------------------------------- the decode paths


def _whole_sequence_logprobs(pair: Pair, result: GenerationResult) -> np.ndarray:
    """The target's log-probability of each generated token from one call over the prompt and
    the output (no decode loop, no verification blocks)."""
    ids = result.prompt_tokens + result.tokens
    cache = pair.target.new_cache(1, len(ids))
    logits = pair.target.forward(cache, np.asarray([ids[:-1]], np.int64))[0]  # [n - 1, vocab]
    rows = logits[len(result.prompt_tokens) - 1:]
    return np.array([_log_softmax(row)[t] for row, t in zip(rows, result.tokens, strict=True)])


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-llama-concat", "tiny-llama-split"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_logprobs_change_no_token_and_match_one_whole_call(fixtures_dir: Path, fixture: str,
                                                           sampling: SamplingParams) -> None:
    pair = Pair.load(fixtures_dir / fixture)
    for prompt in PROMPTS:
        base = GenerationConfig(max_new_tokens=24, sampling=sampling, drafter="model",
                                num_draft_tokens=3, adaptive=False)
        plain = pair.generate(prompt, base)
        spec = pair.generate(prompt, replace(base, logprobs=4))
        alone = pair.generate(prompt, replace(base, logprobs=4, drafter="none"))
        assert plain.logprobs is None
        assert spec.tokens == plain.tokens == alone.tokens, prompt
        assert spec.stats.proposed > 0
        assert spec.logprobs is not None and alone.logprobs is not None
        assert [e.token for e in spec.logprobs] == spec.tokens
        want = _whole_sequence_logprobs(pair, spec)
        np.testing.assert_allclose([e.logprob for e in spec.logprobs], want, atol=1e-4)
        np.testing.assert_allclose([e.logprob for e in alone.logprobs], want, atol=1e-4)
        for e in spec.logprobs:
            assert len(e.top) == 4 and e.top[0][1] >= e.logprob - 1e-9
            if sampling.greedy:
                assert e.top[0][0] == e.token


def test_batches_and_continuous_batching_return_batch1_logprobs(concat_pair: Pair) -> None:
    configs = [GenerationConfig(max_new_tokens=20, logprobs=2, drafter="model",
                                num_draft_tokens=3, adaptive=False),
               GenerationConfig(max_new_tokens=12, drafter="model", num_draft_tokens=3,
                                adaptive=False),
               GenerationConfig(max_new_tokens=16, logprobs=0, sampling=SEEDED,
                                drafter="model", num_draft_tokens=3, adaptive=False),
               GenerationConfig(max_new_tokens=20, logprobs=1, stop=("\n",), drafter="model",
                                num_draft_tokens=3, adaptive=False)]
    solo = [concat_pair.generate(p, c) for p, c in zip(PROMPTS, configs, strict=True)]
    batch = concat_pair.generate_batch(PROMPTS, configs).results
    server = ContinuousBatch(concat_pair, capacity=2, drafter="model", num_draft_tokens=3,
                             adaptive=False)
    ids = [server.submit(p, c) for p, c in zip(PROMPTS, configs, strict=True)]
    served = server.run()
    for one, row, rid, config in zip(solo, batch, ids, configs, strict=True):
        for got in (row, served[rid]):
            assert got.tokens == one.tokens
            if config.logprobs is None:
                assert got.logprobs is None
                continue
            assert got.logprobs is not None and one.logprobs is not None
            assert len(got.logprobs) == len(got.tokens)
            np.testing.assert_allclose([e.logprob for e in got.logprobs],
                                       [e.logprob for e in one.logprobs], atol=1e-4)
            assert all(len(e.top) == config.logprobs for e in got.logprobs)


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-llama-concat"])
def test_prompt_logprobs_are_one_whole_calls(fixtures_dir: Path, fixture: str) -> None:
    pair = Pair.load(fixtures_dir / fixture)
    ids = pair.encode_prompt("The quick brown fox jumps over the lazy dog. " * 30)[:400]
    assert len(ids) == 400  # three prefill chunks of 128 and a part
    got = pair.prompt_logprobs(ids, 3)
    cache = pair.target.new_cache(1, len(ids))
    logits = pair.target.forward(cache, np.asarray([ids], np.int64))[0]  # one call, no chunks
    assert [e.token for e in got] == ids[1:]
    want = [_log_softmax(row)[t] for row, t in zip(logits, ids[1:], strict=False)]
    np.testing.assert_allclose([e.logprob for e in got], want, atol=1e-4)
    assert all(len(e.top) == 3 for e in got)
    assert pair.prompt_logprobs(ids[:1]) == []
    with pytest.raises(InputError, match="outside the vocabulary"):
        pair.prompt_logprobs([10**6])


def test_a_prompt_of_token_ids(tiny_pair: Pair) -> None:
    text = tiny_pair.generate("The quick brown", GenerationConfig(max_new_tokens=8))
    ids = tiny_pair.generate(text.prompt_tokens, GenerationConfig(max_new_tokens=8))
    assert (ids.tokens, ids.text) == (text.tokens, text.text)
    assert tiny_pair.encode_prompt([3, 4]) == [3, 4]
    with pytest.raises(InputError, match="does not go through the chat template"):
        tiny_pair.generate([3, 4], GenerationConfig(max_new_tokens=2, chat=True))
    with pytest.raises(InputError, match="outside the vocabulary"):
        tiny_pair.generate([3, 10**6], GenerationConfig(max_new_tokens=2))
