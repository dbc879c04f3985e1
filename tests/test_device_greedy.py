"""Greedy verification from argmax ids taken where the logits are, and steps on fixed buffers.

The GPU features (the greedy head on the CUDA device, CUDA graphs) run the same code as here on
the CPU: the greedy head session on CPU logits, and fixed buffers with a full-length mask without
the graph capture. So every path is checked token for token against target-only decoding, with a
spy that proves the path under test actually ran. Only the capture itself is left to the GPU
check (`scripts/gpu_check.sh`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specedge.runtime import backend
from specedge.runtime.acceptance import accept_greedy, accept_greedy_ids
from specedge.runtime.backend import OrtModel
from specedge.runtime.errors import InputError, ModelError
from specedge.runtime.greedy_head import GreedyHead
from specedge.runtime.kvcache import GRAPH_WARMUP_RUNS, MAX_FIXED_WIDTH
from specedge.runtime.pair import GenerationConfig, Pair, ThreadPlan, plan_threads
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.sessions import (
    NO_GRAPH,
    SessionConfig,
    cuda_provider_options,
    graph_run_options,
    helper_config,
)
from tests.concat_reference import assert_equals_session_run, pasts_of

PROMPTS = ["the quick brown fox", "a b c d e f g a b c", "once upon a time there was",
           "numbers 1 2 3 4 5 6 7 8"]
SPECULATIVE = [GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=3,
                                adaptive=False),
               GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=5,
                                adaptive=True),
               GenerationConfig(max_new_tokens=24, drafter="hybrid", num_draft_tokens=4,
                                adaptive=False)]


def _with(pair_dir: Path, **options: object) -> Pair:
    plan = plan_threads()
    return Pair.load(pair_dir, plan=ThreadPlan(replace(plan.target, **options),  # type: ignore[arg-type]
                                               replace(plan.draft, **options)))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _head_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the greedy head's ids on every call shape (steps, blocks, batches,
    prefills), so the head takes them all here; by default it takes one-position calls only
    (`HEAD_MAX_POSITIONS`, see `test_the_head_takes_one_position_calls_by_default`)."""
    monkeypatch.setattr(backend, "HEAD_MAX_POSITIONS", 1 << 30)


