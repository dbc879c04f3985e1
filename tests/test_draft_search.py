"""`specedge draft` end to end on a tiny seeded target: every candidate is built and scored,
the winner's drafter and K become the pair's defaults, and the result decodes exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.export,
    pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="needs [export]"),
]


def test_draft_search_builds_scores_and_keeps_the_winner(tmp_path: Path) -> None:
    from specedge.calibration.draft_search import DraftSearchOptions, search
    from specedge.exporter.tiny import make_tiny_model
    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.pair import GenerationConfig, Pair

    hf = make_tiny_model("llama", tmp_path / "hf", seed=3)
    opts = DraftSearchOptions(target=str(hf), output=tmp_path / "pair", vocab_sizes=(96,),
                              eval_prompts=("The quick brown", "def add(a, b):"), ks=(1, 2),
                              max_new_tokens=12, self_drafts=("int8-rtn", "int4-hqq"))
    table = search(opts, say=lambda _msg: None)
    names = [c["name"] for c in table["candidates"]]
    for expected in ("int4 self-draft", "int8 weight-only self-draft", "int4 HQQ self-draft",
                     "int4 self-draft, 96-token head",
                     "int8 weight-only self-draft, 96-token head", "n-gram prompt lookup"):
        assert expected in names
    assert any(n.startswith("hybrid n-gram + ") for n in names)
    for cand in table["candidates"]:
        assert set(cand["rows"]) == {"1", "2"}
        assert all(r["tokens_per_s"] > 0 for r in cand["rows"].values())
    built = {c["name"]: c for c in table["candidates"]}
    assert built["int8 weight-only self-draft"]["build_peak_rss_mib"] > 0  # child process
    manifest = load_manifest(tmp_path / "pair")
    winner = table["winner"]
    assert (manifest.defaults.drafter, manifest.defaults.num_draft_tokens) == (
        winner["drafter"], winner["k"])
    assert manifest.provenance["draft_search"]["winner"] == winner
    pair = Pair.load(tmp_path / "pair")
    for prompt in opts.eval_prompts:
        ids = pair.encode_prompt(prompt)
        spec, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=16))
        plain, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=16,
                                                              drafter="none"))
        assert spec == plain
    with pytest.raises(Exception, match="--self-drafts"):
        DraftSearchOptions(target=str(hf), output=tmp_path / "x", eval_prompts=("a",),
                           self_drafts=("int3",))


def test_separate_drafts_compete_one_with_its_own_tokenizer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`specedge draft --draft SRC`: a smaller model of the target's tokenizer and one of
    another tokenizer (bridged) are exported beside the target (exported once), scored beside
    the self-draft, and hybrid over each; whichever wins, the kept pair decodes exactly."""
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter.tiny import make_tiny_model
    from specedge.runtime.pair import GenerationConfig, Pair
    from tests.test_target_reuse import _count_exports
    from tests.test_vocab_bridge import _other_tokenizer

    target = make_tiny_model("llama", tmp_path / "target", seed=3)
    small = make_tiny_model("llama", tmp_path / "small", seed=4, num_layers=1)
    other = make_tiny_model("llama", tmp_path / "other", seed=5, num_layers=1,
                            sizes={"vocab_size": 384})
    _other_tokenizer(other)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown\ndef add(a, b):\n")
    built = _count_exports(monkeypatch)
    result = CliRunner().invoke(main, [
        "draft", str(target), "-o", str(tmp_path / "pair"), "--prompts", str(prompts),
        "--vocab-sizes", "", "--self-drafts", "", "--ks", "1,2", "--max-new-tokens", "12",
        "--draft", str(small), "--draft", str(other), "--draft-precision", "int8-rtn"])
    assert result.exit_code == 0, result.output
    assert built.count("target") == 1  # each draft's pair copies the base pair's target
    pair = Pair.load(tmp_path / "pair")
    names = [c["name"] for c in pair.manifest.provenance["draft_search"]["candidates"]]
    assert "small (int8-rtn)" in names
    bridged = next(n for n in names if n.startswith("other (int8-rtn), own tokenizer ("))
    assert f"hybrid n-gram + {bridged}" in names and "hybrid n-gram + small (int8-rtn)" in names
    assert "kept: " in result.output
    if pair.manifest.provenance["draft_search"]["winner"]["speedup"] < 1.0:
        assert "no candidate was faster than target-only here" in result.output
    for prompt in ("The quick brown", "def add(a, b):"):
        ids = pair.encode_prompt(prompt)
        spec, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=16))
        plain, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=16,
                                                              drafter="none"))
        assert spec == plain


def test_separate_draft_options_are_checked(tmp_path: Path) -> None:
    from specedge.calibration.draft_search import DraftSearchOptions
    from specedge.runtime.errors import InputError

    with pytest.raises(InputError, match="--draft-precision 'fp16'"):
        DraftSearchOptions(target="t", output=tmp_path / "x", eval_prompts=("a",),
                           drafts=("d",), drafts_precision="fp16")
    with pytest.raises(InputError, match="name each draft model once"):
        DraftSearchOptions(target="t", output=tmp_path / "x", eval_prompts=("a",),
                           drafts=("d", "d"))


def test_a_missing_draft_fails_before_anything_is_built(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from specedge.calibration import draft_search
    from specedge.cli import main
    from specedge.exporter.tiny import make_tiny_model

    def no_build(*_args: object, **_kw: object) -> None:
        raise AssertionError("an export started before the drafts were checked")

    monkeypatch.setattr(draft_search, "export_pair", no_build)

    target = make_tiny_model("llama", tmp_path / "target", seed=3)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown\n")
    result = CliRunner().invoke(main, ["draft", str(target), "-o", str(tmp_path / "pair"),
                                       "--prompts", str(prompts), "--draft", "no/such/dir"])
    assert result.exit_code != 0
    assert "no/such/dir: no such file or folder" in result.output
    assert "exporting" not in result.output and "Traceback" not in result.output
    assert not (tmp_path / "pair").exists()
    assert not list(tmp_path.glob(".specedge-draft-*"))
