"""Reduced-vocabulary draft heads: graph surgery, manifest, and exactness through the runtime."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams

pytestmark = [
    pytest.mark.export,
    pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="needs [export]"),
]


@pytest.fixture(scope="module")
def subset_pair(tiny_pair_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    from specedge.calibration import draft_search
    from specedge.exporter import draft_head

    pair = Pair.load(tiny_pair_dir)
    streams = []
    for prompt in ("The quick brown", "def add(a, b):", "Edge devices like"):
        ids = pair.encode_prompt(prompt)
        out, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=40, drafter="none"))
        streams.append(ids + out)
    keep = draft_head.frequent_tokens(streams, 120, pair.manifest.vocab_size,
                                      always=pair.manifest.eos_token_ids)
    assert len(keep) == 120 and (np.diff(keep) > 0).all()
    folder = tmp_path_factory.mktemp("subset") / "pair"
    draft_search._vocab_candidate(tiny_pair_dir, folder, keep)
    return Pair.load(folder)


def test_subset_logits_match_full_head_columns(subset_pair: Pair, tiny_pair: Pair) -> None:
    assert subset_pair.draft is not None and tiny_pair.draft is not None
    ids = subset_pair.draft.vocab_ids
    assert ids is not None and len(ids) == 120
    prompt = np.asarray([tiny_pair.encode_prompt("The quick brown")])
    full = tiny_pair.draft.forward(tiny_pair.draft.new_cache(1, 32), prompt)
    sub = subset_pair.draft.forward(subset_pair.draft.new_cache(1, 32), prompt)
    assert sub.shape[-1] == 120
    assert np.abs(sub - full[..., ids]).max() < 1e-4


def test_subset_draft_greedy_is_exact(subset_pair: Pair, tiny_pair: Pair) -> None:
    for prompt in ("The quick brown", "héllo 🙂", "Speculative decoding drafts"):
        ids = tiny_pair.encode_prompt(prompt)
        base, _, _ = tiny_pair.generate_ids(ids, GenerationConfig(max_new_tokens=40,
                                                                  drafter="none"))
        spec, _, st = subset_pair.generate_ids(ids, GenerationConfig(
            max_new_tokens=40, num_draft_tokens=3, adaptive=False))
        assert spec == base and st.proposed > 0


def test_subset_draft_sampling_keeps_target_distribution(subset_pair: Pair) -> None:
    from tests.test_sampling_e2e import exact_first_two, gof

    pair = Pair(replace(subset_pair.manifest, eos_token_ids=()), subset_pair.tokenizer,
                subset_pair.target, subset_pair.draft)
    params = SamplingParams(temperature=1.0, top_k=30)
    prompt = pair.encode_prompt("The quick brown")
    first, second = exact_first_two(pair, prompt, params)
    rng = np.random.default_rng(5)
    firsts, seconds = [], []
    for _ in range(2000):
        out, _, _ = pair.generate_ids(prompt, GenerationConfig(
            max_new_tokens=4, num_draft_tokens=3, adaptive=False, drafter="model",
            sampling=replace(params, seed=int(rng.integers(2**31)))))
        firsts.append(out[0])
        seconds.append(out[1])
    assert gof(firsts, first) > 1e-3 and gof(seconds, second) > 1e-3


def test_subset_draft_with_a_grammar_is_exact(subset_pair: Pair, tiny_pair: Pair) -> None:
    """Structured output through a reduced head: its columns are masked by their token ids, and
    where the grammar allows none of them (`[~^]` is outside the 120 kept tokens) the draft
    stops proposing instead of failing."""
    from specedge.runtime.grammar import Grammar

    assert subset_pair.draft is not None and subset_pair.draft.vocab_ids is not None
    kept = set(subset_pair.draft.vocab_ids.tolist())
    assert not {tiny_pair.tokenizer.encode(c)[0] for c in "~^"} & kept
    proposed = {}
    for grammar in (Grammar("regex", r"[a-z ]{4,20}\."), Grammar("regex", "[~^]{3}"),
                    Grammar.json_schema({"type": "object", "required": ["a"],
                                         "properties": {"a": {"type": "integer"}}})):
        for prompt in ("The quick brown", "def add(a, b):"):
            config = GenerationConfig(max_new_tokens=30, grammar=grammar, num_draft_tokens=3,
                                      adaptive=False, drafter="model")
            base = tiny_pair.generate(prompt, replace(config, drafter="none"))
            spec = subset_pair.generate(prompt, config)
            assert spec.tokens == base.tokens, (grammar, prompt)
            proposed[grammar.source] = proposed.get(grammar.source, 0) + spec.stats.proposed
    # `[~^]{3}`: nothing proposed but the eos once the three characters are out (kept).
    assert proposed["[~^]{3}"] <= 2 and proposed[r"[a-z ]{4,20}\."] > 0
