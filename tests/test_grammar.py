"""Structured output (`runtime/grammar`): a grammar masks each position's tokens, exactly under
speculation.

Target-only constrained decoding is checked against a plain loop that recomputes the whole
sequence every step and masks it with a fresh llguidance matcher; speculative decoding (model,
n-gram and hybrid drafts; greedy and seeded sampling) against target-only, in batch 1, batches
and continuous batching; the masks of a verification block against fresh matchers, drafts that
break the grammar included; and the outputs against the grammar itself (`re.fullmatch`, JSON
with its schema's keys and types).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import llguidance
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.runtime.errors import InputError
from specedge.runtime.grammar import Grammar, GrammarState
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams

from .test_hardening import pair_copy
from .test_penalties import plain_greedy, rows_three_ways

__all__ = ["pair_copy"]  # a fixture, imported for the tests below

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"enum": ["red", "green", "blue"]}}}
GRAMMARS = {
    "json_schema": Grammar.json_schema(SCHEMA),
    "regex": Grammar("regex", r"(yes|no): [a-e]{2,9}\."),
    "gbnf": Grammar("grammar", 'root ::= "x=" [0-9] [0-9]? ";"'),
    "lark": Grammar("grammar", 'start: "a" /[b-d]{1,12}/ "e"'),
    "choice": Grammar.choice(["alpha", "beta", "gamma delta"]),
    "json_object": Grammar("json_object"),
}
PROMPTS = ["Hello there", "The quick brown fox", "1, 2, 3,"]
SEEDED = SamplingParams(temperature=0.9, seed=5)


@pytest.fixture(scope="module")
def pair(fixtures_dir: Path) -> Pair:
    return Pair.load(fixtures_dir / "tiny-llama")


@pytest.fixture(scope="module")
def concat_pair(fixtures_dir: Path) -> Pair:
    return Pair.load(fixtures_dir / "tiny-llama-concat")


def _check_output(name: str, text: str) -> None:
    """A finished output matches its grammar."""
    if name == "json_schema":
        value = json.loads(text)
        assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
        assert 0 <= value["n"] <= 999 and value["tag"] in ("red", "green", "blue")
    elif name == "json_object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(r"(yes|no): [a-e]{2,9}\.", text)
    elif name == "gbnf":
        assert re.fullmatch(r"x=[0-9][0-9]?;", text)
    elif name == "lark":
        assert re.fullmatch(r"a[b-d]{1,12}e", text)
    else:
        assert text in ("alpha", "beta", "gamma delta")


def _fresh_mask(pair: Pair, grammar: Grammar, tokens: list[int]) -> np.ndarray:
    """The allowed tokens after `tokens`, from a new matcher (no rollback involved)."""
    state = pair.grammars.state(grammar)
    return state.masks(tokens, [], 1)[0]


def _plain_loop(pair: Pair, prompt: str, grammar: Grammar, n: int) -> list[int]:
    """Masked by a fresh matcher each step."""
    return plain_greedy(pair, prompt, n, lambda row, _, out: np.where(
        _fresh_mask(pair, grammar, out), row, -np.inf))


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_target_only_equals_the_plain_loop_and_matches(pair: Pair, name: str) -> None:
    grammar = GRAMMARS[name]
    for prompt in PROMPTS[:2]:
        result = pair.generate(prompt, GenerationConfig(max_new_tokens=48, drafter="none",
                                                        grammar=grammar))
        assert result.tokens == _plain_loop(pair, prompt, grammar, 48)
        assert result.stop_reason == "eos", (name, result.text)
        _check_output(name, result.text)


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-llama-concat"])
def test_speculative_equals_target_only(fixtures_dir: Path, fixture: str) -> None:
    pair = Pair.load(fixtures_dir / fixture)
    proposed = 0
    for name, grammar in GRAMMARS.items():
        for sampling in (SamplingParams(), SEEDED):
            for prompt in PROMPTS:
                alone = pair.generate(prompt, GenerationConfig(
                    max_new_tokens=48, sampling=sampling, drafter="none", grammar=grammar))
                for drafter in ("model", "ngram", "hybrid"):
                    spec = pair.generate(prompt, GenerationConfig(
                        max_new_tokens=48, sampling=sampling, drafter=drafter,
                        num_draft_tokens=4, adaptive=drafter == "hybrid", grammar=grammar))
                    assert spec.tokens == alone.tokens, (name, sampling, prompt, drafter)
                    proposed += spec.stats.proposed
                if alone.stop_reason == "eos":
                    _check_output(name, alone.text)
    assert proposed > 0


def test_batches_and_continuous_batching(concat_pair: Pair) -> None:
    names = ["json_schema", "regex", "choice", "gbnf"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names) + 1)]
    configs = [GenerationConfig(max_new_tokens=40, grammar=GRAMMARS[n], drafter="model",
                                num_draft_tokens=3, adaptive=False,
                                sampling=SEEDED if i % 2 else SamplingParams())
               for i, n in enumerate(names)]
    configs.append(GenerationConfig(max_new_tokens=40, drafter="model", num_draft_tokens=3,
                                    adaptive=False))  # free text in the same batch
    solo = rows_three_ways(concat_pair, prompts, configs)
    for name, one in zip(names, solo, strict=False):
        if one.stop_reason == "eos":
            _check_output(name, one.text)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_block_masks_equal_fresh_matchers(pair: Pair, data: st.DataObject) -> None:
    """Row i of a block's masks is a fresh matcher's mask after the history and the first i
    drafts, while the drafts follow the grammar; after one breaks it, rows repeat the last."""
    grammar = GRAMMARS["regex"]
    state = pair.grammars.state(grammar)
    vocab = pair.target.spec.vocab_size
    history: list[int] = []
    for _ in range(data.draw(st.integers(1, 4))):  # several rounds on one state
        allowed = np.flatnonzero(_fresh_mask(pair, grammar, history))
        drafts = []
        for _ in range(data.draw(st.integers(0, 4))):
            legal = np.flatnonzero(_fresh_mask(pair, grammar, history + drafts))
            if data.draw(st.booleans()) or not len(legal):
                drafts.append(data.draw(st.integers(0, vocab - 1)))  # maybe invalid
            else:
                drafts.append(int(data.draw(st.sampled_from(list(legal)))))
        masks = state.masks(history, drafts, len(drafts) + 1)
        valid = 0
        for i in range(len(drafts) + 1):
            if i == valid:
                want = _fresh_mask(pair, grammar, history + drafts[:i])
                np.testing.assert_array_equal(masks[i], want)
                if i < len(drafts) and want[drafts[i]]:
                    valid += 1
            else:
                np.testing.assert_array_equal(masks[i], masks[i - 1])
        if not len(allowed) or allowed.tolist() == list(pair.manifest.eos_token_ids):
            break
        history.append(int(data.draw(st.sampled_from(list(allowed)))))


def test_forced_tokens_are_drafted_without_a_call(pair: Pair) -> None:
    """The tokens a grammar forces (JSON keys and punctuation) are drafted without a draft-model
    call and fed with the next one; the output stays target-only's."""
    grammar = GRAMMARS["json_schema"]
    assert pair.tokenizer.decode(pair.grammars.state(grammar).forced([], 8)) == '{"ok":'
    assert pair.grammars.state(GRAMMARS["regex"]).forced([], 8) == []  # "yes" or "no"
    for sampling in (SamplingParams(), SEEDED, SamplingParams(temperature=0.8)):
        config = GenerationConfig(max_new_tokens=48, grammar=grammar, drafter="model",
                                  num_draft_tokens=4, adaptive=False, sampling=sampling)
        spec = pair.generate("Hello there", config)
        if sampling.seed is not None or sampling.greedy:
            alone = pair.generate("Hello there", GenerationConfig(
                max_new_tokens=48, grammar=grammar, drafter="none", sampling=sampling))
            assert spec.tokens == alone.tokens
        assert spec.stats.draft_calls < spec.stats.proposed * 0.7, spec.stats
    free = pair.generate("Hello there", GenerationConfig(max_new_tokens=48, drafter="model",
                                                         num_draft_tokens=4, adaptive=False))
    assert free.stats.draft_calls >= free.stats.proposed  # without a grammar: a call each