class _Spy:
    """Counts the calls of a bound method and passes them on."""

    def __init__(self, obj: object, name: str) -> None:
        self.calls = 0
        inner = getattr(obj, name)

        def wrapped(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return inner(*args, **kwargs)

        setattr(obj, name, wrapped)


# ----------------------------------------------------------------------------- the head graph


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_greedy_head_is_numpy_argmax_with_ties_to_the_lowest_id(dtype: str) -> None:
    rng = np.random.default_rng(0)
    vocab = 97
    head = GreedyHead(SessionConfig(), dtype, vocab)
    # Small integers: most positions have a tie for the maximum.
    logits = rng.integers(-3, 4, (5, 6, vocab)).astype(dtype)
    logits[0, 0] = 2  # a whole row tied: id 0
    logits[1, 2, -1] = 50  # the maximum at the last id
    import onnxruntime as ort

    ids, sums, kept = head.run(ort.OrtValue.ortvalue_from_numpy(logits), np.asarray([3, 1]))
    assert ids.dtype == np.int64 and ids.shape == (5, 6)
    assert (ids == np.argmax(logits, axis=-1)).all()
    assert ids[0, 0] == 0 and ids[1, 2] == vocab - 1
    assert np.isfinite(sums).all()
    assert kept.dtype == logits.dtype and np.array_equal(kept, logits[[3, 1]])
    logits[2, 4, 5] = np.nan
    logits[4, 1, 0] = np.inf
    _, sums, kept = head.run(ort.OrtValue.ortvalue_from_numpy(logits), np.zeros(0, np.int64))
    assert not np.isfinite(sums[2, 4]) and not np.isfinite(sums[4, 1])
    assert np.isfinite(np.delete(sums.ravel(), [2 * 6 + 4, 4 * 6 + 1])).all()
    assert kept.shape == (0, 6, vocab)


def test_accept_greedy_ids_is_accept_greedy() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        k = int(rng.integers(0, 6))
        logits = rng.integers(0, 3, (k + 1, 5)).astype(np.float32)  # ties, short accepts
        best = np.argmax(logits, axis=-1)
        drafts = np.where(rng.random(k) < 0.7, best[:k], rng.integers(0, 5, k))
        assert np.array_equal(accept_greedy_ids(drafts, best), accept_greedy(drafts, logits))
    with pytest.raises(InputError):
        accept_greedy_ids(np.asarray([1, 2]), np.asarray([1, 2]))


# ----------------------------------------------------------------------------- batch 1


def _check_batch1(pair_dir: Path, reference: Pair, prompts: list[str]) -> None:
    on = _with(pair_dir, device_argmax=True)
    assert on.target.head is not None and reference.target.head is None
    spy = _Spy(on.target.head, "run")
    accepted = dict.fromkeys(SPECULATIVE, 0)
    for prompt in prompts:
        want = reference.generate(prompt, GenerationConfig(max_new_tokens=24, drafter="none"))
        alone = on.generate(prompt, GenerationConfig(max_new_tokens=24, drafter="none"))
        assert alone.tokens == want.tokens
        for cfg in SPECULATIVE:
            got = on.generate(prompt, cfg)
            assert got.tokens == want.tokens, (prompt, cfg)
            assert got.text == want.text
            accepted[cfg] += got.stats.accepted
    assert all(accepted.values()), accepted  # every setting verified accepted drafts
    # every target call of every greedy generation went through the head
    assert spy.calls >= len(prompts) * (1 + len(SPECULATIVE)) * 2


def test_device_argmax_speculative_equals_target_only(tiny_pair_dir: Path,
                                                      tiny_pair: Pair) -> None:
    _check_batch1(tiny_pair_dir, tiny_pair, PROMPTS)


@pytest.mark.reference
def test_device_argmax_speculative_equals_target_only_reference(
        reference_pair_dir: Path, reference_pair: Pair) -> None:
    _check_batch1(reference_pair_dir, reference_pair, PROMPTS[:2])


def test_device_argmax_is_off_on_cpu_by_default_and_on_for_gpus() -> None:
    assert not SessionConfig().argmax_on_device
    assert SessionConfig(provider="cuda").argmax_on_device
    assert SessionConfig(provider="tensorrt").argmax_on_device
    assert not SessionConfig(provider="cuda", device_argmax=False).argmax_on_device
    assert SessionConfig(device_argmax=True).argmax_on_device


def test_device_argmax_refuses_nan_logits(tiny_pair_dir: Path) -> None:
    on = _with(tiny_pair_dir, device_argmax=True)
    assert on.target.head is not None
    head = on.target.head
    inner = head.run

    def poisoned(logits, keep):  # noqa: ANN001, ANN202 - the sums say NaN, as the graph would
        ids, sums, kept = inner(logits, keep)
        sums[0, -1] = np.nan
        return ids, sums, kept

    head.run = poisoned  # type: ignore[method-assign]
    cache = on.target.new_cache(1, 16)
    with pytest.raises(ModelError, match="NaN or inf"):
        on.target.forward_argmax(cache, np.asarray([[1, 2, 3]], np.int64))


def test_fp16_host_logits_take_the_float_argmax(concat_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks and batches of an fp16 model argmax host logits on order keys
    (`runtime/host_argmax`): the ids of the float32 argmax, ties to the lowest, and float32
    logits for the rows that sample; NaN refused as before."""
    pair = Pair.load(concat_dir)
    model = pair.target
    tied = (np.random.default_rng(5).integers(-3, 4, (3, 3, pair.manifest.vocab_size))
            .astype(np.float16) / np.float16(4))  # many ties
    valid = np.asarray([[1, 1, 1], [1, 1, 0], [1, 0, 0]], bool)
    monkeypatch.setattr(model, "_rows_step", lambda *a: (tied.copy(), valid, 0))
    monkeypatch.setattr(model, "_step", lambda *a: (tied.copy(), 0))
    greedy = np.asarray([True, False, True])
    tokens = np.zeros((3, 3), np.int64)
    ids, kept = model.forward_rows_greedy(None, np.arange(3), tokens,  # type: ignore[arg-type]
                                          valid.sum(1), greedy)
    want = tied.astype(np.float32).argmax(-1)
    assert np.array_equal(ids[greedy][valid[greedy]], want[greedy][valid[greedy]])
    assert kept.dtype == np.float32 and np.array_equal(kept, tied[~greedy].astype(np.float32))
    assert np.array_equal(model.forward_argmax(None, tokens), want)  # type: ignore[arg-type]
    tied[1, 2, 7] = np.float16("nan")  # an unfed position: not judged by the rows path
    model.forward_rows_greedy(None, np.arange(3), tokens, valid.sum(1), greedy)  # type: ignore[arg-type]
    tied[1, 1, 7] = -np.float16("nan")  # a fed one, a negative NaN (ordered below -inf)
    with pytest.raises(ModelError, match="NaN or inf"):
        model.forward_rows_greedy(None, np.arange(3), tokens, valid.sum(1), greedy)  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="NaN or inf"):
        model.forward_argmax(None, tokens)  # type: ignore[arg-type]


def test_the_head_takes_one_position_calls_by_default(tiny_pair_dir: Path, tiny_pair: Pair,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On the H200 the head cost 5.2-5.6 ms for 2-8 positions and 0.17 ms for one, so by
    default blocks, prefills and two-row steps take numpy's argmax on host logits and one-row
    steps the head; the tokens are the same either way."""
    monkeypatch.undo()
    assert backend.HEAD_MAX_POSITIONS == 1
    on = _with(tiny_pair_dir, device_argmax=True)
    assert on.target.head is not None
    widths: list[tuple[int, int]] = []
    inner = on.target.head.run

    def seen(logits, keep):  # noqa: ANN001, ANN202
        widths.append(tuple(logits.shape()[:2]))
        return inner(logits, keep)

    on.target.head.run = seen  # type: ignore[method-assign]
    for cfg in (GenerationConfig(max_new_tokens=24, drafter="none"), *SPECULATIVE):
        want = tiny_pair.generate(PROMPTS[0], cfg).tokens
        assert on.generate(PROMPTS[0], cfg).tokens == want
    assert widths and set(widths) == {(1, 1)}  # the one-row steps, and only they


def test_device_argmax_judges_only_the_positions_it_returns(tiny_pair_dir: Path) -> None:
    """A prefill returns its last position's argmax: an overflow at an earlier position is not
    the caller's, and the host path ignores it too. On the H200 the head refused such prefills
    of random-weight fp16 pairs that the host path ran (docs/results/gpu_h200.md)."""
    on = _with(tiny_pair_dir, device_argmax=True)
    off = _with(tiny_pair_dir, device_argmax=False)
    head = on.target.head
    assert head is not None
    inner = head.run

    def early_nan(logits, keep):  # noqa: ANN001, ANN202
        ids, sums, kept = inner(logits, keep)
        sums[0, 0] = np.nan
        return ids, sums, kept

    head.run = early_nan  # type: ignore[method-assign]
    tokens = np.asarray([[1, 2, 3]], np.int64)
    got = on.target.forward_argmax(on.target.new_cache(1, 16), tokens, last=True)
    want = off.target.forward_argmax(off.target.new_cache(1, 16), tokens, last=True)
    assert got.tolist() == want.tolist()
    with pytest.raises(ModelError, match="NaN or inf"):  # every position returned: refused
        on.target.forward_argmax(on.target.new_cache(1, 16), tokens)


# ----------------------------------------------------------------------------- batches


def test_device_argmax_batches_equal_batch1(concat_dir: Path) -> None:
    off = Pair.load(concat_dir)
    on = _with(concat_dir, device_argmax=True)
    assert on.target.head is not None
    spy = _Spy(on.target.head, "run")
    sampled = SamplingParams(temperature=0.8, top_k=40, seed=11)
    for cfg in [GenerationConfig(max_new_tokens=20, drafter="none"), *SPECULATIVE]:
        # greedy rows next to a seeded sampled row (which still gets its logits rows)
        configs = [cfg, cfg, replace(cfg, sampling=sampled), cfg]
        got = on.generate_batch(PROMPTS, configs)
        want = off.generate_batch(PROMPTS, configs)
        for prompt, c, g, w in zip(PROMPTS, configs, got.results, want.results, strict=True):
            assert g.tokens == w.tokens, (prompt, c)
            if c.sampling.greedy:
                alone = off.generate(prompt, replace(c, drafter="none", adaptive=False))
                assert g.tokens == alone.tokens
    assert spy.calls > 0


def test_batch_draft_paths_with_and_without_a_confidence_cut_off(concat_dir: Path) -> None:
    """Greedy batch rows draft from argmax ids without a cut-off and from logits with one; both
    give the target-only tokens, with the argmax on the host and on the device."""
    off = Pair.load(concat_dir)
    on = _with(concat_dir, device_argmax=True)
    cfg = GenerationConfig(max_new_tokens=20, drafter="model", num_draft_tokens=4,
                           adaptive=False)
    want = [off.generate(p, replace(cfg, drafter="none")).tokens for p in PROMPTS]
    proposed = []
    for p_min in (0.0, 0.02):  # 0.02 cuts about half the tiny draft's proposals
        for pair in (off, on):
            got = pair.generate_batch(PROMPTS, replace(cfg, draft_p_min=p_min))
            assert [r.tokens for r in got.results] == want, (p_min, pair is on)
            proposed.append(got.stats.proposed)
    assert proposed[0] == proposed[1] > proposed[2] == proposed[3] > 0  # the cut-off cuts


def test_forward_rows_greedy_ids_and_kept_rows(concat_dir: Path) -> None:
    on = _with(concat_dir, device_argmax=True)
    off = Pair.load(concat_dir)
    rows = np.asarray([0, 2, 1])
    tokens = np.asarray([[5, 6, 7], [8, 9, 0], [10, 0, 0]], np.int64)
    lens = np.asarray([3, 2, 1])
    greedy = np.asarray([True, False, True])
    results = []
    for pair in (on, off):
        cache = pair.target.new_cache(3, 32)
        logits = pair.target.forward_rows(cache, rows, tokens, lens)
        cache2 = pair.target.new_cache(3, 32)
        ids, kept = pair.target.forward_rows_greedy(cache2, rows, tokens, lens, greedy)
        last, _ = pair.target.forward_rows_greedy(pair.target.new_cache(3, 32), rows, tokens,
                                                  lens, greedy, last=True)
        assert np.array_equal(cache.lengths, cache2.lengths)
        fed = np.arange(3)[None, :] < lens[:, None]
        want = np.where(fed & greedy[:, None], np.argmax(logits, axis=-1), -1)
        assert np.array_equal(ids, want) and (ids[greedy][fed[greedy]] >= 0).all()
        assert np.array_equal(kept, logits[~greedy])
        assert np.array_equal(last[:, 0], want[np.arange(3), lens - 1])
        results.append((ids, kept))
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][1], results[1][1])


