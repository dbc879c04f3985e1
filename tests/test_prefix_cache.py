"""Prefix caching: a prompt that starts like an earlier one prefills only the rest, and decodes
exactly what it would decode from empty caches (bit for bit, not within a tolerance).

The rules that make it exact (runtime/prefix_cache.py): prefills are cut at the multiples of
`PREFILL_CHUNK`, only whole chunks of an earlier prompt are reused (never its last two
positions), and only at the cache length a cold generation allocates.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from specedge.cli import main
from specedge.runtime.errors import ModelError
from specedge.runtime.pair import GenerationConfig, Pair, ThreadPlan, plan_threads
from specedge.runtime.prefix_cache import (
    MIN_CAPACITY,
    PREFILL_CHUNK,
    Entry,
    PrefixCache,
    cache_capacity,
    kept_prefix,
    prefill,
    prefill_chunks,
    reusable,
)
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.server import ServerOptions, create_app
from tests.test_row_steps import int4_target_dir
from tests.test_serve import running

__all__ = ["int4_target_dir"]  # a fixture, imported for the tests below

C = PREFILL_CHUNK

# ------------------------------------------------------------------------------- the rules


@given(st.integers(0, 2000), st.integers(1, 600), st.integers(1, 300))
def test_prefill_chunks_cut_at_absolute_multiples(start: int, length: int, chunk: int) -> None:
    chunks = prefill_chunks(start, start + length, chunk)
    assert chunks[0][0] == start and chunks[-1][1] == start + length
    assert all(a < b and b - a <= chunk for a, b in chunks)
    assert all(b == c for (_, b), (c, _) in zip(chunks, chunks[1:], strict=False))
    assert all(b % chunk == 0 for _, b in chunks[:-1])  # every cut at a multiple


@given(st.lists(st.integers(0, 3), max_size=700), st.integers(0, 700),
       st.lists(st.integers(0, 3), max_size=300))
def test_reuse_takes_whole_chunks_of_a_common_prefix(earlier: list[int], cut: int,
                                                     tail: list[int]) -> None:
    prompt = earlier[:cut] + tail or [0]  # shares a prefix of any length with `earlier`
    kept = kept_prefix(earlier)
    assert len(kept) % C == 0 and len(kept) <= max(0, len(earlier) - 2)
    n = reusable(kept, prompt)
    assert n % C == 0 and n <= len(prompt) - 1  # one token at least is prefilled
    assert list(kept[:n]) == prompt[:n]
    if len(prompt) > 1 and n + C <= min(len(kept), len(prompt) - 1):
        assert list(kept[:n + C]) != prompt[:n + C]  # the longest whole-chunk prefix


def test_cache_capacity_is_a_power_of_two_within_the_context() -> None:
    assert cache_capacity(1, 8192) == MIN_CAPACITY == 1024
    assert cache_capacity(1025, 8192) == 2048 and cache_capacity(2048, 8192) == 2048
    assert cache_capacity(3000, 2048) == 2048 and cache_capacity(100, 512) == 512


def _entry(ids: list[int], capacity: int = 512) -> Entry:
    return Entry(tuple(ids), capacity, None, None)  # type: ignore[arg-type]


def test_the_pool_lends_the_entry_that_skips_most() -> None:
    pool = PrefixCache(2)
    a, b = list(range(2 * C)), [8] * C + [7] * C
    pool.put(_entry(a))
    pool.put(_entry(b))
    assert pool.take(a[:C] + [1] * 10, 1024) == (None, 0)  # another cache length: no reuse
    entry, n = pool.take(a + [1], 512)
    assert entry is not None and entry.ids == tuple(a) and n == 2 * C and len(pool) == 1
    pool.put(_entry(a))
    pool.put(_entry([5] * C))  # the oldest (b) goes
    assert len(pool) == 2 and pool.take(b + [1], 512) == (None, 0)
    pool = PrefixCache(3)
    for ids in (a, [5] * C, []):  # the last: a prompt shorter than a chunk, kept to be extended
        pool.put(_entry(ids))
    assert pool.take_extendable([9] * C) is not None  # holds nothing: any tokens extend it
    assert pool.take_extendable([9] * C) is None  # the others hold other tokens
    extendable = pool.take_extendable(a + [1, 2])
    assert extendable is not None and extendable.ids == tuple(a) and len(pool) == 1
    empty = PrefixCache(0)
    empty.put(_entry(a))
    assert len(empty) == 0
    with pytest.raises(ValueError):
        PrefixCache(-1)


# ------------------------------------------------------------------------------- bit for bit


def test_a_reused_prefix_prefills_bit_for_bit(tiny_pair: Pair) -> None:
    """The last logits of a prompt prefilled after a reused prefix are the cold prefill's, bit
    for bit, also when its last chunk is a single token (a one-row call); reusing a prefix
    that does not end at a chunk boundary does not give them (the control: that the test sees
    a difference of one rounding)."""
    model = tiny_pair.target
    rng = np.random.default_rng(3)
    earlier = rng.integers(0, 300, 3 * C + 40).tolist()
    for prompt in (earlier[:2 * C] + [4, 5, 6], earlier[:2 * C + 1], earlier + [9] * 30):
        cold = model.new_cache(1, 512)
        want = prefill(model, cold, prompt, argmax=False)
        warm = model.new_cache(1, 512)
        prefill(model, warm, earlier, argmax=False)
        n = reusable(kept_prefix(earlier), prompt)
        assert n >= C
        warm.rollback(n)
        assert np.array_equal(prefill(model, warm, prompt, argmax=False), want)
    prompt = earlier[:2 * C + 11]
    misaligned = model.new_cache(1, 512)
    prefill(model, misaligned, earlier, argmax=False)
    misaligned.rollback(len(prompt) - 1)
    got = prefill(model, misaligned, prompt, argmax=False)
    cold = model.new_cache(1, 512)
    assert not np.array_equal(got, prefill(model, cold, prompt, argmax=False))


def _prefill_calls(pair: Pair, prompt: list[int]) -> list[tuple[int, int]]:
    """The target calls (past length, tokens fed) of a generation of one token: its prefill."""
    calls: list[tuple[int, int]] = []

    def recording(run: Any) -> Any:
        def recorded(cache: Any, tokens: np.ndarray, *args: Any, **kwargs: Any) -> Any:
            calls.append((int(cache.lengths[0]), int(tokens.shape[1])))
            return run(cache, tokens, *args, **kwargs)

        return recorded

    with pytest.MonkeyPatch.context() as mp:
        for name in ("feed", "forward", "forward_argmax"):
            mp.setattr(pair.target, name, recording(getattr(pair.target, name)))
        pair.generate_ids(prompt, GenerationConfig(max_new_tokens=1, drafter="none"))
    return calls


def test_a_warm_prefill_makes_the_cold_prefills_last_calls(tiny_pair_dir: Path,
                                                           tiny_pair: Pair) -> None:
    """Exact by construction: after a reused prefix, a prefill makes exactly the calls a cold
    prefill of the same prompt ends with (same past, same tokens), also when the prompt leaves
    the earlier one inside a chunk or right after it."""
    warm = Pair.load(tiny_pair_dir, prefix_cache=1)
    earlier = np.random.default_rng(5).integers(0, 300, 3 * C + 40).tolist()
    for prompt in (earlier[:2 * C + 10] + [1], earlier[:2 * C + 11], earlier[:2 * C] + [2] * 5,
                   earlier + [3] * 50, earlier[:C + 3], earlier[:2 * C + 30] + [4] * 150):
        if len(prompt) == 2 * C + 180:  # an earlier prompt of 2C + 30, then 3C + 5 ahead
            warm.generate_ids(prompt[:2 * C + 30], GenerationConfig(max_new_tokens=1,
                                                                    drafter="none"))
            assert warm.prefill_ahead(prompt[:3 * C + 5]) == 3 * C
        else:
            warm.generate_ids(earlier, GenerationConfig(max_new_tokens=1, drafter="none"))
        cold_calls, warm_calls = _prefill_calls(tiny_pair, prompt), _prefill_calls(warm, prompt)
        reused = warm_calls[0][0]
        assert reused > 0 and reused % C == 0, (len(prompt), warm_calls)
        assert warm_calls == cold_calls[-len(warm_calls):], (len(prompt), warm_calls)
        assert cold_calls[0][0] == 0 and sum(n for _, n in cold_calls) == len(prompt)


CONFIGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, seed=11)}


def _conversation(warm: Pair, cold: Pair, first: list[int], config: GenerationConfig,
                  turns: int = 4, ahead: bool = False) -> list[int]:
    """Each turn's prompt is the last prompt, its output and a few new tokens (with `ahead`,
    the last prompt and output are prefilled ahead between turns); asserts that every turn
    gives the cold pair's tokens; returns the prompt tokens each turn reused."""
    rng = np.random.default_rng(len(first))
    prompt, reused, held = list(first), [], 0
    for _ in range(turns):
        got, reason, stats = warm.generate_ids(prompt, config)
        assert (got, reason) == cold.generate_ids(prompt, config)[:2]
        reused.append(stats.cached_tokens)
        assert not ahead or stats.cached_tokens == held  # all that was prefilled ahead
        if ahead:
            held = warm.prefill_ahead(prompt + got)
            assert held == len(prompt + got) // C * C
        prompt = prompt + got + rng.integers(0, 300, 12).tolist()
    return reused


