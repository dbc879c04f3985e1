"""Two-row steps: speculation on a target whose one-row calls compute differently.

A target must compute a position the same way in a decode step (one row) and inside a
verification block (K+1 rows), or greedy speculation is not its target-only decoding. An int4
SmolLM2-135M (MatMulNBits, accuracy level 4: int8 activations) is not: a one-row step's logits are
~0.6 apart from the same position in a block, because the attention's one-row path rounds
differently and int8 activation quantization amplifies any rounding difference. Calls of two or
more rows agree bit for bit. With `two_row_steps` a one-token step re-feeds the previous token
beside it, so every call runs the several-row kernels.

The tiny fixtures show the mechanism bit for bit (their one-row difference is fp32 rounding,
~1e-6, still not zero); the reference pair's int4 draft, loaded as a target, shows the bug it
fixes (speculation diverges without it) and that the probe turns it on.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specedge.runtime import kv_room, rowprobe
from specedge.runtime.backend import OrtModel
from specedge.runtime.pair import GenerationConfig, Pair, ThreadPlan, plan_threads
from specedge.runtime.rowprobe import RowProbe
from specedge.runtime.sampling import SamplingParams

IDS = [5, 17, 42, 99, 3, 250, 77, 8, 140, 61, 23]
BLOCK = 4


def _with(pair_dir: Path, **options: object) -> Pair:
    plan = plan_threads()
    return Pair.load(pair_dir, load_draft=False, two_row_steps=True,
                     plan=ThreadPlan(replace(plan.target, **options),  # type: ignore[arg-type]
                                     plan.draft))


def _block_and_steps(model: OrtModel) -> tuple[np.ndarray, np.ndarray]:
    """The last BLOCK positions' logits fed as one block, and fed one token at a time."""
    head, tail = np.asarray([IDS[:-BLOCK]]), np.asarray([IDS[-BLOCK:]])
    a = model.new_cache(1, 32)
    model.forward(a, head)
    block = model.forward(a, tail)[0]
    b = model.new_cache(1, 32)
    model.forward(b, head)
    steps = np.concatenate([model.forward(b, tail[:, i:i + 1])[0] for i in range(BLOCK)])
    assert a.lengths[0] == b.lengths[0] == len(IDS)
    assert (b.fed[0, :len(IDS)] == IDS).all()
    return block, steps


def test_probe_rules() -> None:
    int4 = RowProbe(single=0.63, block=0.0, scale=27.5)
    assert int4.needs_two_rows and int4.blocks_agree and "two rows" in int4.describe()
    fp32 = RowProbe(single=3.6e-5, block=0.0, scale=31.3)
    assert not fp32.needs_two_rows and fp32.blocks_agree and "batch-invariant" in fp32.describe()
    dynamic = RowProbe(single=0.064, block=0.060, scale=2.1)  # per-tensor activation scales
    assert not dynamic.needs_two_rows and not dynamic.blocks_agree
    assert "not batch-invariant" in dynamic.describe()


def test_probe_verdict_over_several_pasts() -> None:
    short = RowProbe(single=0.0, block=0.0, scale=30.3)  # H200, fp16, past 4 and 32
    long = RowProbe(single=0.047, block=0.0, scale=22.2)  # past 128 (docs/results/gpu_diag.md)
    assert not short.needs_two_rows
    worst = RowProbe.worst([short, long])
    assert worst == RowProbe(single=0.047, block=0.0, scale=22.2) and worst.needs_two_rows
    assert not RowProbe.worst([long, RowProbe(0.0, 0.5, 20.0)]).blocks_agree