def test_host_kv_run_equals_the_plain_run(concat_dir: Path) -> None:
    """A host-cache concat run (pasts gathered into staging, presents bound by address, the
    buffers reused and grown across calls): the same logits and cache as `session.run` fed the
    rows' pasts, for ragged row subsets in any order."""
    model = Pair.load(concat_dir).target
    rng = np.random.default_rng(5)
    cache = model.new_cache(3, 40)  # rows this short are gathered (`kv_room.padded_past`)
    model.forward_rows(cache, np.arange(3), rng.integers(3, 300, (3, 6)), np.array([6, 4, 5]))
    for rows, width, lens in (([2, 0], 3, [3, 1]), ([1], 1, [1]), ([0, 1, 2], 5, [5, 2, 4]),
                              ([2, 1], 2, [2, 2])):
        rows_a, lens_a = np.asarray(rows), np.asarray(lens)
        tokens = rng.integers(3, 300, (len(rows), width)).astype(np.int64)
        lengths, pasts = cache.lengths[rows_a].copy(), pasts_of(cache, rows_a)
        got = model.forward_rows(cache, rows_a, tokens, lens_a)
        assert_equals_session_run(model, cache, rows_a, pasts, lengths, tokens, lens_a,
                                  int(lengths.max()), got)


def test_host_kv_run_allocates_no_cache_sized_arrays(concat_dir: Path) -> None:
    """A warm host-cache concat run reuses its staging buffers: before, every call made a
    fresh past array per layer (and the presents), and glibc mapped and unmapped them (1,800
    page faults per call at batch 8 once a draft's cache existed: 13% slower target calls)."""
    import tracemalloc

    model = Pair.load(concat_dir).target
    spec = model.spec
    rows, past = 4, 100
    cache = model.new_cache(rows, 120)
    rng = np.random.default_rng(2)
    model.forward_rows(cache, np.arange(rows), rng.integers(3, 300, (rows, past)),
                       np.full(rows, past))
    per_call_kv = (2 * spec.num_layers * rows * spec.num_kv_heads * past * spec.head_dim
                   * np.dtype(np.float32).itemsize)
    step = rng.integers(3, 300, (rows, 1))
    for _ in range(2):  # warm: the staging buffers grow to this size
        model.forward_rows(cache, np.arange(rows), step, np.ones(rows, np.int64))
    tracemalloc.start()
    try:
        model.forward_rows(cache, np.arange(rows), step, np.ones(rows, np.int64))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < per_call_kv / 4, (peak, per_call_kv)