@pytest.mark.parametrize("ahead", [False, True], ids=["", "ahead"])
@pytest.mark.parametrize("sampling", list(CONFIGS))
@pytest.mark.parametrize("drafter", ["none", "model", "hybrid", "ngram"])
def test_a_conversation_decodes_as_from_empty_caches(tiny_pair_dir: Path, tiny_pair: Pair,
                                                     drafter: str, sampling: str,
                                                     ahead: bool) -> None:
    warm = Pair.load(tiny_pair_dir, prefix_cache=1)
    config = GenerationConfig(max_new_tokens=24, drafter=drafter, sampling=CONFIGS[sampling])
    first = np.random.default_rng(1).integers(0, 300, 2 * C + 12).tolist()  # one cache length
    reused = _conversation(warm, tiny_pair, first, config, ahead=ahead)
    assert reused[0] == 0 and all(n >= C for n in reused[1:])


def test_prefill_ahead_needs_a_kept_cache(tiny_pair_dir: Path, tiny_pair: Pair) -> None:
    ids = [i % 300 for i in range(3 * C)]
    assert tiny_pair.prefill_ahead(ids) == 0  # no prefix caching
    warm = Pair.load(tiny_pair_dir, prefix_cache=1)
    assert warm.prefill_ahead(ids) == 0  # nothing kept yet
    warm.generate_ids(ids[:C + 5], GenerationConfig(max_new_tokens=2, drafter="none"))
    assert warm.prefill_ahead([7] * (3 * C)) == 0  # no whole chunk in common
    assert warm.prefill_ahead(ids) == 3 * C
    # A first turn shorter than a chunk keeps no chunk, but its caches can be prefilled ahead
    # (the README's conversation: the first prompt and reply fill a chunk together).
    short = ids[:C // 2]
    config = GenerationConfig(max_new_tokens=8, drafter="model")
    out = warm.generate_ids(short, config)[0]
    assert warm.prefill_ahead(short + out + ids[:C]) == C
    prompt = short + out + ids[:C] + [5, 6]
    got, _, stats = warm.generate_ids(prompt, config)
    assert stats.cached_tokens == C and got == tiny_pair.generate_ids(prompt, config)[0]
    with pytest.raises(Exception, match="token id"):
        warm.prefill_ahead([-1])


@pytest.mark.parametrize("fields", [{"fixed_buffers": True}, {"device_argmax": True}],
                         ids=["fixed-buffers", "device-argmax"])
def test_a_conversation_on_fixed_buffers_decodes_as_from_empty_caches(
        tiny_pair_dir: Path, fields: dict[str, bool]) -> None:
    """The paths CUDA graphs and the greedy head take (run on the CPU): a kept cache is a fixed
    buffer set, and a prefill's last chunk may be narrow enough to replay a captured width."""
    plan = plan_threads()
    plan = ThreadPlan(replace(plan.target, **fields), replace(plan.draft, **fields))
    warm = Pair.load(tiny_pair_dir, plan=plan, prefix_cache=1)
    cold = Pair.load(tiny_pair_dir, plan=plan)
    config = GenerationConfig(max_new_tokens=20, drafter="model", num_draft_tokens=3,
                              adaptive=False)
    first = np.random.default_rng(6).integers(0, 300, 2 * C + 3).tolist()
    reused = _conversation(warm, cold, first, config, ahead=True)
    assert reused[0] == 0 and all(n >= 2 * C for n in reused[1:])


def test_the_draft_prefix_is_reused_when_the_drafter_changes(tiny_pair_dir: Path,
                                                              tiny_pair: Pair) -> None:
    """An entry made by n-gram drafting has no draft cache: a model-drafted turn after it
    reuses the target's prefix and prefills its draft from empty; and back."""
    warm = Pair.load(tiny_pair_dir, prefix_cache=1)
    prompt = np.random.default_rng(2).integers(0, 300, 2 * C + 5).tolist()
    for drafter in ("ngram", "model", "none", "hybrid", "model"):
        config = GenerationConfig(max_new_tokens=20, drafter=drafter)
        got, _, stats = warm.generate_ids(prompt, config)
        assert got == tiny_pair.generate_ids(prompt, config)[0]
        prompt = prompt + got + [3, 4]
        assert stats.cached_tokens >= (C if drafter != "ngram" else 0)


def test_an_abandoned_stream_keeps_its_prefix_and_a_failure_drops_it(
        tiny_pair_dir: Path, tiny_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    warm = Pair.load(tiny_pair_dir, prefix_cache=1)
    prompt = np.random.default_rng(4).integers(0, 300, 2 * C + 5).tolist()
    config = GenerationConfig(max_new_tokens=30, drafter="model")
    stream = warm.stream_tokens(prompt, config)
    next(stream)
    stream.close()  # the prefill is done: its chunks are kept
    assert len(warm.prefixes) == 1
    got, _, stats = warm.generate_ids(prompt, config)
    assert stats.cached_tokens == 2 * C and got == tiny_pair.generate_ids(prompt, config)[0]

    calls = {"n": 0}
    forward = warm.target.forward_argmax

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the round after the prefill
        calls["n"] += 1
        if calls["n"] == 3:
            raise ModelError("the target model produced NaN or inf logits")
        return forward(*args, **kwargs)

    monkeypatch.setattr(warm.target, "forward_argmax", failing)
    with pytest.raises(ModelError):
        warm.generate_ids(prompt, config)
    assert len(warm.prefixes) == 0  # a failed generation's caches are not trusted
    monkeypatch.undo()
    assert warm.generate_ids(prompt, config)[2].cached_tokens == 0


def test_conversation_ids_start_the_next_prompt(tiny_pair: Pair) -> None:
    """What `prefill_ahead` is given: the next request's prompt, but its new message and the
    assistant's header (a chat template renders both after the reply)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ahead = tiny_pair.conversation_ids(messages, "Hello!\n\nHow can I help?")
    following = tiny_pair.encode_prompt([*messages, {"role": "assistant",
                                                     "content": "Hello!\n\nHow can I help?"},
                                         {"role": "user", "content": "Tell me a joke."}])
    assert following[:len(ahead)] == ahead  # all of it: the next message follows
    assert "How can I help?" in tiny_pair.tokenizer.decode(ahead)
    assert tiny_pair.conversation_ids("The sky", " is blue") == tiny_pair.encode_prompt(
        "The sky is blue")
    assert tiny_pair.conversation_ids("Hi", "Hello", chat=True) == tiny_pair.conversation_ids(
        [{"role": "user", "content": "Hi"}], "Hello")


def test_prefix_cache_size_is_checked(tiny_pair_dir: Path) -> None:
    for bad in (-1, 65, True, 1.5):
        with pytest.raises(Exception, match="prefix_cache must be an integer in"):
            Pair.load(tiny_pair_dir, prefix_cache=bad)  # type: ignore[arg-type]


@pytest.mark.reference
def test_an_int4_targets_conversation_decodes_as_from_empty_caches(int4_target_dir: Path
                                                                   ) -> None:
    """The int4 target amplifies any difference of rounding to ~0.6 logits (its activations are
    quantized per call): a real chat on it, reusing each turn's prefix, is token for token
    what it decodes from empty caches."""
    warm, cold = Pair.load(int4_target_dir, prefix_cache=1), Pair.load(int4_target_dir)
    assert warm.target.two_row_steps
    messages = [{"role": "system", "content": "You are a patient teacher who answers in "
                 "detail, with examples, and checks that the student follows. " * 12}]
    config = GenerationConfig(max_new_tokens=40, drafter="ngram")
    reused = []
    for question in ("What is a prime number?", "Give three examples.",
                     "Why is 1 not prime?", "And 2?"):
        messages.append({"role": "user", "content": question})
        ids = warm.encode_prompt(messages, chat=True)
        got, reason, stats = warm.generate_ids(ids, config)
        assert (got, reason) == cold.generate_ids(ids, config)[:2]
        reused.append(stats.cached_tokens)
        reply = warm.tokenizer.decode(got, skip_special_tokens=True)
        # as `specedge chat` does between turns: all the next prompt will start with
        held = warm.prefill_ahead(warm.conversation_ids(messages, reply))
        messages.append({"role": "assistant", "content": reply})
        assert held >= len(ids + got) // C * C - C
    assert reused[0] == 0 and all(n >= C for n in reused[1:])  # one cache length throughout


# ------------------------------------------------------------------------------- server and CLI


def test_the_server_reports_reused_prompt_tokens(tiny_pair_dir: Path, tiny_pair: Pair) -> None:
    """A client re-sending its conversation: the second request reuses the first's prefix
    (usage.prompt_tokens_details.cached_tokens, /metrics) and answers what a cold pair
    decodes."""
    pair = Pair.load(tiny_pair_dir, prefix_cache=1)
    app = create_app(pair, ServerOptions(max_tokens_limit=64, warmup_tokens=0))
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 12},
                {"role": "user", "content": "Hello there"}]
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        cached = []
        for turn in ("And then?", "Thanks"):
            reply = client.chat.completions.create(model=tiny_pair_dir.name, messages=messages,
                                                   max_tokens=16, temperature=0)
            solo = tiny_pair.generate(messages, GenerationConfig(max_new_tokens=16, chat=True))
            assert reply.choices[0].message.content == solo.text
            details = reply.usage.prompt_tokens_details
            cached.append(details.cached_tokens if details else None)
            messages += [{"role": "assistant", "content": solo.text},
                         {"role": "user", "content": turn}]
        metrics = httpx.get(url + "/metrics").text
    assert cached[0] == 0 and cached[1] is not None and cached[1] >= C
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith("specedge_prompt_tokens_cached_total "))
    assert float(line.split()[1]) == cached[1]


def test_chat_reuses_the_conversation_and_says_so(tiny_pair_dir: Path) -> None:
    system = "You are a helpful assistant. " * 12
    args = ["chat", str(tiny_pair_dir), "--max-new-tokens", "6", "--system", system, "--stats"]
    outputs = {}
    for size in ("1", "0"):
        result = CliRunner().invoke(main, [*args, "--prefix-cache", size],
                                    input="Hello there\nAnd again\n\n")
        assert result.exit_code == 0, result.output
        outputs[size] = result.output
    reused = [int(line.split("│")[2]) for line in outputs["1"].splitlines()
              if "prompt tokens reused" in line]
    assert reused[0] == 0 and reused[1] >= C and len(reused) == 2
    replies = {size: [ln for ln in out.splitlines() if ln.startswith("> ")]
               for size, out in outputs.items()}
    assert replies["1"] == replies["0"] and len(replies["1"]) == 3  # the same conversation
