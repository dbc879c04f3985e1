"""A concat-form KV cache kept on the model's device (`runtime/device_kv.py`): the rows are
gathered and scattered there by two shipped graphs instead of numpy. On the CPU the same code
runs with host buffers (`SessionConfig.device_kv=True`), and every logit equals the numpy path's
bit for bit: ragged rows, subsets of rows, rollbacks, rows at the context limit, batch-1 and
batched generation, greedy and seeded sampling."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specedge.runtime import kv_room
from specedge.runtime.device_kv import DeviceKV
from specedge.runtime.pair import GenerationConfig, Pair, ThreadPlan, plan_threads
from specedge.runtime.sampling import SamplingParams

SHIPPED_PADS = kv_room.pads
PROMPTS = ["the quick brown fox", "a b c d e f g a b c", "once upon a time there was",
           "numbers 1 2 3 4 5 6 7 8", "hi"]


@pytest.fixture(autouse=True)
def same_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host path pads a batch's rows to its cache's room and binds them in place
    (`runtime/kv_room`); a device cache never pads. The two gathers are compared here at the
    same padding: the host path's rows padded to the longest, as the device's are."""
    monkeypatch.setattr(kv_room, "pads", lambda spec: False)


def test_a_device_cache_is_never_padded(on_device: Pair, on_host: Pair,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_room, "pads", SHIPPED_PADS)
    rows, lengths, ends = np.arange(2), np.array([100, 90]), np.array([104, 94])
    device, host = on_device.target.new_cache(2, 300), on_host.target.new_cache(2, 300)
    assert device.padded_past(rows, lengths, ends) == 100
    assert host.padded_past(rows, lengths, ends) == host.room == 128  # fp32 on the host: padded


@pytest.fixture(scope="module")
def on_device(concat_dir: Path) -> Pair:
    plan = plan_threads()
    return Pair.load(concat_dir, plan=ThreadPlan(replace(plan.target, device_kv=True),
                                                 replace(plan.draft, device_kv=True)))


@pytest.fixture(scope="module")
def on_host(concat_dir: Path) -> Pair:
    return Pair.load(concat_dir)


def test_the_switch(on_device: Pair, on_host: Pair) -> None:
    cache = on_device.target.new_cache(2, 16)
    assert isinstance(cache.device_kv, DeviceKV) and cache.host is None
    assert on_host.target.new_cache(2, 16).device_kv is None
    assert not on_host.target.config.kv_on_device  # the CPU default


def test_ragged_rows_equal_the_numpy_path_bit_for_bit(on_device: Pair, on_host: Pair) -> None:
    rng = np.random.default_rng(0)
    vocab = on_host.target.logits_size
    a, b = on_device.target.new_cache(4, 24), on_host.target.new_cache(4, 24)
    assert a.max_len == b.max_len == 24
    calls = [  # (rows, new tokens per row, block width)
        ([0, 1, 2, 3], [5, 2, 7, 1], 7),   # ragged prefills
        ([1, 3], [3, 1], 3),               # a subset of the rows
        ([0, 1, 2, 3], [1, 1, 1, 1], 1),   # a decode step
        ([2, 0], [4, 2], 4),               # rows out of order
    ]
    for rows, lens, width in calls:
        tokens = rng.integers(0, vocab, (len(rows), width))
        args = (np.array(rows), tokens, np.array(lens))
        assert np.array_equal(on_device.target.forward_rows(a, *args),
                              on_host.target.forward_rows(b, *args))
        assert np.array_equal(a.lengths, b.lengths)
    a.rollback(np.array([3, 2, 9, 1]))
    b.rollback(np.array([3, 2, 9, 1]))
    # Row 2 ends at the context limit (9 + 15 = 24) beside rows with a shorter block: their
    # padding goes to the bin slot, never past the cache.
    tokens = rng.integers(0, vocab, (4, 15))
    args = (np.arange(4), tokens, np.array([2, 15, 15, 3]))
    assert np.array_equal(on_device.target.forward_rows(a, *args),
                          on_host.target.forward_rows(b, *args))
    args = (np.array([0, 3]), tokens[:2, :2], np.array([2, 1]))
    assert np.array_equal(on_device.target.forward_rows(a, *args),
                          on_host.target.forward_rows(b, *args))


@pytest.mark.parametrize("cfg", [
    GenerationConfig(max_new_tokens=24, drafter="none"),
    GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=3),
    GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=4, adaptive=True),
    GenerationConfig(max_new_tokens=24, drafter="ngram", num_draft_tokens=3),
], ids=["target-only", "K=3", "adaptive", "ngram"])
def test_greedy_generation_is_unchanged(on_device: Pair, on_host: Pair,
                                        cfg: GenerationConfig) -> None:
    target_only = replace(cfg, drafter="none")
    alone = [on_host.generate_ids(on_host.encode_prompt(p), target_only)[0] for p in PROMPTS]
    runs = [on_device.generate_ids(on_device.encode_prompt(p), cfg) for p in PROMPTS]
    assert [ids for ids, _, _ in runs] == alone
    assert [on_host.generate_ids(on_host.encode_prompt(p), cfg)[0] for p in PROMPTS] == alone
    batch = on_device.generate_batch(PROMPTS, cfg)
    assert [r.tokens for r in batch.results] == alone
    if cfg.drafter != "none":  # it speculated: rows and catch-ups went through the device KV
        assert sum(st.proposed for _, _, st in runs) > 0 and batch.stats.proposed > 0
        assert sum(st.accepted for _, _, st in runs) > 0