# ----------------------------------------------------------------------------- fixed buffers


def test_fixed_buffers_give_the_same_logits(tiny_pair_dir: Path, tiny_pair: Pair) -> None:
    fixed = _with(tiny_pair_dir, fixed_buffers=True)
    spy = _Spy(fixed.target, "_run_fixed")
    a, b = tiny_pair.target.new_cache(1, 40), fixed.target.new_cache(1, 40)
    assert b.max_len == 64 and b._fixed is not None  # rounded up to share pooled buffers
    rng = np.random.default_rng(3)
    for width in (7, 1, 3, 1, 2, MAX_FIXED_WIDTH + 1, 4):
        block = rng.integers(3, 300, (1, width)).astype(np.int64)
        x = tiny_pair.target.forward(a, block)
        y = fixed.target.forward(b, block)
        assert np.array_equal(x, y), width
        a.rollback(int(a.lengths[0]) - 1)  # rollback by length works the same
        b.rollback(int(b.lengths[0]) - 1)
    assert spy.calls == 6  # the block wider than MAX_FIXED_WIDTH ran plain


def test_fixed_buffers_speculative_equals_target_only(tiny_pair_dir: Path,
                                                      tiny_pair: Pair) -> None:
    fixed = _with(tiny_pair_dir, fixed_buffers=True, device_argmax=True)
    spy = _Spy(fixed.target, "_run_fixed")
    for prompt in PROMPTS:
        want = tiny_pair.generate(prompt, GenerationConfig(max_new_tokens=24, drafter="none"))
        for cfg in SPECULATIVE:
            assert fixed.generate(prompt, cfg).tokens == want.tokens, (prompt, cfg)
    assert spy.calls > 0
    # every generation gave its buffers back: one set per cache length, reused
    assert all(len(free) == 1 for free in fixed.target._pool.values())


