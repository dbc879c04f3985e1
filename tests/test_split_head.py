"""The split output head (`runtime/shortlist.py`, `exporter/split_head.py`): greedy argmaxes from
the int8 shortlist equal the exact argmax; logits from the head alone equal the whole graph's
bit for bit; generation with it equals generation without it, token for token, target-only and
speculative; the load-time check and its fallback; the manifest entry."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from specedge.runtime.errors import ManifestError
from specedge.runtime.manifest import load_manifest
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.shortlist import SplitHead

PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "1, 2, 3, 4,",
           "Hello there, how", "In the beginning"]


@pytest.fixture(scope="module")
def split_dir(fixtures_dir: Path) -> Path:
    folder = fixtures_dir / "tiny-llama-split"
    if not (folder / "specedge.json").is_file():
        pytest.fail(f"{folder} is missing: run scripts/make_fixtures.py again")
    return folder


@pytest.fixture(scope="module")
def split_pair(split_dir: Path) -> Pair:
    return Pair.load(split_dir)


@pytest.fixture(scope="module")
def whole_pair(split_dir: Path) -> Pair:
    return Pair.load(split_dir, split_head=False)


def head_matrix(head: SplitHead, size: int) -> np.ndarray:
    """The head's weight `[hidden, vocab]`, exactly: the head MatMul of the identity."""
    return head.logits(np.eye(size, dtype=np.float32)[None])[0].astype(np.float64)


def test_split_is_used_only_where_it_applies(split_pair: Pair, whole_pair: Pair) -> None:
    assert split_pair.target.split is not None
    assert whole_pair.target.split is None
    assert split_pair.draft is not None and split_pair.draft.split is None  # int4: not split
    assert split_pair.target.split.check() < 1.0


def test_argmax_is_the_exact_argmax(split_pair: Pair) -> None:
    head = split_pair.target.split
    assert head is not None
    size = head.spec.hidden_size
    weight = head_matrix(head, size)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((400, size)) * rng.choice([0.01, 1.0, 30.0], (400, 1))
    hidden[::7, rng.choice(size, 2)] *= 50.0  # outlier channels
    hidden = hidden.astype(np.float32)
    ids = head.argmax(hidden)
    want = (hidden.astype(np.float64) @ weight).argmax(-1)
    np.testing.assert_array_equal(ids, want)


def test_ties_go_to_the_lowest_id(split_pair: Pair) -> None:
    head = split_pair.target.split
    assert head is not None
    hidden = np.zeros((1, head.spec.hidden_size), np.float32)  # every logit is 0
    assert head.argmax(hidden).tolist() == [0]


def test_non_finite_hidden_states_give_no_id(split_pair: Pair) -> None:
    head = split_pair.target.split
    assert head is not None
    hidden = np.ones((3, head.spec.hidden_size), np.float32)
    hidden[0, 5] = np.nan
    hidden[2, 0] = np.inf
    ids = head.argmax(hidden)
    assert ids[0] == -1 and ids[2] == -1 and ids[1] >= 0


def test_logits_equal_the_whole_graph_bit_for_bit(split_pair: Pair, whole_pair: Pair) -> None:
    ids = np.array([split_pair.encode_prompt(PROMPTS[0])], np.int64)
    split_cache = split_pair.target.new_cache(1, 64)
    whole_cache = whole_pair.target.new_cache(1, 64)
    np.testing.assert_array_equal(split_pair.target.forward(split_cache, ids),
                                  whole_pair.target.forward(whole_cache, ids))
    step = np.array([[7]], np.int64)
    np.testing.assert_array_equal(split_pair.target.forward(split_cache, step),
                                  whole_pair.target.forward(whole_cache, step))


