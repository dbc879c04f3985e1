"""Prefixes kept in a continuous batch's free slots: a conversation's next turn joins the slot
that holds its history and prefills only what is new, decoding exactly what a cold row decodes.

The rules (runtime/slot_prefix.py) are batch-1 prefix caching's: row prefills are cut at the
multiples of `PREFILL_CHUNK`, and a slot keeps only whole chunks its prefill wrote.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.runtime.backend import OrtModel
from specedge.runtime.errors import InputError, ModelError
from specedge.runtime.pair import GenerationConfig, GenerationResult, Pair, ThreadPlan, plan_threads
from specedge.runtime.prefix_cache import PREFILL_CHUNK, kept_prefix, reusable
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.server import ServerOptions, create_app
from specedge.runtime.serving import ContinuousBatch
from specedge.runtime.slot_prefix import SlotPrefixes, extend_end
from tests.test_gqa_rows import mixed
from tests.test_serve import running

__all__ = ["mixed"]  # a fixture, imported for the tests below

C = PREFILL_CHUNK


@pytest.fixture(scope="module")
def concat(fixtures_dir: Path) -> Pair:
    """The concat pair with its draft prefilling its own prompts (the calls these tests count;
    its self-draft would take them from the target: `concat_shared`)."""
    pair = Pair.load(fixtures_dir / "tiny-llama-concat")
    pair.shares_prompt_kv = False
    return pair


@pytest.fixture(scope="module")
def concat_shared(fixtures_dir: Path) -> Pair:
    pair = Pair.load(fixtures_dir / "tiny-llama-concat")
    assert pair.shares_prompt_kv
    return pair


# ------------------------------------------------------------------------------- the choice


@given(st.lists(st.lists(st.integers(0, 2), max_size=3 * C + 9), min_size=1, max_size=5),
       st.lists(st.integers(0, 2), min_size=1, max_size=3 * C + 9), st.data())
def test_a_request_takes_the_slot_that_holds_most_of_it(earlier: list[list[int]],
                                                        prompt: list[int], data: Any) -> None:
    """The free slot whose kept chunks let the prompt skip the most; when none lets it skip
    any, the slot released longest ago (a fresh one first), so other conversations keep theirs.
    With `keep=False` nothing is ever reused."""
    slots = SlotPrefixes(len(earlier))
    for slot in data.draw(st.permutations(range(len(earlier)))):
        slots.release(slot, earlier[slot], draft_prefilled=True)
    free = sorted(data.draw(st.sets(st.integers(0, len(earlier) - 1), min_size=1)))
    chosen, n = slots.choose(free, prompt)
    best = max(reusable(kept_prefix(earlier[s]), prompt) for s in free)
    assert chosen in free and n == best == slots.target_reuse(chosen, prompt)
    assert n == slots.draft_reuse(chosen, prompt) and n % C == 0 and n < len(prompt)
    if n == 0:
        assert slots.held[chosen].released == min(slots.held[s].released for s in free)
    off = SlotPrefixes(len(earlier), keep=False)
    for s in range(len(earlier)):
        off.release(s, earlier[s], draft_prefilled=True)
    assert off.choose(free, prompt)[1] == 0 and off.extendable(free, prompt) is None


def test_a_taken_slot_holds_nothing_and_an_undrafted_row_keeps_no_draft() -> None:
    slots = SlotPrefixes(2)
    prompt = list(range(2 * C + 5))
    slots.release(0, prompt, draft_prefilled=False)
    assert slots.held[0].target == tuple(prompt[:2 * C]) and slots.held[0].draft is None
    assert slots.choose([0, 1], prompt + [1]) == (0, 2 * C)
    assert slots.draft_reuse(0, prompt + [1]) == 0
    slots.take(0)
    assert slots.choose([0, 1], prompt + [1])[1] == 0
    assert extend_end(list(range(3 * C + 1)), 3 * C + 1) == 3 * C
    assert extend_end(list(range(3 * C + 1)), 3 * C) == 2 * C  # room for one more token


# ------------------------------------------------------------------------------- exactness


def _batch(pair: Pair, config: GenerationConfig, capacity: int, keep: bool = True
           ) -> ContinuousBatch:
    return ContinuousBatch(pair, capacity=capacity, keep_prefixes=keep, drafter=config.drafter,
                           num_draft_tokens=config.num_draft_tokens, adaptive=config.adaptive)


def _turns(server: ContinuousBatch, prompts: list[list[int]], config: GenerationConfig
           ) -> list[GenerationResult]:
    ids = [server.submit_ids(p, config) for p in prompts]
    done = server.run()
    return [done[i] for i in ids]


def _conversations(pair: Pair, config: GenerationConfig, *, keep: bool, ahead: bool,
                   capacity: int, chats: int = 3, turns: int = 3) -> list[list[Any]]:
    """`chats` conversations of token ids, each turn's prompt the last prompt, its output and
    a few new tokens, all turns of a round submitted together; returns per turn each chat's
    (tokens, reason, cached tokens, what a prefill ahead held before it)."""
    server = _batch(pair, config, capacity, keep)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 300, C + 20 + 37 * i).tolist() for i in range(chats)]
    held = [0] * chats
    out = []
    for _ in range(turns):
        results = _turns(server, prompts, config)
        out.append([(r.tokens, r.stop_reason, r.stats.cached_tokens, h)
                    for r, h in zip(results, held, strict=True)])
        for i, r in enumerate(results):
            history = prompts[i] + r.tokens
            held[i] = server.prefill_ahead(history) if ahead else 0
            prompts[i] = history + rng.integers(0, 300, 9).tolist()
    return out


CONFIGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, seed=5)}


@pytest.mark.parametrize("ahead", [False, True], ids=["", "ahead"])
@pytest.mark.parametrize("sampling", list(CONFIGS))
@pytest.mark.parametrize("drafter", ["none", "model", "hybrid"])
@pytest.mark.parametrize("form", ["concat", "mixed"])
def test_conversations_in_a_batch_decode_as_cold_rows(form: str, drafter: str, sampling: str,
                                                      ahead: bool, request: Any) -> None:
    """Three chats of three turns in a batch of three slots (each keeps its own slot): every
    turn's tokens equal a batch that keeps nothing; each turn after the first reuses the whole
    chunks of its last prompt, or all that a prefill ahead held. Concat draft and in-place
    (gqa-shared) draft."""
    pair = request.getfixturevalue(form)
    config = GenerationConfig(max_new_tokens=16, drafter=drafter, num_draft_tokens=3,
                              adaptive=False, sampling=CONFIGS[sampling])
    warm = _conversations(pair, config, keep=True, ahead=ahead, capacity=3)
    cold = _conversations(pair, config, keep=False, ahead=False, capacity=3)
    for turn, (w, c) in enumerate(zip(warm, cold, strict=True)):
        assert [x[:2] for x in w] == [x[:2] for x in c], turn
        assert all(x[2] == 0 for x in c)
        if turn == 0:
            assert all(x[2] == 0 for x in w)
        for _, _, cached, held in (w if turn else []):
            assert cached > 0 and cached % C == 0
            assert not ahead or cached == held, (cached, held)


@pytest.mark.parametrize("adaptive", [False, True])
def test_chats_sharing_fewer_slots_stay_exact(concat: Pair, adaptive: bool) -> None:
    """Three chats through two slots: requests queue, take whatever slot frees, and reuse what
    that slot holds of them (or nothing); the tokens are a cold batch's all the same."""
    config = GenerationConfig(max_new_tokens=12, drafter="model", num_draft_tokens=2,
                              adaptive=adaptive)
    warm = _conversations(concat, config, keep=True, ahead=True, capacity=2)
    cold = _conversations(concat, config, keep=False, ahead=False, capacity=2)
    assert [[x[:2] for x in t] for t in warm] == [[x[:2] for x in t] for t in cold]
    assert sum(x[2] for t in warm for x in t) > 0