def test_fixed_buffers_are_pooled_and_graph_ids_are_per_width(tiny_pair_dir: Path) -> None:
    pair = _with(tiny_pair_dir, fixed_buffers=True)
    model = pair.target
    # What cuda_graph adds to fixed buffers is a graph id per (buffers, width) and its run
    # options; the CPU provider ignores the option, so the bookkeeping runs here. (A CPU config
    # cannot say cuda_graph=True: the field is set past its check for this test only.)
    config = dataclasses.replace(model.config)
    object.__setattr__(config, "cuda_graph", True)
    model.config = config
    first = model.new_cache(1, 30)
    buffers = first._fixed
    for width in (5, 1, 3, 1):
        model.forward(first, np.ones((1, width), np.int64))
    ids = {w: s.graph_id for w, s in buffers.steps.items()}
    assert sorted(ids) == [1, 3, 5] and len(set(ids.values())) == 3
    assert all(i is not None and i >= 1 for i in ids.values())
    for step in buffers.steps.values():
        assert step.run_options is not None
        assert step.run_options.get_run_config_entry("gpu_graph_id") == str(step.graph_id)
    del first
    second = model.new_cache(1, 50)  # same rounded length: the same buffers and graphs
    assert second._fixed is buffers
    other = model.new_cache(1, 50)  # while `second` holds them: new buffers, new graph ids
    assert other._fixed is not buffers
    model.forward(other, np.ones((1, 1), np.int64))
    assert other._fixed.steps[1].graph_id not in ids.values()


def test_fixed_buffers_need_a_gqa_shared_model(concat_dir: Path) -> None:
    with pytest.raises(InputError, match="gqa-shared"):
        _with(concat_dir, fixed_buffers=True)


# ----------------------------------------------------------------------------- CUDA graph options


def test_cuda_graph_needs_the_cuda_provider() -> None:
    for provider in ("cpu", "tensorrt"):
        with pytest.raises(InputError, match="cuda_graph needs provider 'cuda'"):
            SessionConfig(provider=provider, cuda_graph=True)
    cfg = SessionConfig(provider="cuda", cuda_graph=True, device_id=1)
    assert cfg.fixed and cfg.argmax_on_device
    assert cuda_provider_options(cfg) == {"device_id": "1", "use_tf32": "0",
                                          "enable_cuda_graph": "1"}
    assert cuda_provider_options(SessionConfig(provider="cuda")) == {"device_id": "0",
                                                                     "use_tf32": "0"}
    assert not SessionConfig().fixed