@pytest.mark.parametrize("width", [1, 3, 6, 9])
def test_block_argmaxes_equal_the_whole_graph(split_pair: Pair, whole_pair: Pair,
                                              width: int) -> None:
    """Blocks up to `max_rows` take the shortlist, wider ones the float head's logits."""
    split, whole = split_pair.target, whole_pair.target
    assert split.split is not None and split.split.max_rows < 9
    ids = np.array([split_pair.encode_prompt(PROMPTS[2])], np.int64)
    split_cache, whole_cache = split.new_cache(1, 64), whole.new_cache(1, 64)
    split.forward_argmax(split_cache, ids, last=True)
    whole.forward_argmax(whole_cache, ids, last=True)
    block = np.arange(10, 10 + width, dtype=np.int64)[None]
    np.testing.assert_array_equal(split.forward_argmax(split_cache, block),
                                  whole.forward_argmax(whole_cache, block))


@pytest.mark.parametrize("drafter", ["none", "model", "ngram"])
def test_greedy_generation_equals_the_whole_graph(split_pair: Pair, whole_pair: Pair,
                                                  drafter: str) -> None:
    config = GenerationConfig(max_new_tokens=40, drafter=drafter)
    target_only = GenerationConfig(max_new_tokens=40, drafter="none")
    accepted = 0
    for prompt in PROMPTS:
        ids = split_pair.encode_prompt(prompt)
        want = whole_pair.generate_ids(ids, target_only)[0]
        got, _, st = split_pair.generate_ids(ids, config)
        assert got == want, prompt
        accepted += st.accepted
    # blocks of accepted drafts went through the shortlist (its several-position path)
    assert (accepted > 0) == (drafter != "none")


def test_sampling_equals_the_whole_graph(split_pair: Pair, whole_pair: Pair) -> None:
    config = GenerationConfig(max_new_tokens=24, drafter="model",
                              sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=3))
    proposed = 0
    for prompt in PROMPTS[:3]:
        ids = split_pair.encode_prompt(prompt)
        got, _, st = split_pair.generate_ids(ids, config)
        assert got == whole_pair.generate_ids(ids, config)[0]
        proposed += st.proposed
    assert proposed > 0