def _row_calls(model: OrtModel, monkeypatch: pytest.MonkeyPatch
               ) -> list[tuple[int, int, int]]:
    """(past, width, slot) of each call's first row."""
    calls: list[tuple[int, int, int]] = []
    step = model._rows_step

    def record(cache: Any, rows: Any, tokens: Any, new_lens: Any) -> Any:
        calls.append((int(cache.lengths[rows[0]]), int(new_lens[0]), int(rows[0])))
        return step(cache, rows, tokens, new_lens)

    monkeypatch.setattr(model, "_rows_step", record)
    return calls


def test_a_warm_row_makes_the_cold_rows_last_prefill_calls(concat: Pair,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Exact by construction: a row that joins after a kept prefix feeds the target exactly
    the calls (past, width) a cold row's prefill ends with, and the draft likewise (then the
    same decoding calls)."""
    earlier = np.random.default_rng(3).integers(0, 300, 2 * C + 40).tolist()
    config = GenerationConfig(max_new_tokens=2, drafter="model", adaptive=False)
    for prompt in (earlier[:2 * C + 5] + [7] * 30, earlier + [1], earlier[:C + 2] + [2] * 9):
        seen = {}
        for keep in (False, True):
            server = _batch(concat, config, 1, keep)
            _turns(server, [earlier], config)
            assert concat.draft is not None
            target = _row_calls(concat.target, monkeypatch)
            draft = _row_calls(concat.draft, monkeypatch)
            (result,) = _turns(server, [prompt], config)
            seen[keep] = (target, draft, result.stats.cached_tokens)
            monkeypatch.undo()
        (cold_t, cold_d, none), (warm_t, warm_d, cached) = (
            ([c[:2] for c in t], [c[:2] for c in d], n) for t, d, n in (seen[False], seen[True]))
        assert none == 0 and cached == reusable(kept_prefix(earlier), prompt) > 0
        assert warm_t[0][0] == cached and warm_t == cold_t[-len(warm_t):]
        assert warm_d[0][0] == cached and warm_d == cold_d[-len(warm_d):]
        prefill = [(p, n) for p, n in cold_t + cold_d if p + n <= len(prompt)]
        assert all(p % C + n <= C for p, n in prefill)  # no call crosses a chunk boundary
        assert sum(n for _, n in prefill) == 2 * len(prompt)


def test_a_failed_round_forgets_every_kept_prefix(concat: Pair,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = np.random.default_rng(4).integers(0, 300, C + 30).tolist()
    config = GenerationConfig(max_new_tokens=8, drafter="none")
    server = _batch(concat, config, 2)
    first = _turns(server, [prompt], config)[0]
    assert server.decoder.prefixes.held[0].target == tuple(prompt[:C])

    def broken(*_: Any, **__: Any) -> Any:
        raise ModelError("the target failed to run")

    server.submit_ids(np.random.default_rng(5).integers(0, 300, 20).tolist(), config)
    with monkeypatch.context() as m:
        m.setattr(concat.target, "forward_rows_greedy", broken)
        with pytest.raises(ModelError):
            server.step()
    assert all(h.target == () for h in server.decoder.prefixes.held)
    again = _turns(server, [prompt], config)[0]
    assert again.tokens == first.tokens and again.stats.cached_tokens == 0


# ------------------------------------------------------------------------------- shared by rows


@pytest.fixture(scope="module")
def on_device(concat_dir: Path) -> Pair:
    """The concat pair with its KV caches in `DeviceKV`s (the GPU's layout, host buffers)."""
    plan = plan_threads()
    return Pair.load(concat_dir, plan=ThreadPlan(replace(plan.target, device_kv=True),
                                                 replace(plan.draft, device_kv=True)))


def _contents(cache: Any, row: int, n: int) -> list[np.ndarray]:
    """Row `row`'s first `n` positions of every KV buffer of `cache`, read back."""
    if cache.host is not None:
        return [cache.host[:, row, :, :n]]
    if cache.device_kv is not None:
        return [cache.device_kv.cache.numpy()[row, :n]]
    return [v.numpy()[row, :, :n] for v in cache.values]


@pytest.mark.parametrize("form", ["concat", "on_device", "tiny"])
def test_a_copied_prefix_is_the_source_rows_bit_for_bit(form: str, request: Any,
                                                        tiny_pair: Pair) -> None:
    """`KVCache.copy_prefix` for each cache kind (host concat, the device layout, in-place
    buffers): the destination row holds the source's positions and tokens, bit for bit, and
    a next call on it gives the source row's logits."""
    pair = tiny_pair if form == "tiny" else request.getfixturevalue(form)
    model = pair.target
    cache = model.new_cache(3, 64)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 300, (1, 40))
    model.forward_rows(cache, np.asarray([0]), ids, np.asarray([40]))
    cache.copy_prefix(0, 2, 33)
    assert int(cache.lengths[2]) == 33 and list(cache.fed[2, :33]) == list(ids[0, :33])
    for a, b in zip(_contents(cache, 0, 33), _contents(cache, 2, 33), strict=True):
        assert np.array_equal(a, b)
    cache.rollback(np.asarray([33, 0, 33]))
    nxt = rng.integers(0, 300, (1, 4))
    first = model.forward_rows(cache, np.asarray([0]), nxt, np.asarray([4]))
    second = model.forward_rows(cache, np.asarray([2]), nxt, np.asarray([4]))
    assert np.array_equal(first, second)