def test_tf32_is_off_unless_asked_for() -> None:
    """ONNX Runtime's CUDA EP rounds float32 products' inputs to TF32 (10 mantissa bits) by
    default, so an fp32 pair's near-ties could flip between a verification block and a step.
    specedge turns it off unless the caller trades exactness for speed."""
    assert cuda_provider_options(SessionConfig(provider="cuda"))["use_tf32"] == "0"
    assert cuda_provider_options(SessionConfig(provider="cuda", tf32=True))["use_tf32"] == "1"
    assert cuda_provider_options(helper_config(SessionConfig(provider="tensorrt")))[
        "use_tf32"] == "0"


def test_graph_run_options() -> None:
    assert graph_run_options(None) is None
    assert graph_run_options(7).get_run_config_entry("gpu_graph_id") == "7"
    assert graph_run_options(NO_GRAPH).get_run_config_entry("gpu_graph_id") == "-1"
    with pytest.raises(AssertionError):
        graph_run_options(0)  # ONNX Runtime's own default id


def test_plain_runs_of_a_graph_session_are_kept_out_of_capture(tiny_pair_dir: Path) -> None:
    pair = _with(tiny_pair_dir, fixed_buffers=True)
    model = pair.target
    seen: list[object] = []
    session = model.session
    inner = session.run_with_iobinding

    def record(binding, options=None):  # noqa: ANN001, ANN202
        seen.append(options.get_run_config_entry("gpu_graph_id") if options else None)
        return inner(binding, options)

    session.run_with_iobinding = record  # type: ignore[method-assign]
    config = dataclasses.replace(model.config)
    object.__setattr__(config, "cuda_graph", True)
    model.config = config
    cache = model.new_cache(1, 64)
    model.forward(cache, np.ones((1, MAX_FIXED_WIDTH + 2), np.int64))  # a long prefill: plain
    for _ in range(GRAPH_WARMUP_RUNS + 2):
        model.forward(cache, np.ones((1, 1), np.int64))  # steps: warm-up runs, then its graph
    graph = str(cache._fixed.steps[1].graph_id)
    # Each width runs out of capture at its own shapes before its graph is captured (ONNX
    # Runtime's CUDA EP counts warm-up runs per thread, not per graph id).
    assert seen == [str(NO_GRAPH)] * (1 + GRAPH_WARMUP_RUNS) + [graph, graph]
    assert graph not in (str(NO_GRAPH), "0")
    model.forward(cache, np.ones((1, 3), np.int64))  # a new width warms up again
    assert seen[-1] == str(NO_GRAPH) and GRAPH_WARMUP_RUNS >= 2


def test_ortmodel_is_unchanged_for_drafters(tiny_pair: Pair) -> None:
    """The drafters' interface: `forward` returns host logits that the next call does not
    overwrite."""
    model: OrtModel = tiny_pair.target
    cache = model.new_cache(1, 16)
    first = model.forward(cache, np.asarray([[1, 2]], np.int64))
    kept = first.copy()
    model.forward(cache, np.asarray([[3, 4]], np.int64))
    assert np.array_equal(first, kept)


@pytest.mark.parametrize("device_argmax", [False, True])
def test_greedy_draft_steps_take_only_the_argmax(tiny_pair_dir: Path, device_argmax: bool
                                                 ) -> None:
    """Greedy drafting without a confidence cut-off asks the draft for argmax ids only (on a GPU
    the greedy head keeps the vocabulary row on the device); it proposes what the logits path
    proposes, and the output stays target-only's."""
    from specedge.runtime.drafters import ModelDrafter
    from specedge.runtime.rounds import RowSampler

    t = plan_threads("cpu", "cpu")
    plan = ThreadPlan(replace(t.target, device_argmax=device_argmax),
                      replace(t.draft, device_argmax=device_argmax))
    pair = Pair.load(tiny_pair_dir, plan=plan)
    assert pair.draft is not None
    sampler = RowSampler(SamplingParams(), pair.manifest.vocab_size)
    prompt = pair.encode_prompt("The quick brown")
    calls: list[int] = []
    real = pair.draft.forward_argmax
    pair.draft.forward_argmax = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # type: ignore[method-assign]
    fast = ModelDrafter(pair.draft, pair.draft.new_cache(1, 64))
    slow = ModelDrafter(pair.draft, pair.draft.new_cache(1, 64), p_min=1e-12)
    got = fast.propose(prompt, 5, sampler, 0).tokens
    assert len(calls) == 5
    assert got.tolist() == slow.propose(prompt, 5, sampler, 0).tokens.tolist()
    assert len(calls) == 5  # the cut-off path reads the logits
    cfg = GenerationConfig(max_new_tokens=20, drafter="model", num_draft_tokens=4)
    assert (pair.generate("def add(a, b):", cfg).tokens ==
            pair.generate("def add(a, b):", replace(cfg, drafter="none")).tokens)