def test_a_failed_check_runs_the_whole_graph(split_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(SplitHead, "check", lambda self, seed=0: 2.5)
    with caplog.at_level(logging.WARNING):
        pair = Pair.load(split_dir, load_draft=False)
    assert pair.target.split is None
    assert "does not hold" in caplog.text
    ids = pair.encode_prompt(PROMPTS[1])
    assert len(pair.generate_ids(ids, GenerationConfig(max_new_tokens=8, drafter="none"))[0]) == 8


def test_manifest_names_listed_files(split_dir: Path, tmp_path: Path) -> None:
    manifest = load_manifest(split_dir)
    head = manifest.target.head
    assert head is not None and head.hidden_size == 64
    for rel in (head.body, head.logits, head.shortlist):
        assert rel in manifest.target.files
    copy = tmp_path / "pair"
    shutil.copytree(split_dir, copy)
    doc = json.loads((copy / "specedge.json").read_text())
    doc["models"]["target"]["head"]["shortlist"] = "target/elsewhere.onnx"
    (copy / "specedge.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="elsewhere.onnx"):
        load_manifest(copy)
    doc["models"]["target"]["head"]["shortlist"] = "../outside.onnx"
    (copy / "specedge.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError):
        load_manifest(copy)


def test_reference_pair_greedy_equals_the_whole_graph(reference_pair_dir: Path) -> None:
    split = Pair.load(reference_pair_dir, load_draft=False)
    if split.target.split is None:
        pytest.skip("the reference pair was exported without a split head")
    whole = Pair.load(reference_pair_dir, load_draft=False, split_head=False)
    config = GenerationConfig(max_new_tokens=48, drafter="none")
    for prompt in ["Write a haiku about the ocean.", "List three prime numbers.",
                   "Explain what a CPU cache is."]:
        ids = split.encode_prompt(prompt, chat=True)
        assert split.generate_ids(ids, config)[0] == whole.generate_ids(ids, config)[0]


def test_cli_head_option(split_dir: Path) -> None:
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.cli_base import LoadOptions

    assert LoadOptions().load(split_dir).target.split is not None
    assert LoadOptions(head="whole").load(split_dir).target.split is None
    outs = {}
    for head in ("split", "whole"):
        result = CliRunner().invoke(main, ["generate", str(split_dir), PROMPTS[0], "--head", head,
                                           "--max-new-tokens", "12", "--json"])
        assert result.exit_code == 0, result.output
        outs[head] = json.loads(result.stdout)["tokens"]
    assert outs["split"] == outs["whole"] and len(outs["split"]) == 12
    bad = CliRunner().invoke(main, ["generate", str(split_dir), "hi", "--head", "half"])
    assert bad.exit_code == 2


needs_onnx = pytest.mark.skipif(importlib.util.find_spec("onnx") is None,
                                reason="splitting needs the onnx package ([export])")


@needs_onnx
@pytest.mark.export
def test_split_head_command_and_force(fixtures_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter.split_head import split_pair_heads
    from specedge.runtime.files import copy_pair

    pair = tmp_path / "pair"
    copy_pair(fixtures_dir / "tiny-llama", pair)
    result = CliRunner().invoke(main, ["split-head", str(pair)])
    assert result.exit_code == 0, result.output
    assert "target: head kept in the graph" in result.output  # 80 KB: too small to gain
    assert load_manifest(pair).target.head is None
    assert split_pair_heads(pair, min_bytes=0) == {"target": True, "draft": False}
    data = pair / "target" / "shortlist.onnx.data"
    size = data.stat().st_size
    # Again with force: the files are written afresh (onnx appends to an existing data file).
    assert split_pair_heads(pair, force=True, min_bytes=0)["target"]
    assert data.stat().st_size == size
    manifest = load_manifest(pair)  # every listed hash verifies
    assert manifest.target.head is not None
    assert Pair.load(pair).target.split is not None
    missing = CliRunner().invoke(main, ["split-head", str(tmp_path / "nowhere")])
    assert missing.exit_code != 0 and "Traceback" not in missing.output


@needs_onnx
@pytest.mark.export
def test_quantizing_a_split_target_drops_its_head(split_dir: Path, tmp_path: Path) -> None:
    from specedge.calibration.data import CalibrationOptions
    from specedge.calibration.quantize import QuantizeOptions, quantize

    out = quantize(QuantizeOptions(pair=split_dir, output=tmp_path / "q", method="int8-rtn",
                                   calibration=CalibrationOptions(samples=2)),
                   say=lambda _m: None)
    manifest = load_manifest(out)
    assert manifest.target.head is None  # the split head was the fp32 one's
    assert not (out / "target" / "shortlist.onnx").exists()
    pair = Pair.load(out)
    assert pair.target.split is None
    assert len(pair.generate_ids(pair.encode_prompt("Once"),
                                 GenerationConfig(max_new_tokens=4))[0]) == 4


@needs_onnx
@pytest.mark.export
def test_fp16_heads_stay_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp16 model's logits round to float16 and tie where the exact argmax does not (the fp16
    SmolLM2 GPU recipe on the CPU: two tokens at 17.42, and the split head decoded other text
    than the whole graph), so export keeps fp16 heads whole and the runtime ignores the head
    entry an older export wrote."""
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter import split_head as split_module
    from specedge.exporter.tiny import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf", seed=4)
    pair = tmp_path / "pair"
    result = CliRunner().invoke(main, ["export", str(hf), "-o", str(pair), "--provider", "cuda",
                                       "--precision", "fp16", "--draft-precision", "fp16",
                                       "--no-validate"])
    assert result.exit_code == 0, result.output
    assert split_module.split_pair_heads(pair, min_bytes=0) == {"target": False, "draft": False}
    assert load_manifest(pair).target.head is None
    # What an older export wrote: an fp16 head split off.
    monkeypatch.setattr(split_module, "SPLIT_TYPES", (1, 10))
    assert split_module.split_pair_heads(pair, min_bytes=0)["target"]
    assert load_manifest(pair).target.head is not None
    loaded = Pair.load(pair)
    assert loaded.target.split is None and loaded.target.spec.logits_dtype == "float16"
