"""A draft whose vocabulary is padded to fewer ids than its target's (Qwen2.5-0.5B's 151,936
beside Qwen2.5-7B's 152,064, one tokenizer): it exports, and speculation stays exact.

Tiny seeded models: a 512-id target and a 384-id draft sharing one 320-token tokenizer. The
random target emits ids past the draft's table often, so the path that feeds them to the draft
runs in every generation below. Before the change, the export refused the pair ("the models
cannot form a pair").
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from specedge.runtime.errors import SpecEdgeError
from specedge.runtime.pair import GenerationConfig, Pair
from tests.draft_exactness import (
    greedy_equals_target_only,
    sampling_keeps_the_target_distribution,
    seeded_equals_target_only,
)

pytestmark = [
    pytest.mark.export,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs [export]"),
]

TARGET_VOCAB, DRAFT_VOCAB = 512, 384
PROMPTS = ["The quick brown fox", "def add(a, b):", "Edge devices", "héllo 🙂"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from specedge.exporter.tiny import make_tiny_model

    work = tmp_path_factory.mktemp("padded")
    target = make_tiny_model("llama", work / "target", seed=3, sizes={"vocab_size": TARGET_VOCAB})
    draft = make_tiny_model("llama", work / "draft", seed=5, num_layers=1,
                            sizes={"vocab_size": DRAFT_VOCAB})
    return target, draft


def _export(target: Path, out: Path, **kw: object):  # noqa: ANN202
    from specedge.exporter.pair import ExportOptions, export_pair

    return export_pair(ExportOptions(target=str(target), output=out, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def padded(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    target, draft = models
    return _export(target, tmp_path_factory.mktemp("pairs") / "gqa", draft=str(draft)).folder


@pytest.fixture(scope="module")
def padded_concat(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    target, draft = models
    return _export(target, tmp_path_factory.mktemp("pairs") / "concat", draft=str(draft),
                   graph="concat").folder


def _greedy_equal(pair: Pair, k: int) -> int:
    """Greedy speculative == target-only on every prompt; how many target tokens lay past the
    draft's table."""
    runs = greedy_equals_target_only(pair, PROMPTS, k)
    assert all(st.proposed > 0 for _, st in runs)
    return sum(t >= DRAFT_VOCAB for base, _ in runs for t in base)


def test_padded_draft_exports_with_its_logits_mapped(padded: Path) -> None:
    pair = Pair.load(padded)
    draft = pair.manifest.draft
    assert draft is not None and pair.manifest.vocab_size == TARGET_VOCAB
    assert (draft.vocab_size, draft.input_vocab_size) == (TARGET_VOCAB, DRAFT_VOCAB)
    assert pair.manifest.target.input_vocab_size is None
    assert draft.validation["passed"] and pair.manifest.target.validation["passed"]
    assert pair.draft is not None and pair.draft.vocab_ids is not None
    assert np.array_equal(pair.draft.vocab_ids, np.arange(DRAFT_VOCAB))


def test_ids_past_the_drafts_table_are_fed_as_zero(padded: Path) -> None:
    draft = Pair.load(padded).draft
    assert draft is not None
    runs = []
    for token in (DRAFT_VOCAB + 7, 0):
        cache = draft.new_cache(1, 8)
        runs.append(draft.forward(cache, np.asarray([[5, token, 9]], np.int64)))
    assert runs[0].shape[-1] == DRAFT_VOCAB
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_is_exact(padded: Path, k: int) -> None:
    assert _greedy_equal(Pair.load(padded), k) > 0, "no target token lay past the draft's table"


def test_seeded_sampling_equals_target_only(padded: Path) -> None:
    seeded_equals_target_only(Pair.load(padded), PROMPTS[:2])


def test_sampling_keeps_the_target_distribution(padded: Path) -> None:
    sampling_keeps_the_target_distribution(Pair.load(padded),
                                           np.arange(DRAFT_VOCAB, TARGET_VOCAB))


def test_batched_rows_equal_their_batch1_runs(padded_concat: Path) -> None:
    pair = Pair.load(padded_concat)
    cfg = GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=3,
                           adaptive=False)
    batched = pair.generate_batch(PROMPTS, cfg)
    past = 0
    for prompt, row in zip(PROMPTS, batched.results, strict=True):
        alone = pair.generate(prompt, GenerationConfig(max_new_tokens=24, drafter="none"))
        assert row.tokens == alone.tokens, prompt
        past += sum(t >= DRAFT_VOCAB for t in alone.tokens)
    assert past > 0


def test_quantizing_the_draft_keeps_its_id_map(padded: Path, tmp_path: Path) -> None:
    from specedge.calibration.quantize import QuantizeOptions, quantize

    out = quantize(QuantizeOptions(pair=padded, output=tmp_path / "q", method="int8-rtn",
                                   model="draft"), say=lambda _msg: None)
    pair = Pair.load(out)
    assert pair.manifest.draft is not None and pair.manifest.draft.vocab_ids is not None
    _greedy_equal(pair, 3)


def test_a_draft_larger_than_its_target_is_refused(models: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    target, draft = models
    with pytest.raises(SpecEdgeError, match="larger than the target's"):
        _export(draft, tmp_path / "out", draft=str(target))
    assert not (tmp_path / "out").exists()


def test_padded_draft_vocab_rules() -> None:
    from specedge.exporter.sources import padded_draft_vocab

    assert padded_draft_vocab(152064, 152064, 151665) is None
    assert padded_draft_vocab(152064, 151936, 151665) == 151936
    with pytest.raises(SpecEdgeError, match="larger than the target's"):
        padded_draft_vocab(151936, 152064, 151665)
    with pytest.raises(SpecEdgeError, match="do not share one vocabulary"):
        padded_draft_vocab(512, 300, 320)


def test_manifest_refuses_a_padded_target(padded: Path, tmp_path: Path) -> None:
    from specedge.runtime.manifest import MANIFEST_NAME, parse_manifest

    doc = json.loads((padded / MANIFEST_NAME).read_text())
    assert parse_manifest(padded, doc).draft is not None
    for where, value, match in (("target", 300, "only a draft"),
                                ("draft", TARGET_VOCAB + 1, "input_vocab_size")):
        bad = json.loads(json.dumps(doc))
        bad["models"][where]["input_vocab_size"] = value
        with pytest.raises(SpecEdgeError, match=match):
            parse_manifest(padded, bad)