def test_pair_load_switches(tiny_pair_dir: Path) -> None:
    pair = Pair.load(tiny_pair_dir, device_argmax=True)
    assert pair.target.config.device_argmax is True and pair.draft is not None
    assert pair.draft.config.device_argmax is True
    cfg = GenerationConfig(max_new_tokens=16, drafter="model", num_draft_tokens=3)
    assert (pair.generate("The quick", cfg).tokens ==
            Pair.load(tiny_pair_dir).generate("The quick", cfg).tokens)
    with pytest.raises(InputError, match="CUDA graphs need a model on the cuda provider"):
        Pair.load(tiny_pair_dir, cuda_graph=True)


def test_step_logits_stay_in_a_value_kept_per_shape(tiny_pair_dir: Path, tiny_pair: Pair) -> None:
    """Where the argmax is taken on the device, a step's logits go to an OrtValue the cache
    keeps per shape and are returned as they are (no wrappers for the 2 x layers presents);
    a prefill wider than MAX_FIXED_WIDTH gets a fresh one. Same logits as the host path."""
    model = _with(tiny_pair_dir, device_argmax=True).target
    plain = tiny_pair.target
    a, b = model.new_cache(1, 64), plain.new_cache(1, 64)
    prompt = np.arange(MAX_FIXED_WIDTH + 3, dtype=np.int64)[None] % plain.logits_size
    assert np.array_equal(model.forward(a, prompt), plain.forward(b, prompt))
    assert not a._device_logits  # the prefill's were not kept
    for width in (1, 3, 1):
        tokens = np.full((1, width), 5, np.int64)
        raw, _ = model._step(a, tokens)
        assert raw is a._device_logits[(1, width, model.logits_size)]
        assert np.array_equal(raw.numpy(), plain.forward(b, tokens))
    assert len(a._device_logits) == 2


def test_greedy_head_bindings_are_per_thread(tiny_pair_dir: Path, tiny_pair: Pair) -> None:
    """The greedy head keeps an IO binding and output buffers per thread: generations on
    several threads with one pair give each its own tokens (a shared binding would race)."""
    from concurrent.futures import ThreadPoolExecutor

    pair = _with(tiny_pair_dir, device_argmax=True)
    cfg = GenerationConfig(max_new_tokens=40, drafter="model", num_draft_tokens=3)
    alone = [tiny_pair.generate_ids(tiny_pair.encode_prompt(p), cfg)[0] for p in PROMPTS * 2]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: pair.generate_ids(pair.encode_prompt(p), cfg)[0],
                             PROMPTS * 2))
    assert outs == alone


def test_evicted_logits_values_are_rebound(tiny_pair_dir: Path, tiny_pair: Pair,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache keeps the logits values of its last KEPT_LOGITS shapes; a shape evicted and made
    again gets a new value, and the run must write into that one (the binding is redone)."""
    from specedge.runtime import kvcache

    monkeypatch.setattr(kvcache, "KEPT_LOGITS", 1)
    model = _with(tiny_pair_dir, device_argmax=True).target
    plain = tiny_pair.target
    a, b = model.new_cache(1, 64), plain.new_cache(1, 64)
    prompt = np.arange(6, dtype=np.int64)[None]
    model.forward(a, prompt)
    plain.forward(b, prompt)
    for width in (1, 3, 1, 3, 2, 1):
        tokens = np.full((1, width), 7 + width, np.int64)
        assert np.array_equal(model.forward(a, tokens), plain.forward(b, tokens))
        assert len(a._device_logits) == 1
