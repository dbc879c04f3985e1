"""A self-draft takes the prompt's keys and values from the target's prefill
(`KVCache.copy_from`, `drafters.self_draft`): no draft prefill, the same output."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specedge.runtime.drafters import ModelDrafter, build_drafter, self_draft
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prefix_cache import PREFILL_CHUNK, feed
from specedge.runtime.sampling import SamplingParams

LONG = ("Speculative decoding drafts tokens and verifies them in one pass. " * 12).strip()


def _kv(cache: object, n: int) -> list[np.ndarray]:
    """The first n positions of each key/value buffer of a batch-1 cache (CPU)."""
    values = cache.values  # type: ignore[attr-defined]
    if values:
        return [v.numpy()[0, :, :n] for v in values]
    return [cache.host[i, 0, :, :n] for i in range(cache.host.shape[0])]  # type: ignore


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-concat", "tiny-llama-mixed"])
def test_the_draft_holds_the_targets_prompt_keys_and_values(fixtures_dir: Path,
                                                            name: str) -> None:
    pair = Pair.load(fixtures_dir / name)
    assert pair.draft is not None and self_draft(pair.target.spec, pair.draft.spec)
    ids = pair.encode_prompt(LONG)
    target = pair.target.new_cache(1, len(ids) + 8)
    feed(pair.target, target, ids)
    drafter = build_drafter("model", pair.draft, len(ids) + 8, prompt_kv=target)
    assert isinstance(drafter, ModelDrafter) and drafter.prompt_kv is target
    drafter.prefill([*ids, 7])
    assert int(drafter.cache.lengths[0]) == len(ids) and drafter.fed == ids
    for mine, theirs in zip(_kv(drafter.cache, len(ids)), _kv(target, len(ids)), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    own = build_drafter("model", pair.draft, len(ids) + 8)  # the draft's own prefill differs
    assert isinstance(own, ModelDrafter)
    own.prefill([*ids, 7])
    assert any(not np.array_equal(a, b) for a, b in zip(_kv(own.cache, len(ids)),
                                                        _kv(target, len(ids)), strict=True))


def test_only_a_self_draft_shares(tiny_pair: Pair) -> None:
    target, draft = tiny_pair.target.spec, tiny_pair.draft.spec
    assert self_draft(target, draft)
    assert not self_draft(target, replace(draft, source={**draft.source, "origin": "other"}))
    assert not self_draft(target, replace(draft, num_layers=draft.num_layers + 1))
    assert not self_draft(replace(target, source={}), replace(draft, source={}))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-concat", "tiny-llama-mixed",
                                  "tiny-llama-int8static", "tiny-llama-fp8"])
def test_shared_prompt_keys_and_values_change_no_token(fixtures_dir: Path, name: str) -> None:
    """Greedy and seeded, model and hybrid drafting, cold and with a reused prefix: the output
    equals target-only decoding whether the draft prefills or takes the target's prompt."""
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=4)):
        cold = Pair.load(fixtures_dir / name)
        want = cold.generate(LONG, GenerationConfig(max_new_tokens=40, drafter="none",
                                                    sampling=sampling)).tokens
        for shares in (True, False):
            for drafter in ("model", "hybrid"):
                pair = Pair.load(fixtures_dir / name, prefix_cache=1)
                pair.shares_prompt_kv = shares
                config = GenerationConfig(max_new_tokens=40, drafter=drafter,
                                          num_draft_tokens=3, sampling=sampling)
                assert pair.generate(LONG, config).tokens == want, (shares, drafter)
                again = pair.generate(LONG, config)  # the draft cache reused, then extended
                assert again.tokens == want and again.stats.cached_tokens > 0


def test_a_prompt_crosses_graph_forms(fixtures_dir: Path) -> None:
    """A concat-form cache and a gqa-shared one of the same model hold a position alike (CPU):
    copied either way, the next token's logits are those of the receiving model's own prefill
    (tiny-llama's and tiny-llama-concat's targets are one model in the two forms)."""
    gqa = Pair.load(fixtures_dir / "tiny-llama").target
    concat = Pair.load(fixtures_dir / "tiny-llama-concat").target
    ids = Pair.load(fixtures_dir / "tiny-llama").encode_prompt(LONG)
    for source, receiver in ((concat, gqa), (gqa, concat)):
        given, own = source.new_cache(1, len(ids) + 4), receiver.new_cache(1, len(ids) + 4)
        feed(source, given, ids[:-1])
        feed(receiver, own, ids[:-1])
        copied = receiver.new_cache(1, len(ids) + 4)
        assert copied.same_layout(given)
        copied.copy_from(given, 0, len(ids) - 1)
        assert copied.fed[0, :len(ids) - 1].tolist() == ids[:-1]
        np.testing.assert_allclose(receiver.forward(copied, np.array([ids[-1:]])),
                                   receiver.forward(own, np.array([ids[-1:]])), atol=1e-4)