def test_seeded_sampling_is_unchanged(on_device: Pair, on_host: Pair) -> None:
    cfg = GenerationConfig(max_new_tokens=20, drafter="model", num_draft_tokens=3,
                           sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=11))
    batch = on_device.generate_batch(PROMPTS, cfg)
    a = [r.tokens for r in batch.results]
    assert a == [r.tokens for r in on_host.generate_batch(PROMPTS, cfg).results]
    assert a == [r.tokens for r in on_host.generate_batch(
        PROMPTS, replace(cfg, drafter="none")).results]
    assert batch.stats.proposed > 0


@pytest.mark.export
def test_shipped_graphs_are_the_scripts(tmp_path: Path) -> None:
    """runtime/data/kv_*.onnx are what scripts/make_kv_rows_onnx.py writes (no drift)."""
    import importlib.util

    pytest.importorskip("onnx")

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_kv", root / "scripts/make_kv_rows_onnx.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    for made in sorted(tmp_path.glob("kv_*.onnx")):
        assert made.read_bytes() == (root / "runtime" / "data" / made.name).read_bytes(), made
    shipped = sorted(p.name for p in (root / "runtime" / "data").glob("kv_*.onnx"))
    assert sorted(p.name for p in tmp_path.glob("kv_*.onnx")) == shipped and len(shipped) == 8


def test_helper_graphs_run_on_cuda_under_tensorrt() -> None:
    """The greedy head and the KV graphs change shape every call: under TensorRT they run on the
    CUDA EP (TensorRT would build an engine per shape), never with CUDA graphs."""
    from specedge.runtime.sessions import SessionConfig, helper_config

    trt = helper_config(SessionConfig(provider="tensorrt", device_id=1))
    assert trt.provider == "cuda" and trt.device_id == 1 and trt.device == "cuda"
    cuda = helper_config(SessionConfig(provider="cuda", cuda_graph=True))
    assert cuda.provider == "cuda" and not cuda.cuda_graph and not cuda.fixed
    assert helper_config(SessionConfig()).provider == "cpu"


@pytest.mark.parametrize("options", [{}, {"fixed_buffers": True}])
def test_gqa_caches_start_as_zeros(fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                   options: dict[str, bool]) -> None:
    """The in-place (gqa-shared) KV buffers too, on a GPU: allocator leftovers (NaN here) must
    not survive into a cache. On the H200 random-weight fp16 pairs refused NaN logits in a
    process that had run another pair, and ran in a fresh one (docs/results/gpu_findings.md).
    The CPU's own kernel reads valid positions only, so the CPU is added here to run the fill."""
    import onnxruntime as ort

    from specedge.runtime import kvcache

    assert "cuda" in kvcache.ZERO_KV_DEVICES
    monkeypatch.setattr(kvcache, "ZERO_KV_DEVICES", frozenset({"cuda", "cpu"}))

    real = ort.OrtValue.ortvalue_from_shape_and_type

    def garbage(shape, dtype, device, device_id):  # noqa: ANN001, ANN202
        value = real(shape, dtype, device, device_id)
        junk = np.nan if np.issubdtype(dtype, np.floating) else -1  # the masks are int64
        value.update_inplace(np.full(shape, junk, dtype))
        return value

    plan = plan_threads()
    pair = Pair.load(fixtures_dir / "tiny-llama", load_draft=False, two_row_steps=False,
                     plan=ThreadPlan(replace(plan.target, **options), plan.draft))
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_shape_and_type", staticmethod(garbage))
    cache = pair.target.new_cache(1, 24)
    assert cache.values and all(not v.numpy().any() for v in cache.values)


def test_a_new_cache_is_zero_filled_on_the_device(on_device: Pair,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocator garbage (NaN here) must not survive: a masked position's value still meets a
    zero attention weight, and 0 x NaN is NaN. The zeros are written by a graph, with no host
    array as large as the cache."""
    import onnxruntime as ort

    real = ort.OrtValue.ortvalue_from_shape_and_type

    def garbage(shape, dtype, device, device_id):  # noqa: ANN001, ANN202
        value = real(shape, dtype, device, device_id)
        value.update_inplace(np.full(shape, np.nan, dtype))
        return value

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_shape_and_type", staticmethod(garbage))
    cache = on_device.target.new_cache(3, 20)
    assert cache.device_kv is not None
    values = cache.device_kv.cache.numpy()
    assert values.shape[1] == 21 and not values.any() and np.isfinite(values).all()