def test_probe_looks_after_a_long_past(fixtures_dir: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The regression test for the H200's finding: one-token steps that differ from blocks only
    after a long past (CUDA's attention splits its keys by the past's length) must still turn
    two-row steps on; the probe looked after 4 tokens only, and said batch-invariant. (Shown
    on the CPU with the GPU's pasts and a kernel switch made up at 64.)"""
    assert max(rowprobe.ROW_PROBE_PASTS["cuda"]) >= 64
    monkeypatch.setitem(rowprobe.ROW_PROBE_PASTS, "cpu", rowprobe.ROW_PROBE_PASTS["cuda"])
    pair = Pair.load(fixtures_dir / "tiny-llama", load_draft=False)
    model = pair.target
    assert model.spec.max_seq_len > 128 and not model.row_probe.needs_two_rows
    inner = model.forward

    def long_past_differs(cache, tokens):  # noqa: ANN001, ANN202 - a kernel switch at 64
        past = int(cache.lengths[0])
        logits = inner(cache, tokens)
        return logits + 0.5 if tokens.shape[1] == 1 and past >= 64 else logits

    model.forward = long_past_differs  # type: ignore[method-assign]
    probe = rowprobe.probe_rows(model)
    assert probe is not None and probe.needs_two_rows and probe.blocks_agree


@pytest.mark.parametrize("fixture,options,one_row_differs", [
    ("tiny-llama", {}, True),
    ("tiny-llama", {"fixed_buffers": True}, True),
    ("tiny-llama", {"device_argmax": True}, True),
    ("tiny-llama-std", {}, True),
    # The rewritten concat form's one-row calls take the blocks' kernels on this CPU.
    ("tiny-llama-concat", {}, False),
])
def test_two_row_steps_equal_block_logits_bit_for_bit(fixtures_dir: Path, fixture: str,
                                                      options: dict[str, object],
                                                      one_row_differs: bool) -> None:
    pair = _with(fixtures_dir / fixture, **options)
    block, steps = _block_and_steps(pair.target)
    assert np.array_equal(block, steps)
    pair.target.two_row_steps = False  # one-row calls: fp32 rounding apart, or equal
    block1, steps1 = _block_and_steps(pair.target)
    assert np.array_equal(block1, block)
    assert np.array_equal(steps1, steps) != one_row_differs
    assert np.abs(steps1 - steps).max() < 1e-4


def test_two_row_argmax_step_takes_the_callers_position(fixtures_dir: Path) -> None:
    pair = _with(fixtures_dir / "tiny-llama", device_argmax=True)
    t = pair.target
    cache = t.new_cache(1, 32)
    t.forward(cache, np.asarray([IDS[:-1]]))
    ids = t.forward_argmax(cache, np.asarray([IDS[-1:]]))
    other = t.new_cache(1, 32)
    want = t.forward(other, np.asarray([IDS]))[0, -1:].argmax(-1)
    assert ids.shape == (1, 1) and (ids[0] == want).all()


def test_two_row_ragged_steps_equal_block_logits(fixtures_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched (ragged) path: a single row's one-token step runs as two rows too."""
    pair = _with(fixtures_dir / "tiny-llama-concat")
    t = pair.target
    rows = np.asarray([1])

    def run(split: list[int]) -> np.ndarray:
        cache = t.new_cache(2, 32)
        t.forward_rows(cache, rows, np.asarray([IDS[:-BLOCK]]), np.asarray([len(IDS) - BLOCK]))
        out, at = [], len(IDS) - BLOCK
        for n in split:
            out.append(t.forward_rows(cache, rows, np.asarray([IDS[at:at + n]]),
                                      np.asarray([n]))[0])
            at += n
        assert cache.lengths[1] == len(IDS) and cache.lengths[0] == 0
        return np.concatenate(out)

    block = run([BLOCK])
    assert np.array_equal(run([1] * BLOCK), block)
    # Two rows of different lengths, one token each: both widen (the attention of each row
    # then never takes its one-new-token path either).
    other = [9, 8, 7, 6, 5, 4, 3]
    both = np.asarray([0, 1])

    def blocks_and_steps() -> tuple[np.ndarray, np.ndarray]:
        blocks, steps = t.new_cache(2, 32), t.new_cache(2, 32)
        head = np.asarray([other[:-BLOCK] + [0] * (len(IDS) - len(other)), IDS[:-BLOCK]])
        for cache in (blocks, steps):
            t.forward_rows(cache, both, head, np.asarray([len(other) - BLOCK,
                                                          len(IDS) - BLOCK]))
        whole = t.forward_rows(blocks, both, np.asarray([other[-BLOCK:], IDS[-BLOCK:]]),
                               np.asarray([BLOCK, BLOCK]))
        one = np.concatenate([t.forward_rows(steps, both, np.asarray([[other[i - BLOCK]],
                                                                       [IDS[i - BLOCK]]]),
                                             np.asarray([1, 1])) for i in range(BLOCK)], axis=1)
        assert (steps.lengths == [len(other), len(IDS)]).all()
        return whole, one

    # This fp32 model pads the rows' pasts to its cache's room (`runtime/kv_room`): every row
    # has holes, which move from call to call and change the softmax's reduction length.
    whole, one = blocks_and_steps()
    assert np.abs(one - whole).max() < 1e-4 and np.abs(whole[1] - block).max() < 1e-4
    # Where the calls gather the rows' pasts instead (a model that is not fp32) the longest row
    # has no holes and matches bit for bit; the shorter one: rounding only.
    monkeypatch.setattr(kv_room, "pads", lambda spec: False)
    whole, one = blocks_and_steps()
    assert np.array_equal(one[1], whole[1]) and np.abs(one[0] - whole[0]).max() < 1e-4
    assert np.array_equal(whole[1], block)
    cache = t.new_cache(2, 32)
    t.forward_rows(cache, rows, np.asarray([IDS[:-1]]), np.asarray([len(IDS) - 1]))
    ids, kept = t.forward_rows_greedy(cache, rows, np.asarray([IDS[-1:]]), np.asarray([1]),
                                      np.asarray([True]))
    assert ids.shape == (1, 1) and ids[0, 0] == block[-1].argmax() and kept.shape[0] == 0


def test_tiny_speculation_with_two_row_steps_equals_target_only(tiny_pair_dir: Path) -> None:
    pair = Pair.load(tiny_pair_dir, two_row_steps=True)
    for prompt in ("the quick brown fox", "a b c d e f g a b c"):
        ids = pair.encode_prompt(prompt)
        base, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=24, drafter="none"))
        for cfg in (GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=3,
                                     adaptive=False),
                    GenerationConfig(max_new_tokens=24, drafter="hybrid", num_draft_tokens=4)):
            got, _, st = pair.generate_ids(ids, cfg)
            assert got == base
            assert st.proposed > 0 and st.accepted > 0


