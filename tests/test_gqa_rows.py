"""Ragged batched calls on the in-place (gqa-shared) form: a batch's draft steps without
copying any row's past.

GroupQueryAttention takes several rows with a past only one new token each, or one row with
any number. `OrtModel.forward_rows` on a gqa-shared model splits a ragged call into such calls
(`_rows_step_shared`); its logits must be the concat form's for the same weights, and a pair with
a concat target and a gqa-shared draft must decode batches exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.runtime.backend import OrtModel
from specedge.runtime.kvcache import KVCache
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.serving import ContinuousBatch

PROMPTS = ["The quick brown fox", "Edge", "a b c d e f g", "def add(a, b):", "héllo 🙂"]


@pytest.fixture(scope="module")
def models(fixtures_dir: Path) -> tuple[OrtModel, OrtModel]:
    """The tiny fixture target in both forms (the same weights)."""
    return (Pair.load(fixtures_dir / "tiny-llama").target,
            Pair.load(fixtures_dir / "tiny-llama-concat").target)


@pytest.fixture(scope="module")
def mixed(fixtures_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """A pair whose target is concat and whose draft is gqa-shared (what `specedge export
    --graph concat --draft-graph gqa-shared` writes): the concat fixture with the gqa-shared
    fixture's draft."""
    folder = tmp_path_factory.mktemp("mixed") / "pair"
    shutil.copytree(fixtures_dir / "tiny-llama-concat", folder)
    shutil.rmtree(folder / "draft")
    shutil.copytree(fixtures_dir / "tiny-llama" / "draft", folder / "draft")
    doc = json.loads((folder / "specedge.json").read_text())
    gqa = json.loads((fixtures_dir / "tiny-llama" / "specedge.json").read_text())
    doc["models"]["draft"] = gqa["models"]["draft"]
    (folder / "specedge.json").write_text(json.dumps(doc))
    pair = Pair.load(folder)
    assert pair.draft is not None and pair.draft.spec.graph == "gqa-shared"
    assert pair.target.spec.graph == "concat"
    return pair


calls = st.lists(st.tuples(st.lists(st.booleans(), min_size=5, max_size=5),
                           st.lists(st.integers(1, 4), min_size=5, max_size=5)),
                 min_size=1, max_size=6)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=calls, seed=st.integers(0, 2**16))
def test_ragged_calls_equal_the_concat_form(models: tuple[OrtModel, OrtModel],
                                            calls: list[tuple[list[bool], list[int]]],
                                            seed: int) -> None:
    """Also on fixed buffers (what CUDA graphs replay: one call over every row, as on a GPU)
    next to the CPU's calls per run of neighbouring rows."""
    gqa, concat = models
    rng = np.random.default_rng(seed)
    vocab = 320  # the fixture tokenizer's ids (its table's too)
    caches = gqa.new_cache(5, 48), concat.new_cache(5, 48), KVCache(gqa, 5, 48, fixed=True)
    runs = (gqa, concat, gqa)
    for row, n in enumerate(rng.integers(1, 8, 5)):  # ragged prefills, one row a call
        tokens = rng.integers(3, vocab, (1, n))
        outs = [m.forward_rows(c, np.array([row]), tokens, np.array([n]))
                for m, c in zip(runs, caches, strict=True)]
        assert max(np.abs(o - outs[1]).max() for o in outs) < 1e-4
    for take, widths in calls:
        rows = np.flatnonzero(take)
        if not len(rows):
            continue
        lens = np.asarray(widths)[rows]
        tokens = rng.integers(3, vocab, (len(rows), int(lens.max())))
        outs = [m.forward_rows(c, rows, tokens, lens) for m, c in zip(runs, caches, strict=True)]
        valid = np.arange(lens.max())[None, :] < lens[:, None]
        assert max(np.abs(o - outs[1])[valid].max() for o in outs) < 1e-4
        assert all(np.array_equal(c.lengths, caches[1].lengths) for c in caches)
        ids, _ = gqa.forward_rows_greedy(caches[0], rows, tokens[:, :1], np.ones(len(rows)),
                                         np.ones(len(rows), bool), last=True)
        for m, c in zip(runs[1:], caches[1:], strict=True):
            m.forward_rows(c, rows, tokens[:, :1], np.ones(len(rows), np.int64))
        assert (ids[:, 0] >= 0).all()