def test_a_dead_end_allows_eos_only(pair: Pair) -> None:
    state = pair.grammars.state(Grammar.choice(["ab"]))
    done = state.masks(pair.tokenizer.encode("ab"), [], 1)[0]
    assert np.flatnonzero(done).tolist() == list(pair.manifest.eos_token_ids)


@pytest.mark.parametrize("kind, source, message", [
    ("xml", "<a/>", "grammar kind must be one of"),
    ("regex", "", "a regex grammar needs its text"),
    ("regex", "[a-", "the regex does not compile: .*unclosed character class"),
    ("json_schema", "{", "the json_schema does not compile"),
    ("json_schema", '{"type": "nothing"}', "the json_schema does not compile"),
    ("grammar", 'root ::= ("a"', "the grammar does not compile"),
    ("choice", '"a"', "a choice is a JSON list of non-empty strings"),
    ("choice", "[]", "a choice is a JSON list"),
])
def test_bad_grammars_are_refused_in_one_line(kind: str, source: str, message: str) -> None:
    with pytest.raises(InputError, match=message) as err:
        Grammar(kind, source)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_states_follow_rollbacks_without_errors(pair: Pair) -> None:
    """A state asked about a sequence, then a shorter or a different one, stays usable (the
    matcher rolls back instead of entering llguidance's error state)."""
    state = pair.grammars.state(GRAMMARS["regex"])
    yes = pair.tokenizer.encode("yes: ab")
    state.masks(yes, [], 1)
    state.masks(yes[:2], [], 1)
    no = pair.tokenizer.encode("no: c")
    np.testing.assert_array_equal(state.masks(no, [], 1)[0],
                                  _fresh_mask(pair, GRAMMARS["regex"], no))
    assert isinstance(state, GrammarState)
    assert llguidance.LLMatcher.validate_grammar(GRAMMARS["regex"].compiled()) == ""