# ---------------------------------------------------------------- a real int4 target


@pytest.fixture(scope="module")
def int4_target_dir(reference_pair_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Path:
    """The reference pair's int4 draft as the target of a draft-less pair (n-gram drafting)."""
    out = tmp_path_factory.mktemp("int4-target")
    manifest = json.loads((reference_pair_dir / "specedge.json").read_text())
    spec = manifest["models"]["draft"]
    for rel in [*spec["files"], *manifest["tokenizer"]["files"]]:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(reference_pair_dir / rel, out / rel)
    manifest["models"] = {"target": spec}
    manifest["defaults"]["drafter"] = "ngram"
    (out / "specedge.json").write_text(json.dumps(manifest, indent=2))
    return out


PROMPTS = ["Write a short story about a lighthouse keeper.",
           "List five uses of a paperclip, one per line.",
           "Explain how a bicycle's gears work.",
           "Translate 'good morning, how are you?' into French and Spanish.",
           "Write a Python function that reverses a linked list.",
           "Summarize the water cycle in three sentences."]
NGRAM = GenerationConfig(max_new_tokens=64, drafter="ngram", num_draft_tokens=3,
                         adaptive=False)


def _same_as_target_only(pair: Pair) -> int:
    same = 0
    for prompt in PROMPTS:
        ids = pair.encode_prompt(prompt, chat=True)
        base = pair.generate_ids(ids, GenerationConfig(max_new_tokens=64, drafter="none"))[0]
        same += pair.generate_ids(ids, NGRAM)[0] == base
    return same


@pytest.mark.reference
def test_int4_target_probe_turns_two_row_steps_on(int4_target_dir: Path) -> None:
    pair = Pair.load(int4_target_dir)
    probe = pair.target.row_probe
    assert probe is not None and probe.needs_two_rows and probe.single > 0.05
    assert probe.block == 0.0 and pair.target.two_row_steps


@pytest.mark.reference
def test_int4_target_speculation_equals_target_only(int4_target_dir: Path) -> None:
    """The regression test: token for token on every prompt (it failed on most of them
    before two-row steps; the next test keeps showing that the old way diverges)."""
    pair = Pair.load(int4_target_dir)
    assert _same_as_target_only(pair) == len(PROMPTS)
    block, steps = _block_and_steps(pair.target)
    assert np.array_equal(block, steps)
    ids = pair.encode_prompt(PROMPTS[0], chat=True)
    seeded = [pair.generate_ids(ids, GenerationConfig(
        max_new_tokens=48, drafter=d, sampling=SamplingParams(temperature=0.8, seed=7)))[0]
        for d in ("none", "ngram")]
    assert seeded[0] == seeded[1]  # seeded sampling is position-keyed: the same tokens


@pytest.mark.reference
def test_int4_target_one_row_steps_diverge(int4_target_dir: Path) -> None:
    pair = Pair.load(int4_target_dir, two_row_steps=False)
    assert pair.target.row_probe is None and not pair.target.two_row_steps
    block, steps = _block_and_steps(pair.target)
    assert np.abs(block - steps).max() > 0.05
    assert _same_as_target_only(pair) < len(PROMPTS)