def test_every_split_runs(models: tuple[OrtModel, OrtModel]) -> None:
    """The three ways a call is split: all rows one token (one call), one wide row (its own
    call), and every row two tokens (a one-token call over the cache per position)."""
    gqa, _ = models
    cache = gqa.new_cache(3, 32)
    for row in range(3):
        gqa.forward_rows(cache, np.array([row]), np.full((1, 4), 7), np.array([4]))
    before = gqa.calls
    gqa.forward_rows(cache, np.arange(3), np.full((3, 1), 9), np.ones(3, np.int64))
    assert gqa.calls - before == 1
    gqa.forward_rows(cache, np.array([0, 2]), np.full((2, 3), 9), np.array([1, 3]))
    assert gqa.calls - before == 3  # row 2 alone, then row 0 in a one-token call
    gqa.forward_rows(cache, np.arange(3), np.full((3, 2), 9), np.full(3, 2))
    assert gqa.calls - before == 5  # two one-token calls beat three row calls
    assert list(cache.lengths) == [4 + 1 + 1 + 2, 4 + 1 + 2, 4 + 1 + 3 + 2]
    wide = gqa.new_cache(8, 16)
    before = gqa.calls
    gqa.forward_rows(wide, np.array([0, 6, 7]), np.full((3, 1), 9), np.ones(3, np.int64))
    assert gqa.calls - before == 2  # on the CPU, rows 0 and 6-7 apart: not the idle five
    assert list(wide.lengths) == [1, 0, 0, 0, 0, 0, 1, 1]


def test_mixed_pair_batches_exactly(mixed: Pair) -> None:
    for k in (1, 3):
        for adaptive in (False, True):
            cfg = GenerationConfig(max_new_tokens=20, drafter="model", num_draft_tokens=k,
                                   adaptive=adaptive)
            batched = mixed.generate_batch(PROMPTS, cfg)
            for prompt, row in zip(PROMPTS, batched.results, strict=True):
                alone = mixed.generate(prompt, GenerationConfig(max_new_tokens=20,
                                                                drafter="none"))
                assert row.tokens == alone.tokens, (prompt, k, adaptive)
            assert batched.stats.proposed > 0


def test_mixed_pair_seeded_rows_and_continuous_batching(mixed: Pair) -> None:
    seeded = SamplingParams(temperature=0.8, seed=99)
    alone = mixed.generate(PROMPTS[0], GenerationConfig(max_new_tokens=20, drafter="none",
                                                        sampling=seeded))
    server = ContinuousBatch(mixed, capacity=2, num_draft_tokens=2, adaptive=False)
    ids = [server.submit(p, GenerationConfig(max_new_tokens=20, num_draft_tokens=2,
                                             adaptive=False))
           for p in PROMPTS[1:]]
    rid = server.submit(PROMPTS[0], GenerationConfig(max_new_tokens=20, num_draft_tokens=2,
                                                     adaptive=False, sampling=seeded))
    done = server.run()
    assert done[rid].tokens == alone.tokens
    for prompt, i in zip(PROMPTS[1:], ids, strict=True):
        assert done[i].tokens == mixed.generate(prompt, GenerationConfig(
            max_new_tokens=20, drafter="none")).tokens


def test_mixed_pair_with_the_draft_on_fixed_buffers(mixed: Pair) -> None:
    """The draft replaying its batched steps (fixed buffers: what CUDA graphs capture, on the
    CPU without the capture) beside the concat target's plain runs: the same rows."""
    from dataclasses import replace as with_fields

    from specedge.runtime.pair import ThreadPlan, plan_threads

    threads = plan_threads()
    fixed = Pair.load(mixed.manifest.root, plan=ThreadPlan(
        threads.target, with_fields(threads.draft, fixed_buffers=True)))
    assert fixed.draft is not None and fixed.draft.config.fixed
    assert not fixed.target.config.fixed
    cfg = GenerationConfig(max_new_tokens=20, drafter="model", num_draft_tokens=3,
                           adaptive=False)
    for pair in (fixed, mixed):
        batched = pair.generate_batch(PROMPTS, cfg)
        for prompt, row in zip(PROMPTS, batched.results, strict=True):
            alone = mixed.generate(prompt, GenerationConfig(max_new_tokens=20, drafter="none"))
            assert row.tokens == alone.tokens, prompt