@pytest.mark.parametrize("name", ["tiny-llama-concat", "tiny-llama-mixed"])
def test_batches_share_the_prompt_and_change_no_token(fixtures_dir: Path, name: str) -> None:
    """Rows joining a batch (and a continuous batch, with a prefill budget) take the target's
    prompt into their draft rows, whether the draft is in the target's graph form or
    gqa-shared (`models/smollm2-135m-concat.sh`); every row equals its batch-1 target-only
    run."""
    from specedge.runtime.serving import ContinuousBatch

    concat_dir = fixtures_dir / name

    prompts = [LONG, "Hello there", LONG[:120] + " and more"]
    configs = [GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=3,
                                adaptive=False,
                                sampling=SamplingParams(temperature=t, seed=2))
               for t in (0.0, 0.7, 0.0)]
    cold = Pair.load(concat_dir)
    want = [cold.generate(p, replace(c, drafter="none")).tokens
            for p, c in zip(prompts, configs, strict=True)]
    for shares in (True, False):
        pair = Pair.load(concat_dir)
        pair.shares_prompt_kv = shares
        batch = pair.generate_batch(prompts, configs).results
        assert [r.tokens for r in batch] == want, shares
        server = ContinuousBatch(pair, capacity=2, drafter="model", num_draft_tokens=3,
                                 adaptive=False, prefill_budget=32)
        assert server.decoder.share_prompt_kv is shares
        rids = [server.submit(p, c) for p, c in zip(prompts, configs, strict=True)]
        server.step()
        joined = [r for r in server.decoder.slots if r is not None]
        assert joined
        if shares:  # the first rows' draft rows hold the target's prompt, bit for bit
            t_cache, d_cache = server.decoder.t_cache, server.decoder.d_cache
            for row in joined:
                n = row.prompt_len
                for i in range(2 * pair.target.spec.num_layers):
                    np.testing.assert_array_equal(d_cache.cpu_layer(i)[row.index, :, :n],
                                                  t_cache.cpu_layer(i)[row.index, :, :n])
        served = server.run()
        assert [served[r].tokens for r in rids] == want, shares


def test_a_prefill_ahead_copies_the_targets_keys_into_the_draft(
        tiny_pair_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Pair.prefill_ahead` (idle time between chat turns): a self-draft's kept cache takes the
    conversation's keys and values from the target's, as a cold generation's draft does, so
    the next turn drafts (and accepts) exactly as from empty caches, with no draft call ahead."""
    config = GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=3,
                              adaptive=False)
    cold = Pair.load(tiny_pair_dir)
    warm = Pair.load(tiny_pair_dir, prefix_cache=1)
    first = np.random.default_rng(3).integers(0, 300, 2 * PREFILL_CHUNK - 10).tolist()
    got = warm.generate_ids(first, config)[0]
    history = first + got
    draft_calls: list[int] = []
    feed_draft = warm.draft.feed  # type: ignore[union-attr]
    monkeypatch.setattr(warm.draft, "feed",
                        lambda cache, ids: (draft_calls.append(ids.shape[1]),
                                            feed_draft(cache, ids))[1])
    held = warm.prefill_ahead(history)
    monkeypatch.undo()
    assert held == len(history) // PREFILL_CHUNK * PREFILL_CHUNK and draft_calls == []
    assert held > PREFILL_CHUNK
    entry = warm.prefixes.take_extendable(history)
    assert entry is not None and entry.draft is not None
    for mine, theirs in zip(_kv(entry.draft, held), _kv(entry.target, held), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    warm.prefixes.put(entry)
    prompt = history + [5, 6, 7]
    tokens, reason, stats = warm.generate_ids(prompt, config)
    want, want_reason, want_stats = cold.generate_ids(prompt, config)
    assert stats.cached_tokens == held and (tokens, reason) == (want, want_reason)
    assert (stats.rounds, stats.accepted) == (want_stats.rounds, want_stats.accepted)


def test_a_batch_prefill_ahead_copies_the_targets_keys_into_the_draft(
        concat_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ContinuousBatch.prefill_ahead`: a self-draft's row of the free slot takes the target
    row's keys and values, bit for bit, with no draft call; the next turn equals its cold
    target-only run."""
    from specedge.runtime.serving import ContinuousBatch

    config = GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=3,
                              adaptive=False)
    pair = Pair.load(concat_dir)
    assert pair.shares_prompt_kv
    server = ContinuousBatch(pair, capacity=2, drafter="model", num_draft_tokens=3,
                             adaptive=False)
    first = np.random.default_rng(4).integers(0, 300, 2 * PREFILL_CHUNK - 10).tolist()
    rid = server.submit_ids(first, config)
    history = first + server.run()[rid].tokens
    draft_rows: list[int] = []
    rows_step = pair.draft._rows_step  # type: ignore[union-attr]
    monkeypatch.setattr(pair.draft, "_rows_step",
                        lambda *a, **k: (draft_rows.append(1), rows_step(*a, **k))[1])
    held = server.prefill_ahead(history)
    monkeypatch.undo()
    assert held > PREFILL_CHUNK and draft_rows == []
    t_cache, d_cache = server.decoder.t_cache, server.decoder.d_cache
    assert d_cache is not None
    slot = next(s for s in range(2) if int(t_cache.lengths[s]) == held)
    assert int(d_cache.lengths[slot]) == held
    np.testing.assert_array_equal(d_cache.host[:, slot, :, :held],
                                  t_cache.host[:, slot, :, :held])
    prompt = history + [5, 6, 7]
    rid = server.submit_ids(prompt, config)
    result = server.run()[rid]
    want = Pair.load(concat_dir).generate_ids(prompt, replace(config, drafter="none"))[0]
    assert result.tokens == want and result.stats.cached_tokens == held
