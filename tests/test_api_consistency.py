"""The Python API says the same thing on every path: statistics, token-id checks, stop strings,
the shared plan of a continuous batch, and the types of a config (from an audit of the API;
each test failed before its fix)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from specedge.runtime.errors import InputError
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.serving import ContinuousBatch

PROMPTS = ["The quick brown fox", "Hello there", "Once upon a time, in a land far away"]
FIXED = GenerationConfig(max_new_tokens=16, drafter="model", num_draft_tokens=3, adaptive=False)


@pytest.fixture(scope="module")
def concat_pair(concat_dir: Path) -> Pair:
    return Pair.load(concat_dir)


def test_token_level_generation_times_its_whole_run(concat_pair: Pair) -> None:
    ids = concat_pair.encode_prompt(PROMPTS[0])
    _, _, stats = concat_pair.generate_ids(ids, FIXED)
    assert stats.total_s >= stats.prefill_s + stats.decode_s > 0
    assert stats.end_to_end_tokens_per_s > 0
    from specedge.runtime.stats import GenerationStats

    early = GenerationStats()
    gen = concat_pair.stream_tokens(ids, FIXED, early)
    next(gen)
    gen.close()  # closed early: still timed
    assert early.total_s > 0


def test_a_stream_does_not_count_its_callers_time_as_decoding(concat_pair: Pair) -> None:
    from specedge.runtime.stats import GenerationStats

    stats = GenerationStats()
    pause, pauses = 0.03, 0
    for _ in concat_pair.stream(PROMPTS[0], FIXED, stats):
        time.sleep(pause)
        pauses += 1
    assert pauses >= 2
    assert stats.total_s >= pauses * pause  # the wall clock, the caller's time included
    assert stats.decode_s < (pauses - 1) * pause / 2, (stats.decode_s, pauses)


def test_generate_batch_ids_checks_ids_as_generate_ids_does(concat_pair: Pair) -> None:
    vocab = concat_pair.manifest.vocab_size
    for bad in ([[1, 2, vocab]], [[1, 2, -1]], [[1, 2.0]], "abc", [1, 2, 3], [[]], []):
        with pytest.raises(InputError):
            concat_pair.generate_batch_ids(bad, FIXED)  # type: ignore[arg-type]
    ids = [concat_pair.encode_prompt(p) for p in PROMPTS[:2]]
    as_arrays = concat_pair.generate_batch_ids([np.asarray(i) for i in ids], FIXED)
    assert [r.tokens for r in as_arrays.results] == [
        r.tokens for r in concat_pair.generate_batch_ids(ids, FIXED).results]


def test_a_stop_given_as_one_string_is_one_stop_string(concat_pair: Pair) -> None:
    text = concat_pair.generate(PROMPTS[0], FIXED).text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) > 1 and stop.strip()
    as_string = GenerationConfig(max_new_tokens=16, stop=stop)
    assert as_string.stop == (stop,) == GenerationConfig(stop=[stop]).stop
    got = concat_pair.generate(PROMPTS[0], as_string)
    assert got.stop_reason == "stop" and got.text == text[:text.index(stop)]
    with pytest.raises(InputError, match="stop"):
        GenerationConfig(stop=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("field, value", [("sampling", None), ("adaptive", "no"),
                                          ("chat", "no"), ("chat", 1)])
def test_config_fields_are_typed(field: str, value: object) -> None:
    with pytest.raises(InputError, match=field):
        GenerationConfig(**{field: value})  # type: ignore[arg-type]


def test_batch_rows_carry_the_whole_calls_they_waited_for(concat_pair: Pair) -> None:
    batch = concat_pair.generate_batch(PROMPTS, [FIXED, GenerationConfig(
        max_new_tokens=4, drafter="model", num_draft_tokens=3, adaptive=False), FIXED])
    rows = [r.stats for r in batch.results]
    longest = max(rows, key=lambda s: s.rounds)
    assert longest.rounds == batch.stats.rounds
    assert longest.verify_s == pytest.approx(batch.stats.verify_s)
    assert longest.draft_s == pytest.approx(batch.stats.draft_s)
    assert batch.stats.total_s >= batch.stats.prefill_s + batch.stats.decode_s > 0
    assert batch.stats.end_to_end_tokens_per_s > 0
    for st in rows:
        assert st.draft_s + st.verify_s <= st.decode_s


def test_a_batch_rows_decoding_leaves_out_the_later_rows_prefills(
        concat_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    from specedge.runtime.batch import BatchDecoder

    add = BatchDecoder.add

    def slow_prefill(self: BatchDecoder, request: object) -> object:
        row = add(self, request)  # type: ignore[arg-type]
        time.sleep(0.05)  # a long prompt's prefill
        return row

    monkeypatch.setattr(BatchDecoder, "add", slow_prefill)
    batch = concat_pair.generate_batch(PROMPTS, FIXED)
    first = batch.results[0].stats  # prefilled before two others
    assert first.decode_s < batch.stats.decode_s + 0.03, (first.decode_s, batch.stats.decode_s)


def test_continuous_batch_refuses_a_request_that_would_decode_otherwise(concat_pair: Pair
                                                                         ) -> None:
    server = ContinuousBatch(concat_pair, capacity=2, max_len=256, drafter="model",
                             num_draft_tokens=3, adaptive=False)
    for other in (GenerationConfig(drafter="none"), GenerationConfig(num_draft_tokens=2),
                  GenerationConfig(adaptive=True), GenerationConfig(draft_p_min=0.5)):
        with pytest.raises(InputError, match="rows share"):
            server.submit(PROMPTS[0], other)
    same = server.submit(PROMPTS[0], GenerationConfig(max_new_tokens=16, drafter="model",
                                                      num_draft_tokens=3, adaptive=False))
    unset = server.submit(PROMPTS[1], GenerationConfig(max_new_tokens=16))
    sampled = server.submit(PROMPTS[2], GenerationConfig(
        max_new_tokens=8, sampling=SamplingParams(temperature=0.8, seed=3)))
    results = server.run()
    assert results[same].tokens == concat_pair.generate(PROMPTS[0], FIXED).tokens
    assert results[unset].stats.proposed > 0  # the batch's drafts, as asked at its start
    assert len(results[sampled].tokens) == 8
