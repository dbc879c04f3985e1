"""A draft with its own tokenizer (`exporter/vocab_bridge.py`): it exports, proposes target ids,
and speculation stays exact.

Tiny seeded models. The target has the tiny byte-level tokenizer (320 ids). Two drafts:

- `permuted`: the target itself with its tokens' ids shuffled (tokenizer and embedding and head
  rows alike). Bridged right, it is the target again, so greedy drafting is always accepted; a
  wrong input map or column order shows as rejections.
- `other`: another model with a tokenizer trained on other text, other special tokens and its
  own end of turn: the vocabularies overlap only in part.

Before the change, the export refused both ("different vocabularies").
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from specedge.runtime.errors import SpecEdgeError
from specedge.runtime.manifest import describe
from specedge.runtime.pair import GenerationConfig, Pair
from tests.draft_exactness import (
    greedy_equals_target_only,
    sampling_keeps_the_target_distribution,
    seeded_equals_target_only,
)

PROMPTS = ["The quick brown fox", "def add(a, b):", "Edge devices", "héllo 🙂"]
OTHER_TEXT = ["Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
              "The brown fox and the lazy dog are friends; quick thinking wins.",
              "for i in range(10):\n    print(i * i)\n", "ünïcödé text ✓ and digits 42"]
OTHER_SPECIALS = ["<s>", "</s>", "<eot>"]
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs [export]")


def _export(target: Path, out: Path, **kw: object):  # noqa: ANN202
    from specedge.exporter.pair import ExportOptions, export_pair

    return export_pair(ExportOptions(target=str(target), output=out, **kw))  # type: ignore[arg-type]


def _other_tokenizer(folder: Path) -> None:
    """Replace the tokenizer of `folder` by one trained on other text, with other specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=OTHER_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(OTHER_TEXT * 4, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token="<s>", eos_token="<eot>", pad_token="<s>", unk_token="<s>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = json.loads((folder / "config.json").read_text())
    model.update(bos_token_id=0, eos_token_id=1)
    (folder / "config.json").write_text(json.dumps(model))
    (folder / "generation_config.json").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from specedge.exporter.tiny import make_tiny_model, permute_vocab

    work = tmp_path_factory.mktemp("bridge")
    target = make_tiny_model("llama", work / "target", seed=3)
    permute_vocab(target, work / "permuted", seed=11)
    other = make_tiny_model("llama", work / "other", seed=5, num_layers=1,
                            sizes={"vocab_size": 384})
    _other_tokenizer(other)
    out = {"target": target, "other_hf": other}
    out["permuted"] = _export(target, work / "p-permuted", draft=str(work / "permuted")).folder
    out["other"] = _export(target, work / "p-other", draft=str(other)).folder
    out["other_concat"] = _export(target, work / "p-other-concat", draft=str(other),
                                  graph="concat").folder
    return out


def _greedy(pair: Pair, k: int) -> tuple[int, int]:
    """Greedy speculative == target-only on every prompt; (proposed, accepted) in all."""
    runs = greedy_equals_target_only(pair, PROMPTS, k)
    return sum(st.proposed for _, st in runs), sum(st.accepted for _, st in runs)


# ------------------------------------------------------------------ the bridge (pure, no torch)


def test_bridge_pairs_same_bytes_specials_by_text_and_the_end_of_turn() -> None:
    from specedge.exporter.vocab_bridge import Vocab, bridge

    target = Vocab(pieces=(b"<|im_end|>", b"a", b"b", b"ab", b"abc", b"<|x|>", b"b", None),
                   special=frozenset({0, 5}), rows=9, end=0, eos=(0,), bos=None)
    draft = Vocab(pieces=(b"b", b"a", b"</s>", b"abc", b"xyz", b"<|x|>", b"ab"),
                  special=frozenset({2, 5}), rows=6, end=2, eos=(2,), bos=None)
    found = bridge(target, draft)
    # draft 6 ("ab") lies past the draft's 6 rows: never a column, never fed
    assert found.vocab_ids.tolist() == [0, 1, 2, 4, 5]
    assert found.columns.tolist() == [2, 1, 0, 3, 5]
    #                            end  a  b  ab->a  abc  <|x|>  b (dup)  none  row 8
    assert found.input_map.tolist() == [2, 1, 0, 1, 3, 5, 0, 0, 0]
    assert found.target_tokens == 7 and found.exact_inputs == 6  # "ab" is read by its prefix


def test_bridge_of_one_vocabulary_is_the_identity() -> None:
    from specedge.exporter.vocab_bridge import Vocab, bridge

    pieces = tuple(bytes([i]) for i in range(50))
    vocab = Vocab(pieces=pieces, special=frozenset(), rows=50, end=3, eos=(3,))
    found = bridge(vocab, vocab)
    assert np.array_equal(found.columns, np.arange(50))
    assert np.array_equal(found.vocab_ids, np.arange(50))
    assert np.array_equal(found.input_map, np.arange(50)) and found.shared == 1.0


# ----------------------------------------------------------------------------- exported pairs


@needs_torch
@pytest.mark.export
def test_a_permuted_tokenizer_bridges_back_to_the_target(pairs: dict[str, Path]) -> None:
    pair = Pair.load(pairs["permuted"])
    draft = pair.manifest.draft
    assert draft is not None and draft.input_id_map and draft.vocab_ids
    assert draft.validation["passed"]
    proposed, accepted = _greedy(pair, 4)
    assert proposed > 0 and accepted == proposed  # the draft is the target, under other ids


@needs_torch
@pytest.mark.export
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_with_another_tokenizer_is_exact(pairs: dict[str, Path],
                                                            k: int) -> None:
    pair = Pair.load(pairs["other"])
    draft = pair.manifest.draft
    assert draft is not None and draft.validation["passed"]
    assert pair.draft is not None and pair.draft.vocab_ids is not None
    assert 0 < len(pair.draft.vocab_ids) < pair.manifest.vocab_size  # an overlap in part
    assert draft.input_vocab_size == 384
    summary = describe(pair.manifest)["draft"]["vocab_bridge"]  # what `specedge inspect` shows
    assert summary["proposes"] == len(pair.draft.vocab_ids) and summary["target_tokens"] == 320
    assert _greedy(pair, k)[0] > 0


@needs_torch
@pytest.mark.export
def test_the_drafts_end_of_turn_proposes_the_targets(pairs: dict[str, Path]) -> None:
    pair = Pair.load(pairs["other"])
    assert pair.draft is not None and pair.draft.vocab_ids is not None
    eos = pair.manifest.eos_token_ids
    assert set(eos) & set(pair.draft.vocab_ids.tolist())
    [end] = pair.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert pair.draft.input_id_map is not None and int(pair.draft.input_id_map[end]) == 2


@needs_torch
@pytest.mark.export
def test_seeded_sampling_with_another_tokenizer_equals_target_only(
        pairs: dict[str, Path]) -> None:
    seeded_equals_target_only(Pair.load(pairs["other"]), PROMPTS[:2])


@needs_torch
@pytest.mark.export
def test_sampling_with_another_tokenizer_keeps_the_target_distribution(
        pairs: dict[str, Path]) -> None:
    pair = Pair.load(pairs["other"])
    assert pair.draft is not None and pair.draft.vocab_ids is not None
    sampling_keeps_the_target_distribution(
        pair, np.setdiff1d(np.arange(pair.manifest.vocab_size), pair.draft.vocab_ids))


@needs_torch
@pytest.mark.export
def test_batched_rows_with_another_tokenizer_equal_their_batch1_runs(
        pairs: dict[str, Path]) -> None:
    pair = Pair.load(pairs["other_concat"])  # batched speculation takes the concat form
    cfg = GenerationConfig(max_new_tokens=24, drafter="model", num_draft_tokens=3,
                           adaptive=False)
    batched = pair.generate_batch(PROMPTS, cfg)
    assert batched.stats.proposed > 0
    for prompt, row in zip(PROMPTS, batched.results, strict=True):
        alone = pair.generate(prompt, GenerationConfig(max_new_tokens=24, drafter="none"))
        assert row.tokens == alone.tokens, prompt


@needs_torch
@pytest.mark.export
def test_quantizing_a_bridged_draft_keeps_its_maps(pairs: dict[str, Path],
                                                   tmp_path: Path) -> None:
    from specedge.calibration.quantize import QuantizeOptions, quantize

    out = quantize(QuantizeOptions(pair=pairs["other"], output=tmp_path / "q",
                                   method="int8-rtn", model="draft"), say=lambda _msg: None)
    pair = Pair.load(out)
    assert pair.manifest.draft is not None and pair.manifest.draft.input_id_map is not None
    assert _greedy(pair, 3)[0] > 0


@needs_torch
@pytest.mark.export
def test_a_map_past_the_drafts_table_is_refused_at_load(pairs: dict[str, Path],
                                                        tmp_path: Path) -> None:
    import shutil

    from specedge.runtime.files import sha256_file

    folder = tmp_path / "pair"
    shutil.copytree(pairs["other"], folder)
    path = folder / "draft" / "input_id_map.npy"
    ids = np.load(path)
    ids[5] = 384  # the draft's table has 384 rows
    np.save(path, ids, allow_pickle=False)
    doc = json.loads((folder / "specedge.json").read_text())
    doc["models"]["draft"]["files"]["draft/input_id_map.npy"] = sha256_file(path)
    (folder / "specedge.json").write_text(json.dumps(doc))
    with pytest.raises(SpecEdgeError, match=r"input_id_map.npy: the input id map must hold one "
                                            r"id in \[0, 384\)"):
        Pair.load(folder)


@needs_torch
@pytest.mark.export
def test_a_target_with_an_input_map_is_refused(pairs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "pair"
    shutil.copytree(pairs["other"], folder)
    doc = json.loads((folder / "specedge.json").read_text())
    doc["models"]["target"]["input_id_map"] = "draft/input_id_map.npy"
    doc["models"]["target"]["files"]["draft/input_id_map.npy"] = \
        doc["models"]["draft"]["files"]["draft/input_id_map.npy"]
    (folder / "specedge.json").write_text(json.dumps(doc))
    with pytest.raises(SpecEdgeError, match="models.target.input_id_map is set"):
        Pair.load(folder)


@needs_torch
@pytest.mark.export
def test_a_draft_that_shares_almost_nothing_is_refused_before_any_build(
        pairs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from tokenizers import Tokenizer, models

    draft = tmp_path / "words"
    shutil.copytree(pairs["other_hf"], draft)
    words = {f"zq{i}x": i for i in range(300)}
    Tokenizer(models.WordLevel(words, unk_token="zq0x")).save(str(draft / "tokenizer.json"))
    config = json.loads((draft / "tokenizer_config.json").read_text())
    config.update(bos_token="zq0x", eos_token="zq1x", pad_token="zq0x", unk_token="zq0x")
    (draft / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SpecEdgeError, match=r"shares only \d+ of target .* tokens .*pick a draft "
                                            "whose tokenizer is closer"):
        _export(pairs["target"], tmp_path / "out", draft=str(draft))
    assert not (tmp_path / "out").exists()


@needs_torch
@pytest.mark.export
def test_the_cli_says_the_draft_has_its_own_tokenizer(pairs: dict[str, Path],
                                                      tmp_path: Path) -> None:
    from click.testing import CliRunner

    from specedge.cli import main

    result = CliRunner().invoke(main, ["export", str(pairs["target"]), "--draft",
                                       str(pairs["other_hf"]), "-o", str(tmp_path / "pair")])
    assert result.exit_code == 0, result.output
    assert "the draft has its own tokenizer: it proposes" in result.output
    assert "of the target's 320 tokens" in result.output


@needs_torch
@pytest.mark.export
def test_a_server_with_a_bridged_draft_equals_target_only(pairs: dict[str, Path]) -> None:
    """The server path: a real uvicorn server batching a bridged concat pair, real clients,
    concurrent streams (greedy and seeded), each equal to the target's own decoding."""
    import asyncio

    import openai

    from specedge.runtime.server import ServerOptions, create_app
    from tests.test_serve import running, solo

    pair = Pair.load(pairs["other_concat"])
    app = create_app(pair, ServerOptions(max_batch=4, max_queue=16, drafter="model",
                                         num_draft_tokens=3, adaptive=False))
    cases = [(PROMPTS[i % len(PROMPTS)], 10 + 3 * i, 0.0 if i % 3 else 0.8, i)
             for i in range(8)]

    async def one(client: openai.AsyncOpenAI, case: tuple[str, int, float, int]
                  ) -> tuple[str, int]:
        prompt, n, temperature, seed = case
        stream = await client.chat.completions.create(
            model=pair.manifest.root.name, messages=[{"role": "user", "content": prompt}],
            max_tokens=n, temperature=temperature, seed=seed, stream=True,
            stream_options={"include_usage": True})
        text, proposed = [], 0
        async for chunk in stream:
            text.extend(c.delta.content or "" for c in chunk.choices)
            if chunk.usage is not None:
                proposed = chunk.usage.model_extra["specedge"]["proposed"]
        return "".join(text), proposed

    async def main(url: str) -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, c) for c in cases))

    with running(app) as url:
        got = asyncio.run(main(url))
    assert sum(proposed for _, proposed in got) > 0  # the bridged draft proposed, in batches
    for (prompt, n, temperature, seed), (text, _) in zip(cases, got, strict=True):
        assert text == solo(pair, prompt, n, temperature, seed).text, (prompt, n, temperature)
