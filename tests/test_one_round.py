"""One round, one policy (issue 15): batch 1, batches and continuous batching decode alike.

Regression tests for the divergences between the old copies of the round and the policy, and a
property test: greedy and seeded-sampled results (text, tokens, stop reason) are identical for
every K, drafter and batch composition, stop strings included.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specedge.runtime.detokenize import IncrementalDetokenizer
from specedge.runtime.drafters import NgramDrafter
from specedge.runtime.errors import InputError
from specedge.runtime.pair import GenerationConfig, GenerationResult, Pair
from specedge.runtime.policy import resolve_plan
from specedge.runtime.rounds import RowOutput
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.serving import ContinuousBatch

PROMPT = "The quick brown"
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, seed=1234)


@pytest.fixture(scope="module")
def concat_pair(fixtures_dir: Path) -> Pair:
    return Pair.load(fixtures_dir / "tiny-llama-concat")


def _key(r: GenerationResult) -> tuple[str, list[int], str]:
    return r.text, r.tokens, r.stop_reason


def _cfg(**kw: object) -> GenerationConfig:
    base: dict[str, object] = dict(max_new_tokens=40, adaptive=False)
    base.update(kw)
    return GenerationConfig(**base)  # type: ignore[arg-type]


# ----------------------------------------------------------------- bug 2: seeded batches


def test_seeded_row_is_the_same_in_every_batch_k_and_drafter(concat_pair: Pair) -> None:
    """A seeded row gives one text: alone, next to a greedy row, in a continuous batch, for
    every K and drafter, adaptive or not (the position-keyed sampler does not depend on how the
    round is scheduled)."""
    alone = concat_pair.generate(PROMPT, _cfg(sampling=SEEDED, drafter="none"))
    assert alone.tokens, "nothing generated"
    for k in (1, 3, 8):
        for drafter in ("model", "ngram", "hybrid"):
            for adaptive in (False, True):
                cfg = _cfg(sampling=SEEDED, drafter=drafter, num_draft_tokens=k,
                           adaptive=adaptive)
                assert _key(concat_pair.generate(PROMPT, cfg)) == _key(alone), (k, drafter)
                greedy = replace(cfg, sampling=GREEDY)
                batch = concat_pair.generate_batch(["Hi there", PROMPT], [greedy, cfg])
                assert _key(batch.results[1]) == _key(alone), (k, drafter, adaptive)
    outs = set()
    for _ in range(6):
        server = ContinuousBatch(concat_pair, capacity=2)  # the pair's default: adaptive K
        server.submit("Hi there", _cfg(sampling=GREEDY, adaptive=None))
        rid = server.submit(PROMPT, _cfg(sampling=SEEDED, adaptive=None))
        outs.add(server.run()[rid].text)
    assert outs == {alone.text}


# ----------------------------------------------------- bug 3 + property: stop strings


def _stop_sets(text: str, rng: np.random.Generator, count: int) -> list[tuple[str, ...]]:
    """Random stop sets made of substrings of `text`, so that stops overlap and fire."""
    sets = []
    for _ in range(count):
        stops = []
        for _ in range(int(rng.integers(1, 4))):
            a = int(rng.integers(0, max(1, len(text) - 1)))
            b = min(len(text), a + int(rng.integers(1, 12)))
            if text[a:b].strip():
                stops.append(text[a:b])
        if stops:
            sets.append(tuple(stops))
    return sets


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_stop_strings_cut_like_target_only_for_every_k(tiny_pair: Pair,
                                                       sampling: SamplingParams) -> None:
    """Overlapping stop strings: the text, the tokens and the reason are target-only's for
    every K and drafter; `tokens` ends at the token that completed the stop string."""
    full = tiny_pair.generate(PROMPT, _cfg(sampling=sampling, drafter="none"))
    rng = np.random.default_rng(0)
    for stops in _stop_sets(full.text, rng, 6):
        want = tiny_pair.generate(PROMPT, _cfg(sampling=sampling, drafter="none", stop=stops))
        assert want.stop_reason == "stop"
        assert not any(s in want.text for s in stops)
        # The kept tokens are the shortest prefix whose text holds a stop string.
        detok = IncrementalDetokenizer(tiny_pair.tokenizer,
                                       prompt_ids=tiny_pair.encode_prompt(PROMPT))
        prefix = detok.push_many(want.tokens[:-1])
        assert not any(s in prefix for s in stops)
        completed = prefix + detok.push(want.tokens[-1])
        if len(want.tokens) < 40:  # else the stop string may sit in the final flush
            assert any(s in completed for s in stops), (stops, completed)
        for k in range(1, 9):
            for drafter in ("model", "ngram", "hybrid"):
                got = tiny_pair.generate(PROMPT, _cfg(sampling=sampling, drafter=drafter,
                                                      num_draft_tokens=k, stop=stops))
                assert _key(got) == _key(want), (stops, k, drafter)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_batches_equal_batch1_with_random_stops(concat_pair: Pair,
                                                         data: st.DataObject) -> None:
    """Random rows (greedy or seeded, budget, stop set), random K, drafter and batch makeup:
    every batch row and every continuous-batch request equals target-only batch 1."""
    prompts = ["The quick brown", "def add(a, b):", "Once upon a time " * 4, "Hi",
               "a b c a b c a b c"]  # the last two: n-gram lookups hit
    n = data.draw(st.integers(1, 4))
    rows = []
    for i in range(n):
        prompt = prompts[data.draw(st.integers(0, len(prompts) - 1))]
        sampling = data.draw(st.sampled_from([GREEDY, SEEDED, replace(SEEDED, seed=7)]))
        budget = data.draw(st.integers(8 if i == 0 else 1, 30))  # one row has rounds to draft
        base = concat_pair.generate(prompt, _cfg(sampling=sampling, drafter="none",
                                                 max_new_tokens=budget))
        stops: tuple[str, ...] = ()
        if base.text and data.draw(st.booleans()):
            a = data.draw(st.integers(0, len(base.text) - 1))
            b = data.draw(st.integers(a + 1, min(len(base.text), a + 8)))
            if base.text[a:b].strip():
                stops = (base.text[a:b], base.text[a:min(len(base.text), b + 3)])
        rows.append((prompt, sampling, budget, stops))
    k = data.draw(st.integers(1, 8))
    drafter = data.draw(st.sampled_from(["model", "ngram", "hybrid"]))
    adaptive = data.draw(st.booleans())
    configs = [_cfg(sampling=s, max_new_tokens=b, stop=stops, drafter=drafter,
                    num_draft_tokens=k, adaptive=adaptive) for _, s, b, stops in rows]
    want = [_key(concat_pair.generate(p, replace(c, drafter="none")))
            for (p, *_), c in zip(rows, configs, strict=True)]
    batch = concat_pair.generate_batch([p for p, *_ in rows], configs)
    assert [_key(r) for r in batch.results] == want
    server = ContinuousBatch(concat_pair, capacity=2, drafter=drafter, num_draft_tokens=k,
                             adaptive=adaptive)
    ids = [server.submit(p, c) for (p, *_), c in zip(rows, configs, strict=True)]
    done = server.run()
    assert [_key(done[i]) for i in ids] == want
    # It speculated: a draft model always proposes in a drafting round (n-gram only on a hit),
    # and row 0 lives 8+ tokens unless a stop string ends it early.
    event(f"drafts proposed: batch {batch.stats.proposed > 0}, "
          f"continuous {sum(done[i].stats.proposed for i in ids) > 0}")
    if drafter != "ngram" and len(batch.results[0].tokens) >= 8:
        assert batch.stats.proposed > 0
        assert done[ids[0]].stats.proposed > 0


def test_row_output_cuts_token_by_token(tiny_pair: Pair) -> None:
    """The cut of one chunk equals the cut of the same tokens pushed one by one."""
    ids = tiny_pair.encode_prompt(PROMPT)
    full = tiny_pair.generate(PROMPT, _cfg(drafter="none"))
    stop = full.text[5:9]
    one = RowOutput(40, (), tokenizer=tiny_pair.tokenizer, prompt_ids=ids, stop=(stop,))
    for t in full.tokens:
        one.push([t])
    chunk = RowOutput(40, (), tokenizer=tiny_pair.tokenizer, prompt_ids=ids, stop=(stop,))
    kept = chunk.push(full.tokens)
    assert (chunk.text, chunk.tokens, chunk.reason) == (one.text, one.tokens, one.reason)
    assert kept == chunk.tokens and chunk.reason == "stop"


# ------------------------------------------------------- bug 4: adaptive n-gram drafting


@pytest.mark.real_tuner
def test_adaptive_k_keeps_ngram_drafting_on(tiny_pair: Pair) -> None:
    from specedge.runtime.adaptive import new_tuner

    # The fix itself: n-gram drafts are free, so their tuner knows the draft cost up front (the
    # end-to-end check below passed with the fix reverted: a real tuner's choices vary).
    assert new_tuner("ngram", 4).draft_step == 0.0
    assert new_tuner("model", 4).draft_step is None
    prompt = "a b c a b c a b c a b c"
    fixed = tiny_pair.generate(prompt, _cfg(drafter="ngram", num_draft_tokens=4,
                                            max_new_tokens=48))
    adaptive = tiny_pair.generate(prompt, _cfg(drafter="ngram", num_draft_tokens=4,
                                               max_new_tokens=48, adaptive=True))
    assert adaptive.tokens == fixed.tokens
    assert adaptive.stats.proposed >= 0.4 * fixed.stats.proposed > 0


# --------------------------------------------- bugs 5, 6: the context limit in batches


def _long_prompt(pair: Pair, n: int) -> list[int]:
    ids = pair.encode_prompt("Once upon a time " * 200)
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("n", [502, 509, 511])
def test_batch_row_near_the_context_limit(concat_pair: Pair, n: int) -> None:
    """A row near the limit next to a short row: no crash, and each row equals batch 1 (a
    511-token prompt fits a 512 context in a batch as it does alone)."""
    long_ids = _long_prompt(concat_pair, n)
    long_text = concat_pair.tokenizer.decode(long_ids)
    cfg = _cfg(drafter="model", num_draft_tokens=4, max_new_tokens=20)
    alone = concat_pair.generate_ids(long_ids, cfg)
    assert len(long_ids) + len(alone[0]) == 512 and alone[1] == "context"
    plan = resolve_plan(concat_pair.manifest, has_draft=True, drafter="model", k=4)
    assert plan.limit == 512
    long_alone = concat_pair.generate(long_text, cfg)
    batch = concat_pair.generate_batch([long_text, "Hi"], cfg)
    assert _key(batch.results[0]) == _key(long_alone)
    assert _key(batch.results[1]) == _key(concat_pair.generate("Hi", cfg))


# ------------------------------------------------------ bug 7: drafters in batches


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_batches_draft_the_way_they_are_asked_to(concat_pair: Pair, drafter: str) -> None:
    prompts = ["a b c a b c a b c a b c", "The quick brown"]
    cfg = _cfg(drafter=drafter, num_draft_tokens=4, max_new_tokens=40)
    assert concat_pair.draft is not None
    before = concat_pair.draft.calls
    batch = concat_pair.generate_batch(prompts, cfg)
    for p, r in zip(prompts, batch.results, strict=True):
        assert _key(r) == _key(concat_pair.generate(p, replace(cfg, drafter="none")))
    assert batch.stats.proposed > 0
    if drafter == "ngram":
        assert concat_pair.draft.calls == before, "n-gram drafting ran the draft model"
    else:
        assert concat_pair.draft.calls > before


# ---------------------------------------------------------- bug 8: n-gram lookup


@pytest.mark.parametrize("tokens, k, want", [
    ([7] * 8, 4, [7, 7, 7, 7]),
    ([1, 2] * 5, 4, [1, 2, 1, 2]),
    ([5, 6, 7, 5, 6], 5, [7, 5, 6, 7, 5]),
    ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),
    ([1, 2, 3], 2, []),
])
def test_ngram_lookup_continues_repeating_text(tokens: list[int], k: int,
                                               want: list[int]) -> None:
    assert NgramDrafter().lookup(tokens, k) == want


# ------------------------------------------- bug 9: the draft's context without a draft


def test_context_is_the_targets_when_no_draft_model_runs(tiny_pair: Pair) -> None:
    m = tiny_pair.manifest
    assert m.draft is not None
    short_draft = replace(m, draft=replace(m.draft, max_seq_len=24))
    pair = Pair(short_draft, tiny_pair.tokenizer, tiny_pair.target, tiny_pair.draft)
    for drafter in ("none", "ngram"):
        r = pair.generate(PROMPT, _cfg(drafter=drafter, max_new_tokens=40))
        assert r.stop_reason != "context" and len(r.tokens) == 40, drafter
    r = pair.generate(PROMPT, _cfg(drafter="model", max_new_tokens=40))
    assert r.stop_reason == "context"
    assert len(pair.encode_prompt(PROMPT)) + len(r.tokens) == 24


# ------------------------------------------------- the draft-confidence cut-off (issue 16)


@pytest.mark.parametrize(("sampling", "p_min"), [(GREEDY, 0.02), (SEEDED, 0.05)],
                         ids=["greedy", "seeded"])
def test_confidence_cutoff_drafts_less_and_changes_nothing(concat_pair: Pair,
                                                           sampling: SamplingParams,
                                                           p_min: float) -> None:
    """A cut-off that stops some proposals early (on the tiny pair 0.6 stopped every one, and
    the test compared target-only with itself): shorter drafts and their catch-ups keep the
    output target-only's, at batch 1 and in a batch."""
    prompts = ["The quick brown", "def add(a, b):"]
    base = [concat_pair.generate(p, _cfg(sampling=sampling, drafter="none")) for p in prompts]
    cfg = _cfg(sampling=sampling, drafter="model", num_draft_tokens=6)
    full = [concat_pair.generate(p, cfg) for p in prompts]
    cut_cfg = replace(cfg, draft_p_min=p_min)
    cut = [concat_pair.generate(p, cut_cfg) for p in prompts]
    batch = concat_pair.generate_batch(prompts, cut_cfg)
    assert [_key(r) for r in cut] == [_key(r) for r in base] == [_key(r) for r in full]
    assert [_key(r) for r in batch.results] == [_key(r) for r in base]
    proposed = sum(r.stats.proposed for r in full)
    assert 0 < sum(r.stats.proposed for r in cut) < proposed
    assert 0 < sum(r.stats.proposed for r in batch.results) < proposed
    with pytest.raises(InputError, match="draft_p_min"):
        GenerationConfig(draft_p_min=1.5)
