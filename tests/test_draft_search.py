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
