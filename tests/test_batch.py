"""Batched speculative decoding: every row is exactly what batch-1 decoding gives it.

Greedy rows are compared token for token with batch-1 runs (prompts of very different lengths,
rows stopping at different times through eos, budgets and stop strings, compaction on and off).
Sampled rows with mixed parameters keep the target distribution (chi-square, as for batch 1).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specedge.runtime.errors import InputError
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams

from .test_sampling_e2e import exact_first_two, gof

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog and keeps running through the forest " * 3,
    "def add(a, b):",
    "Once upon a time, in a land far away, there lived a king who " * 6,
]


@pytest.fixture(scope="module")
def concat_pair(fixtures_dir: Path) -> Pair:
    return Pair.load(fixtures_dir / "tiny-llama-concat")


def _batch1(pair: Pair, prompt: str, cfg: GenerationConfig) -> tuple[list[int], str, str]:
    result = pair.generate(prompt, cfg)
    return result.tokens, result.text, result.stop_reason


@pytest.mark.parametrize("k, adaptive, compact", [(1, False, True), (3, False, True),
                                                  (5, False, False), (4, True, True)])
def test_greedy_rows_equal_batch1(concat_pair: Pair, k: int, adaptive: bool,
                                  compact: bool) -> None:
    budgets = [40, 9, 33, 21]
    configs = [GenerationConfig(max_new_tokens=b, num_draft_tokens=k, adaptive=adaptive,
                                drafter="model") for b in budgets]
    # Row 2 also stops on a string taken from its own batch-1 output (a mid-generation stop).
    alone = _batch1(concat_pair, PROMPTS[2], replace(configs[2], adaptive=False))
    stop = alone[1][len(alone[1]) // 2:len(alone[1]) // 2 + 3]
    if stop.strip():
        configs[2] = replace(configs[2], stop=(stop,))
    batch = concat_pair.generate_batch(PROMPTS, configs, compact=compact)
    lengths = set()
    for prompt, cfg, got in zip(PROMPTS, configs, batch.results, strict=True):
        want = _batch1(concat_pair, prompt, replace(cfg, adaptive=False))
        target_only = _batch1(concat_pair, prompt, replace(cfg, drafter="none"))
        assert (got.text, got.stop_reason) == want[1:]
        assert got.text == target_only[1]
        if got.stop_reason != "stop":
            assert got.tokens == want[0] == target_only[0]
        else:  # the text is cut at the stop string; tokens come in chunks of a round
            shorter = min(len(got.tokens), len(want[0]), len(target_only[0]))
            assert got.tokens[:shorter] == want[0][:shorter] == target_only[0][:shorter]
        lengths.add(len(got.tokens))
    assert len(lengths) > 1, "rows should stop at different times"
    assert batch.stats.new_tokens == sum(len(r.tokens) for r in batch.results)
    assert batch.stats.proposed > 0 and batch.stats.accepted > 0
    assert batch.stats.live_rows[0] == 4 and batch.stats.live_rows[-1] < 4


def test_batch_target_only_and_single_row(concat_pair: Pair) -> None:
    cfg = GenerationConfig(max_new_tokens=12, drafter="none")
    batch = concat_pair.generate_batch(PROMPTS[:3], cfg)
    for prompt, got in zip(PROMPTS[:3], batch.results, strict=True):
        assert got.tokens == _batch1(concat_pair, prompt, cfg)[0]
    assert batch.stats.proposed == 0
    one = concat_pair.generate_batch([PROMPTS[1]], GenerationConfig(max_new_tokens=12,
                                                                      drafter="model",
                                                                      num_draft_tokens=2))
    assert one.results[0].tokens == batch.results[1].tokens
    assert one.stats.proposed > 0


def test_eos_rows_leave_the_batch(concat_pair: Pair) -> None:
    """A row whose eos comes early finishes while the others go on (eos = its 3rd token)."""
    first = concat_pair.generate(PROMPTS[0], GenerationConfig(max_new_tokens=6, drafter="none"))
    eos = first.tokens[2]
    pair = Pair(replace(concat_pair.manifest, eos_token_ids=(eos,)), concat_pair.tokenizer,
                concat_pair.target, concat_pair.draft)
    cfg = GenerationConfig(max_new_tokens=30, drafter="model", num_draft_tokens=3,
                           adaptive=False)
    batch = pair.generate_batch(PROMPTS, cfg)
    assert batch.results[0].stop_reason == "eos"
    for prompt, got in zip(PROMPTS, batch.results, strict=True):
        assert got.tokens == pair.generate(prompt, cfg).tokens


def test_batch_errors(concat_pair: Pair, tiny_pair: Pair) -> None:
    with pytest.raises(InputError, match="concat"):
        tiny_pair.generate_batch(PROMPTS[:2], GenerationConfig(max_new_tokens=4))
    with pytest.raises(InputError, match="share"):
        concat_pair.generate_batch(PROMPTS[:2], [GenerationConfig(num_draft_tokens=2),
                                                 GenerationConfig(num_draft_tokens=3)])
    with pytest.raises(InputError, match="configs"):
        concat_pair.generate_batch(PROMPTS[:2], [GenerationConfig()])
    with pytest.raises(InputError, match="non-empty"):
        concat_pair.generate_batch([], GenerationConfig())


RUNS = 1500
MIXED = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=20),
         SamplingParams(temperature=1.2, top_p=0.9),
         SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.02)]


def test_batched_sampling_keeps_each_rows_distribution(concat_pair: Pair) -> None:
    """Batch 4, a different prompt and sampling setting per row, k=3: chi-square per row."""
    pair = Pair(replace(concat_pair.manifest, eos_token_ids=()), concat_pair.tokenizer,
                concat_pair.target, concat_pair.draft)
    prompts = ["The quick brown", "def add(a", "Once upon", "Hello there, my"]
    ids = [pair.encode_prompt(p) for p in prompts]
    exact = [exact_first_two(pair, i, p) for i, p in zip(ids, MIXED, strict=True)]
    rng = np.random.default_rng(7)
    firsts: list[list[int]] = [[] for _ in prompts]
    seconds: list[list[int]] = [[] for _ in prompts]
    accepted = same = 0
    for run in range(RUNS):
        # Even runs are seeded (position-keyed sampling), odd runs are not (rejection rule).
        configs = [GenerationConfig(max_new_tokens=5, num_draft_tokens=3, adaptive=False,
                                    drafter="model",
                                    sampling=replace(p, seed=int(rng.integers(2**31))
                                                     if run % 2 == 0 else None))
                   for p in MIXED]
        batch = pair.generate_batch(prompts, configs)
        for row, result in enumerate(batch.results):
            firsts[row].append(result.tokens[0])
            seconds[row].append(result.tokens[1])
        accepted += batch.stats.accepted
        if run < 200 and run % 2 == 0:  # same seed, same row alone: the same tokens
            same += sum(pair.generate_ids(i, c)[0] == r.tokens
                        for i, c, r in zip(ids, configs, batch.results, strict=True))
    assert same == 400  # position-keyed: a seeded row is its batch-1 run, token for token
    assert accepted > 0, "no draft was ever accepted: the test would prove nothing"
    for row in range(len(prompts)):
        first, second = exact[row]
        # Pool expected counts < 10: these distributions are flat over hundreds of tokens.
        assert gof(firsts[row], first, 10) > 1e-3, f"row {row}: first token"
        assert gof(seconds[row], second, 10) > 1e-3, f"row {row}: second token"


def test_continuous_batching_rows_join_between_rounds(concat_pair: Pair) -> None:
    """Capacity 2, five requests: later ones wait, then take freed slots mid-run."""
    from specedge.runtime.serving import ContinuousBatch

    server = ContinuousBatch(concat_pair, capacity=2, max_len=512, drafter="model",
                             num_draft_tokens=3, adaptive=False)
    budgets = [6, 25, 11, 4, 18]
    configs = [GenerationConfig(max_new_tokens=b) for b in budgets]
    first = server.submit(PROMPTS[0], configs[0])
    results = dict(server.step())  # one round with one row
    assert not results and len(server.decoder.live) == 1
    ids = [first] + [server.submit(p, c) for p, c in zip(PROMPTS[1:] + PROMPTS[:1],
                                                          configs[1:], strict=True)]
    results.update(server.run())
    assert sorted(results) == ids and not server.busy
    assert max(server.decoder.totals.live_rows) == 2  # never more than the capacity
    for rid, prompt, cfg in zip(ids, PROMPTS + PROMPTS[:1], configs, strict=True):
        want = concat_pair.generate(prompt, replace(cfg, drafter="none"))
        assert results[rid].tokens == want.tokens and results[rid].text == want.text
        st = results[rid].stats  # from its submission: queueing, prefill and decoding
        assert st.total_s >= st.prefill_s + st.decode_s > 0
    with pytest.raises(InputError, match="context"):
        server.submit("x " * 600, GenerationConfig(max_new_tokens=8))


def test_adaptive_batches_warm_start_from_the_last_batch_of_that_size(concat_pair: Pair
                                                                      ) -> None:
    pair = Pair(concat_pair.manifest, concat_pair.tokenizer, concat_pair.target,
                concat_pair.draft)
    cfg = GenerationConfig(max_new_tokens=12, drafter="model", num_draft_tokens=4,
                           adaptive=True)
    pair.generate_batch(PROMPTS[:2], cfg)
    tuner = pair.tuners.learned[(2, "model", 4)]
    rounds = tuner.rounds
    again = pair.generate_batch(PROMPTS[:2], cfg)
    assert pair.tuners.learned[(2, "model", 4)].rounds > rounds  # continued, not restarted
    for prompt, got in zip(PROMPTS[:2], again.results, strict=True):
        assert got.tokens == pair.generate(prompt, replace(cfg, drafter="none")).tokens


def test_a_new_batch_size_warm_starts_from_the_nearest_one(concat_pair: Pair) -> None:
    """The first batch at a size starts from the tuner of the nearest size (same drafter and
    k), not from a cold prior: its costs, keyed by tokens fed, carry over."""
    pair = Pair(concat_pair.manifest, concat_pair.tokenizer, concat_pair.target,
                concat_pair.draft)
    cfg = GenerationConfig(max_new_tokens=12, drafter="model", num_draft_tokens=4,
                           adaptive=True)
    pair.generate_batch(PROMPTS[:2], cfg)
    pair.generate_batch(PROMPTS, replace(cfg, num_draft_tokens=3))  # another k: not a source
    learned = pair.tuners.learned[(2, "model", 4)]
    got = pair.generate_batch(PROMPTS[:3], cfg)
    tuner = pair.tuners.learned[(3, "model", 4)]
    assert tuner.rounds >= learned.rounds + got.stats.rounds - 1  # continued from B=2's
    assert set(learned.verify.mean) <= set(tuner.verify.mean)
    assert (4, "model", 4) not in pair.tuners.learned
    for prompt, row in zip(PROMPTS[:3], got.results, strict=True):
        assert row.tokens == pair.generate(prompt, replace(cfg, drafter="none")).tokens
    one = pair.tuners.take((1, "model", 4))  # nearest: B=2, not B=3
    assert one is not None and one.rounds == pair.tuners.learned[(2, "model", 4)].rounds


def test_generate_batch_ids_is_generate_batch_on_token_ids(concat_pair: Pair) -> None:
    cfg = GenerationConfig(max_new_tokens=10, drafter="model", num_draft_tokens=2,
                           adaptive=False)
    by_text = concat_pair.generate_batch(PROMPTS[:3], cfg)
    ids = [r.prompt_tokens for r in by_text.results]
    by_ids = concat_pair.generate_batch_ids(ids, cfg)
    assert [r.tokens for r in by_ids.results] == [r.tokens for r in by_text.results]
    assert all(r.text == "" and r.prompt_tokens == i for r, i in zip(by_ids.results, ids,
                                                                      strict=True))
    for bad in ([], [[1, 2], []]):
        with pytest.raises(InputError, match="token-id prompts"):
            concat_pair.generate_batch_ids(bad, cfg)
    with pytest.raises(InputError, match="configs"):
        concat_pair.generate_batch_ids(ids, [cfg])


def test_continuous_batch_cancel_frees_the_slot(concat_pair: Pair) -> None:
    from specedge.runtime.serving import ContinuousBatch

    server = ContinuousBatch(concat_pair, capacity=1, drafter="model", num_draft_tokens=3)
    cfg = GenerationConfig(max_new_tokens=30)
    first = server.submit(PROMPTS[0], cfg)
    second = server.submit(PROMPTS[2], cfg)
    third = server.submit(PROMPTS[1], cfg)
    assert server.step() == [] and server.queued == 2
    out = server.output(first)
    assert out is not None and out.tokens and not out.done
    assert server.cancel(first) and server.cancel(third) and not server.cancel(99)
    assert out.reason == "cancelled" and server.queued == 1
    results = server.run()
    assert set(results) == {second}
    assert results[second].tokens == concat_pair.generate(PROMPTS[2], cfg).tokens


def test_adaptive_at_k0_defers_the_draft_prefill(concat_pair: Pair) -> None:
    """A batch that joins a tuner decoding at k = 0 does not prefill the draft (at batch 8 on
    a CPU that prefill was 2.3 s of 16.5 for draft outputs nobody read). When drafting
    resumes, a catch-up feeds the rows' prompts, apart from the drafting calls, and the
    rows stay exactly target-only. (The catch-up: one call, or in place a call per row.)"""
    from specedge.runtime.adaptive import AdaptiveK
    from specedge.runtime.batch import BatchDecoder, RowRequest

    cfg = GenerationConfig(max_new_tokens=12, drafter="model", num_draft_tokens=3,
                           adaptive=True)
    plan = concat_pair.plan(cfg)
    ids = [concat_pair.encode_prompt(p) for p in PROMPTS]
    tuner = AdaptiveK(3)
    tuner.k = 0
    decoder = BatchDecoder(concat_pair.target, concat_pair.draft, plan, capacity=4,
                           max_len=plan.cache_len(max(map(len, ids)), 12), tuner=tuner)
    calls = concat_pair.draft.calls
    rows = [decoder.add(RowRequest(i, concat_pair.new_output(i, cfg))) for i in ids]
    assert concat_pair.draft.calls == calls and all(not r.draft_fed.tokens for r in rows)
    decoder.step()  # k = 0: no draft call
    assert concat_pair.draft.calls == calls
    tuner.k = 2  # drafting resumes
    tuner.draft.record(len(decoder.live), 1.0)
    decoder.step()
    live = [r for r in rows if r.reason is None]
    # the catch-up (one call in the concat form; in place, a call per row, or one per position
    # where fewer: GroupQueryAttention takes several tokens after a past for one row only),
    # then two drafting calls
    catch_up = 1 if concat_pair.draft.spec.graph == "concat" else min(
        len(rows), max(len(i) for i in ids))
    assert concat_pair.draft.calls == calls + catch_up + 2
    assert live and all(len(r.draft_fed.tokens) >= r.prompt_len for r in live)
    assert tuner.feeds.mean  # the catch-up priced the next ones
    while decoder.live:
        decoder.step()
    for i, row in zip(ids, rows, strict=True):
        want = concat_pair.generate_ids(i, replace(cfg, drafter="none"))[0]
        assert row.generated == want


def test_a_rounds_first_draft_call_reaches_the_tuner_apart(concat_pair: Pair) -> None:
    """Adaptive K prices a round's first draft call by the tokens it feeds (rows x width: what
    the rows committed since the draft's last call) and the one-token calls after it apart
    (`AdaptiveK.draft_cost`): the batch reports each call as fed, and rows stay exact."""
    from specedge.runtime.adaptive import AdaptiveK
    from specedge.runtime.batch import RowRequest, decode_batch

    cfg = GenerationConfig(max_new_tokens=16, drafter="model", num_draft_tokens=4,
                           adaptive=True)
    plan = concat_pair.plan(cfg)
    ids = [concat_pair.encode_prompt(p) for p in PROMPTS]
    tuner = AdaptiveK(4)
    seen: list[tuple[int, int, tuple[int, int, float] | None]] = []
    update = tuner.update_batch

    def record(k: int, outcomes: list[tuple[int, int]], draft_step_s: float,
               draft_step_calls: int, verify_s: float, *args: Any, **kwargs: Any) -> None:
        seen.append((k, draft_step_calls, kwargs.get("first_call")))
        update(k, outcomes, draft_step_s, draft_step_calls, verify_s, *args, **kwargs)

    tuner.update_batch = record  # type: ignore[method-assign]
    rows, _ = decode_batch(concat_pair.target, concat_pair.draft, plan,
                           [RowRequest(i, concat_pair.new_output(i, cfg)) for i in ids],
                           max_len=plan.cache_len(max(map(len, ids)), 16), tuner=tuner)
    drafting = [(k, steps, first) for k, steps, first in seen if k]
    assert drafting and all(first is not None and steps <= k - 1
                            for k, steps, first in drafting)
    assert any(first[1] == 2 for _, _, first in drafting if first)  # after a full accept
    assert tuner.first_width is not None and 1.0 <= tuner.first_width <= 2.0
    for i, row in zip(ids, rows, strict=True):
        assert row.generated == concat_pair.generate_ids(i, replace(cfg, drafter="none"))[0]


def test_a_batch_tells_the_tuner_what_its_rows_may_still_generate(concat_pair: Pair) -> None:
    """Each round tells adaptive K the most tokens a live row may still generate (its budget
    within the context), which bounds what leaving k = 0 can save (`AdaptiveK.choose`)."""
    from specedge.runtime.adaptive import AdaptiveK
    from specedge.runtime.batch import BatchDecoder, RowRequest

    cfg = GenerationConfig(max_new_tokens=10, drafter="model", num_draft_tokens=3,
                           adaptive=True, ignore_eos=True)
    plan = concat_pair.plan(cfg)
    ids = [concat_pair.encode_prompt(p) for p in PROMPTS]
    tuner = AdaptiveK(3)
    decoder = BatchDecoder(concat_pair.target, concat_pair.draft, plan, capacity=len(ids),
                           max_len=plan.cache_len(max(map(len, ids)), 10), tuner=tuner)
    rows = [decoder.add(RowRequest(i, concat_pair.new_output(i, cfg)))
            for i in ids]
    told = []
    while decoder.live:
        decoder.step()
        live = [r for r in rows if r.reason is None]
        assert tuner.tokens_left == max((10 - len(r.generated) for r in live), default=0)
        told.append(tuner.tokens_left)
    assert told[-1] == 0 and told == sorted(told, reverse=True) and told[0] < 10


def test_a_joined_rows_first_token_is_streamed_before_the_round(concat_pair: Pair) -> None:
    """Regression (`specedge serve`, session 27): the worker streamed a request's first token,
    which its prefill gives, only after the round that followed, so time to first token was
    prefill + one round (a drafting round with speculation: its solo p50 7-20 ms above plain
    decoding's). The first text now goes out before the round; the stream is unchanged."""
    from specedge.runtime.job_engines import BatchEngine
    from specedge.runtime.jobs import Delta, Job, SchedulerOptions

    engine = BatchEngine(concat_pair, SchedulerOptions(max_batch=2, drafter="model",
                                                       num_draft_tokens=3))
    events: list[tuple[str, int]] = []  # (text, decode rounds started before it)
    rounds = [0]
    step = engine.batch.decoder.step

    def counted() -> list[Any]:
        rounds[0] += 1
        return step()

    engine.batch.decoder.step = counted  # type: ignore[method-assign]
    cfg = GenerationConfig(max_new_tokens=8, chat=True)
    # a prompt whose first token is whole text (the tiny model also writes partial bytes)
    prompt = next(p for p in PROMPTS
                  if "\ufffd" not in concat_pair.generate(p, replace(cfg, max_new_tokens=1)).text)
    job = Job(prompt, cfg,
              lambda e: events.append((e.text, rounds[0])) if isinstance(e, Delta) else None,
              60.0)
    engine.admit(job)
    finished = []
    while not finished:
        finished = engine.round()
    assert events and events[0][1] == 0, events  # before any round
    text = "".join(t for t, _ in events)
    assert text == concat_pair.generate(prompt, replace(cfg, drafter="none")).text


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_a_rows_long_lag_is_caught_up_in_one_window(concat_pair: Pair, drafter: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: in a batch a row's draft caught up on every token of its k = 0 rounds (a
    call of its own), so the tuner skipped every probe up from k = 0 once the rows lagged by
    more than 8 tokens, and a batch that went to k = 0 stayed there to the end of its texts.
    Now a row whose draft holds its prompt catches up on at most its last `CATCH_UP_WINDOW`
    tokens (`fed_tokens`), as at batch 1; every row is still target-only's, token for token,
    and its draft cache holds a prefix of its view of the committed tokens every round."""
    import specedge.runtime.batch as batch_module
    import specedge.runtime.batch_calls as calls_module
    from specedge.runtime.adaptive import AdaptiveK
    from specedge.runtime.batch import BatchDecoder, RowRequest

    script = [2] * 3 + [0] * 50 + [3, 2, 0, 0, 4] + [0] * 40 + [3, 1]
    monkeypatch.setattr(AdaptiveK, "choose",
                        lambda self: script[min(self.rounds, len(script) - 1)])
    monkeypatch.setattr(AdaptiveK, "free_hits_pay", lambda self: False)
    widths: list[int] = []  # the widest row of each draft call (catch-ups and drafting)
    real = calls_module.ragged_verify

    def spy(model: Any, cache: Any, rows: Any, blocks: Any, lens: list[int], *args: Any,
            **kwargs: Any) -> Any:
        if model is concat_pair.draft:
            widths.append(max(lens))
        return real(model, cache, rows, blocks, lens, *args, **kwargs)

    monkeypatch.setattr(batch_module, "ragged_verify", spy)
    monkeypatch.setattr(calls_module, "ragged_verify", spy)
    cfg = GenerationConfig(max_new_tokens=140, drafter=drafter, num_draft_tokens=4,
                           adaptive=True, ignore_eos=True)
    plan = concat_pair.plan(cfg)
    ids = [concat_pair.encode_prompt(p) for p in PROMPTS[:3]]
    tuner = AdaptiveK(4)  # drafting when the rows join: their drafts hold their prompts
    decoder = BatchDecoder(concat_pair.target, concat_pair.draft, plan, capacity=3,
                           max_len=plan.cache_len(max(map(len, ids)), 140), tuner=tuner)
    rows = [decoder.add(RowRequest(i, concat_pair.new_output(i, cfg))) for i in ids]
    assert decoder.d_cache is not None
    while decoder.live:
        decoder.step()
        for row in decoder.live:
            fed, view = row.draft_fed.tokens, row.draft_fed.view(row.tokens)
            assert fed == view[:len(fed)] and len(fed) <= len(view) - 1
            assert int(decoder.d_cache.lengths[row.index]) == len(fed)
    for i, row in zip(ids, rows, strict=True):
        want = concat_pair.generate_ids(i, replace(cfg, drafter="none", adaptive=False))[0]
        assert row.generated == want
    assert any(row.draft_fed.skipped > 0 for row in rows), "no catch-up was cut short"
    assert widths and max(widths) <= AdaptiveK.CATCH_UP_WINDOW