def test_sampling_keeps_the_constrained_distribution(pair: Pair) -> None:
    """Unseeded sampling under a grammar: speculative decoding (the model's masked drafts, and
    forced tokens drafted with certainty: one-hot draft probabilities) gives each token
    sequence (a text may be written with several tokenizations, which the grammar all allows)
    as often as target-only decoding (chi-square, two samples)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    grammar = Grammar.choice(["alpha", "beta", "gamma delta", "delta"])
    sampling = SamplingParams(temperature=1.5)
    counts = []
    for drafter in ("none", "model"):
        config = GenerationConfig(max_new_tokens=16, grammar=grammar, drafter=drafter,
                                  num_draft_tokens=4, adaptive=False, sampling=sampling)
        runs = [pair.generate("Pick one:", config) for _ in range(600)]
        assert {r.text for r in runs} <= {"alpha", "beta", "gamma delta", "delta"}
        counts.append(Counter(tuple(r.tokens) for r in runs))
    common = sorted({s for c in counts for s in c if counts[0][s] + counts[1][s] >= 10})
    assert len(common) >= 4, counts  # several texts, and texts in several tokenizations
    table = [[c[s] for s in common] + [sum(c.values()) - sum(c[s] for s in common)]
             for c in counts]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert chi2_contingency(table).pvalue > 1e-3, counts


def test_a_grammar_that_spells_a_tag_token_ends_instead_of_sampling_nothing(
        pair_copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A regex that spells `<think>` where the tokenizer has it as a token of its own: llguidance
    allows only that token and then refuses it. Before, every later row was masked to nothing
    and the output ran to max_tokens as token 0; now the mask keeps what the matcher takes, the
    output ends with eos there (the same with speculation), and a warning names the token."""
    from .test_reasoning import think_tokens

    opening, _ = think_tokens(pair_copy)
    pair = Pair.load(pair_copy)
    grammar = Grammar("regex", r"ok<think>[a-z]{3,12}</think>[a-z]{3,9}")
    ids = pair.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    config = GenerationConfig(max_new_tokens=40, drafter="none", grammar=grammar)
    with caplog.at_level("WARNING", logger="specedge.runtime.grammar"):
        want = pair.generate(ids, config)
    assert want.stop_reason == "eos" and want.text == "ok", (want.tokens, want.text)
    assert f"token {opening}" in caplog.text
    for drafter in ("model", "ngram"):
        got = pair.generate(ids, GenerationConfig(max_new_tokens=40, drafter=drafter,
                                                  num_draft_tokens=3, grammar=grammar))
        assert got.tokens == want.tokens, drafter