@pytest.mark.parametrize("sampling", list(CONFIGS))
@pytest.mark.parametrize("form", ["concat", "mixed", "on_device"])
def test_rows_sharing_a_document_prefill_it_once(form: str, sampling: str, request: Any) -> None:
    """A batch whose rows start with one long document: the first row prefills it, the others
    copy its whole chunks (target and draft) and prefill only their question; every row is
    its batch-1 output."""
    pair = request.getfixturevalue(form)
    rng = np.random.default_rng(12)
    doc = rng.integers(0, 300, 2 * C + 40).tolist()
    prompts = [doc + rng.integers(0, 300, 6 + i).tolist() for i in range(4)]
    config = GenerationConfig(max_new_tokens=16, drafter="model", num_draft_tokens=3,
                              adaptive=False, sampling=CONFIGS[sampling])
    batch = pair.generate_batch_ids(prompts, config)
    assert [r.stats.cached_tokens for r in batch.results] == [0, 2 * C, 2 * C, 2 * C]
    for result, prompt in zip(batch.results, prompts, strict=True):
        assert result.tokens == pair.generate_ids(prompt, config)[0]


@pytest.mark.parametrize("budget", [None, C])
def test_requests_arriving_together_compute_a_shared_prefix_once(
        concat: Pair, budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three requests with one long system prompt submitted at once: the first computes its
    chunks, the other two copy them while they join (target and draft), each row is its
    batch-1 output."""
    rng = np.random.default_rng(14)
    system = rng.integers(0, 300, 2 * C + 20).tolist()
    prompts = [system + rng.integers(0, 300, 8 + i).tolist() for i in range(3)]
    config = GenerationConfig(max_new_tokens=12, drafter="model", num_draft_tokens=2,
                              adaptive=False)
    server = _batch(concat, config, 3)
    server.prefill_budget = budget
    assert concat.draft is not None
    draft = _row_calls(concat.draft, monkeypatch)
    ids = [server.submit_ids(p, config) for p in prompts]
    done = server.run()
    monkeypatch.undo()
    assert [done[i].stats.cached_tokens for i in ids] == [0, 2 * C, 2 * C]
    draft_prefill = [c for c in draft if c[1] > 1]  # the prompts' chunks
    assert sum(n for _, n, _ in draft_prefill) == len(prompts[0]) + 2 * (
        len(prompts[1]) - 2 * C) + 1  # the copies are not computed
    for i, p in zip(ids, prompts, strict=True):
        assert done[i].tokens == concat.generate_ids(p, config)[0]


def test_a_row_copying_a_prefix_makes_the_cold_rows_last_calls(
        concat: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact by construction: after the copy, the joining row feeds the target and the draft
    exactly the calls (past, width) a cold row's prefill ends with."""
    rng = np.random.default_rng(13)
    doc = rng.integers(0, 300, C + 60).tolist()
    first, second = doc + [1, 2, 3], doc + rng.integers(0, 300, 20).tolist()
    config = GenerationConfig(max_new_tokens=30, drafter="model", num_draft_tokens=2,
                              adaptive=False)
    seen = {}
    for keep in (False, True):
        server = _batch(concat, config, 2, keep)
        server.submit_ids(first, config)
        server.step()
        assert concat.draft is not None
        target = _row_calls(concat.target, monkeypatch)
        draft = _row_calls(concat.draft, monkeypatch)
        rid = server.submit_ids(second, config)
        while server.decoder.joining or server.queue:
            server.step()
        monkeypatch.undo()
        slot = next(r.index for p, r in server.running.values() if p.request_id == rid)
        prefill = [(c, calls) for c, calls in (("t", target), ("d", draft))]
        seen[keep] = [[(p, n) for p, n, s in calls if s == slot and p + n <= len(second)]
                      for _, calls in prefill]
        assert server.run()[rid].tokens == concat.generate_ids(second, config)[0]
    for cold, warm in zip(seen[False], seen[True], strict=True):
        assert warm[0][0] == C and warm == cold[-len(warm):], (cold, warm)


# ------------------------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("sampling", list(CONFIGS))
def test_a_long_prompt_joins_in_chunks_while_a_row_decodes(concat: Pair, sampling: str) -> None:
    """A long prompt joining a decoding batch is prefilled over several rounds, at most
    `prefill_budget` tokens (or one chunk) between two rounds, and the decoding row gets a
    round every step meanwhile; every output is the same whatever the budget, and the batch-1
    output."""
    rng = np.random.default_rng(9)
    short, long = rng.integers(0, 300, 20).tolist(), rng.integers(0, 300, 3 * C + 50).tolist()
    running = GenerationConfig(max_new_tokens=100, drafter="model", num_draft_tokens=2,
                               adaptive=False, sampling=CONFIGS[sampling])
    joining = GenerationConfig(max_new_tokens=8, drafter="model", num_draft_tokens=2,
                               adaptive=False, sampling=CONFIGS[sampling])
    outputs, steps = {}, {}
    for budget in (None, C, 2 * C, 1):
        server = ContinuousBatch(concat, capacity=2, drafter="model", num_draft_tokens=2,
                                 adaptive=False, prefill_budget=budget)
        first = server.submit_ids(short, running)
        done = dict(server.step())
        second = server.submit_ids(long, joining)
        (row,) = [r for p, r in server.running.values() if p.request_id == first]
        steps[budget] = 0
        while not any(r is not None and r.stats.prompt_tokens == len(long)
                      for r in server.decoder.slots):
            before = len(row.generated)
            done.update(server.step())
            steps[budget] += 1
            assert len(row.generated) > before  # the decoding row was not stalled
        done.update(server.run())
        outputs[budget] = (done[first].tokens, done[second].tokens)
    # target 128 + 128 + 128 + 50 tokens, then the draft's same four calls
    assert steps == {None: 1, C: 8, 2 * C: 4, 1: 8}
    assert all(o == outputs[None] for o in outputs.values())
    assert outputs[None] == (concat.generate_ids(short, running)[0],
                             concat.generate_ids(long, joining)[0])
    with pytest.raises(InputError, match="prefill_budget"):
        ContinuousBatch(concat, prefill_budget=0)


def test_joining_rows_get_their_first_tokens_before_any_draft_prefill(
        concat: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts joining at once: both targets' prefill calls run before either draft's, so
    the second request's first token does not wait for the first one's draft; the tokens are
    their batch-1 tokens."""
    rng = np.random.default_rng(11)
    config = GenerationConfig(max_new_tokens=40, drafter="model", num_draft_tokens=2,
                              adaptive=False)
    server = ContinuousBatch(concat, capacity=3, drafter="model", num_draft_tokens=2,
                             adaptive=False, prefill_budget=C)
    running = server.submit_ids(rng.integers(0, 300, 10).tolist(), config)
    server.step()
    prompts = [rng.integers(0, 300, n).tolist() for n in (2 * C + 7, C + 30)]
    calls: list[tuple[str, int]] = []
    assert concat.draft is not None
    for name, model in (("target", concat.target), ("draft", concat.draft)):
        step = model._rows_step

        def record(cache: Any, rows: Any, tokens: Any, new_lens: Any, name: str = name,
                   step: Any = step) -> Any:
            calls.extend((name, int(r)) for r in rows)
            return step(cache, rows, tokens, new_lens)

        monkeypatch.setattr(model, "_rows_step", record)
    ids = [server.submit_ids(p, config) for p in prompts]
    firsts = []
    while server.decoder.joining or server.queue:
        server.step()
        firsts.append([bool(server.output(i) and server.output(i).tokens) for i in ids])
    monkeypatch.undo()
    slots = {r.index for p, r in server.running.values() if p.request_id in ids}
    joined = [c for c in calls if c[1] in slots]
    first_draft = next(i for i, c in enumerate(joined) if c[0] == "draft")
    assert all(c[0] == "target" for c in joined[:first_draft])
    assert sum(1 for c in joined[:first_draft]) == 3 + 2  # both targets' chunks
    assert firsts.index([True, True]) < len(firsts) - 1  # both first tokens, drafts pending
    done = server.run()
    for i, p in zip(ids, prompts, strict=True):
        assert done[i].tokens == concat.generate_ids(p, config)[0]
    assert done[running].tokens


def test_a_row_cancelled_while_joining_frees_its_slot(concat: Pair) -> None:
    rng = np.random.default_rng(10)
    config = GenerationConfig(max_new_tokens=30, drafter="none")
    server = ContinuousBatch(concat, capacity=2, drafter="none", prefill_budget=C)
    first = server.submit_ids(rng.integers(0, 300, 10).tolist(), config)
    server.step()
    long = rng.integers(0, 300, 3 * C).tolist()
    second = server.submit_ids(long, config)
    server.step()  # its first chunk only
    assert server.decoder.joining and server.cancel(second)
    assert not server.decoder.joining and len(server.decoder.free) == 1
    third = server.submit_ids(long, config)
    done = server.run()
    assert sorted(done) == [first, third] and done[third].stats.cached_tokens == 0
    assert done[third].tokens == concat.generate_ids(long, config)[0]


# ------------------------------------------------------------------------------- any schedule


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
@pytest.mark.parametrize("form", ["concat", "concat_shared", "mixed", "on_device"])
def test_any_schedule_of_requests_decodes_each_as_batch_1(form: str, request: Any,
                                                          data: Any) -> None:
    """Requests from a family of prompts that share prefixes (whole chunks and not), arriving
    at random rounds, some cancelled, some conversations prefilled ahead, through a batch of
    random capacity and prefill budget: every request that finishes decodes its batch-1
    tokens, and reuses or copies only whole chunks. Concat draft (prefilling, or taking the
    target's prompt), in-place draft, device layout."""
    concat = request.getfixturevalue(form)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    base = rng.integers(0, 300, 3 * C).tolist()
    family = [base[:n] + rng.integers(0, 300, m).tolist()
              for n, m in ((C + 30, 5), (2 * C + 3, 9), (C - 20, 40), (0, 20), (3 * C, 1))]
    sampled = SamplingParams(temperature=0.8, seed=3)
    config = GenerationConfig(max_new_tokens=data.draw(st.integers(1, 12)), drafter="model",
                              num_draft_tokens=2, adaptive=False)
    server = ContinuousBatch(concat, capacity=data.draw(st.integers(1, 3)), drafter="model",
                             num_draft_tokens=2, adaptive=False,
                             prefill_budget=data.draw(st.sampled_from([None, 1, C, 2 * C])))
    asked: dict[int, tuple[list[int], GenerationConfig]] = {}
    done: dict[int, GenerationResult] = {}
    for _ in range(data.draw(st.integers(1, 8))):
        for _ in range(data.draw(st.integers(0, 2))):
            prompt = list(family[data.draw(st.integers(0, len(family) - 1))])
            cfg = replace(config, sampling=sampled) if data.draw(st.booleans()) else config
            asked[server.submit_ids(prompt, cfg)] = (prompt, cfg)
        if asked and data.draw(st.integers(0, 4)) == 0:
            server.cancel(data.draw(st.sampled_from(sorted(asked))))
        if data.draw(st.integers(0, 3)) == 0:
            server.prefill_ahead(family[data.draw(st.integers(0, len(family) - 1))] + [7] * 9)
        done.update(server.step())
    done.update(server.run())
    for rid, result in done.items():
        prompt, cfg = asked[rid]
        assert result.tokens == concat.generate_ids(prompt, cfg)[0], rid
        assert result.stats.cached_tokens % C == 0 and result.stats.cached_tokens < len(prompt)


# ------------------------------------------------------------------------------- server


def test_the_batching_server_reuses_a_conversation(concat_dir: Path, concat: Pair) -> None:
    """A real server on a concat-form pair and a real client re-sending its conversation: the
    later requests report reused prompt tokens (the request's prompt chunks, or all that the
    idle server prefilled ahead) and answer what a cold pair decodes; `--prefix-cache 0`
    reuses nothing."""
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 12},
                {"role": "user", "content": "Hello there"}]
    seen: dict[int, list[int]] = {}
    for size in (1, 0):  # with a small prefill budget, then whole prompts
        app = create_app(Pair.load(concat_dir, prefix_cache=size),
                         ServerOptions(max_tokens_limit=64, warmup_tokens=0, max_batch=2,
                                       prefill_budget=size and 64))
        history = list(messages)
        with running(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                   timeout=60)
            cached = []
            for turn in ("And then?", "Thanks"):
                reply = client.chat.completions.create(model=concat_dir.name, messages=history,
                                                       max_tokens=16, temperature=0)
                solo = concat.generate(history, GenerationConfig(max_new_tokens=16, chat=True,
                                                                 drafter="none"))
                assert reply.choices[0].message.content == solo.text
                details = reply.usage.prompt_tokens_details
                cached.append(details.cached_tokens if details else -1)
                history += [{"role": "assistant", "content": solo.text},
                            {"role": "user", "content": turn}]
            metrics = httpx.get(url + "/metrics").text
        seen[size] = cached
        line = next(ln for ln in metrics.splitlines()
                    if ln.startswith("specedge_prompt_tokens_cached_total "))
        assert float(line.split()[1]) == sum(cached)
    assert seen[0] == [0, 0]
    assert seen[1][0] == 0 and seen[1][1] >= C and seen[1][1] % C == 0
