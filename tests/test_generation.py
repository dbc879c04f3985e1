"""End-to-end generation on the tiny seeded pair: exactness, stop reasons, errors, invariants."""

from __future__ import annotations

import pytest

from specedge.runtime.adaptive import AdaptiveK
from specedge.runtime.drafters import HybridDrafter, ModelDrafter, NgramDrafter, Proposal
from specedge.runtime.errors import InputError
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.policy import resolve_plan
from specedge.runtime.rounds import RowOutput, RowSampler
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.speculative import decode
from specedge.runtime.stats import GenerationStats

PROMPTS = ["The quick brown", "def add(a, b):", "héllo wörld 🙂", "Edge devices like",
           "Speculative decoding drafts"]


def ids_of(pair: Pair, cfg: GenerationConfig, prompt: str) -> list[int]:
    out, _, _ = pair.generate_ids(pair.encode_prompt(prompt), cfg)
    return out


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_speculative_equals_target_only(tiny_pair: Pair, drafter: str, k: int) -> None:
    for prompt in PROMPTS:
        base = ids_of(tiny_pair, GenerationConfig(max_new_tokens=40, drafter="none"), prompt)
        spec = ids_of(tiny_pair, GenerationConfig(max_new_tokens=40, drafter=drafter,
                                                  num_draft_tokens=k, adaptive=False), prompt)
        assert spec == base, (drafter, k, prompt)


def test_adaptive_greedy_equals_target_only(tiny_pair: Pair) -> None:
    """K changes every round (scripted, see conftest): k = 0 rounds, catch-ups, every k."""
    for prompt in PROMPTS:
        base = ids_of(tiny_pair, GenerationConfig(max_new_tokens=60, drafter="none"), prompt)
        spec, _, st = tiny_pair.generate_ids(tiny_pair.encode_prompt(prompt), GenerationConfig(
            max_new_tokens=60, drafter="model", num_draft_tokens=6, adaptive=True))
        assert spec == base
        assert st.accepted > 0 and 0 in st.draft_lengths and max(st.draft_lengths) >= 3


def test_hybrid_free_hits_at_k_0_keep_greedy_exact(tiny_pair: Pair,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With the draft model off (k = 0, scripted), n-gram hits are still verified (while they
    pay: `AdaptiveK.free_hits_pay`); the output stays target-only's, token for token."""
    at_k: list[int] = []
    free_round = AdaptiveK.free_round

    def spy(self: AdaptiveK, *args: object, **kwargs: object) -> None:
        at_k.append(self.k)
        free_round(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(AdaptiveK, "free_round", spy)
    for prompt in ["a b c a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2 3 4", "The quick brown"]:
        base = ids_of(tiny_pair, GenerationConfig(max_new_tokens=60, drafter="none"), prompt)
        spec = ids_of(tiny_pair, GenerationConfig(max_new_tokens=60, drafter="hybrid",
                                                  num_draft_tokens=5, adaptive=True), prompt)
        assert spec == base, prompt
    assert 0 in at_k, "no free n-gram round ran at k = 0"


def test_cache_invariant_holds_every_round(tiny_pair: Pair) -> None:
    """Both caches hold exactly the committed tokens but the last one (draft: a prefix)."""
    prompt = tiny_pair.encode_prompt("The quick brown")
    target = tiny_pair.target
    assert tiny_pair.draft is not None
    cache = target.new_cache(1, 128)
    drafter = ModelDrafter(tiny_pair.draft, tiny_pair.draft.new_cache(1, 128))
    plan = resolve_plan(tiny_pair.manifest, has_draft=True, drafter="model", k=3,
                        adaptive=False)
    committed = list(prompt)
    sampler = RowSampler(SamplingParams(temperature=0.9), target.spec.vocab_size)
    for chunk in decode(target, cache, drafter, prompt, plan, sampler, RowOutput(50, ()),
                        GenerationStats()):
        committed += chunk
        assert int(cache.lengths[0]) == len(committed) - 1
        assert len(drafter.fed) <= len(committed) - 1
        assert drafter.fed == committed[: len(drafter.fed)]
        assert int(drafter.cache.lengths[0]) == len(drafter.fed)


@pytest.mark.parametrize("drafter_name", ["model", "hybrid"])
def test_a_long_lag_is_caught_up_in_one_window(tiny_pair: Pair, drafter_name: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: after a long stretch at k = 0 the draft fed every token it had missed, so a
    probe up from k = 0 late in a long text was skipped (`AdaptiveK.MAX_PROBE_CATCH_UP`) and
    drafting never resumed in that text. Now a catch-up feeds at most `window` tokens (the
    draft's context skips the rest); the output is still target-only's, token for token, and
    the cache holds a prefix of the draft's view of the committed tokens every round."""
    script = [0] * 50 + [3, 2, 0, 0, 4] + [0] * 40 + [3, 1]
    monkeypatch.setattr(AdaptiveK, "choose",
                        lambda self: script[min(self.rounds, len(script) - 1)])
    # Free n-gram hits at k = 0 would end the text in fewer scripted rounds when they pay,
    # which depends on this machine's timings.
    monkeypatch.setattr(AdaptiveK, "free_hits_pay", lambda self: False)
    prompt = tiny_pair.encode_prompt("The quick brown")
    cfg = GenerationConfig(max_new_tokens=160, drafter=drafter_name, num_draft_tokens=4,
                           ignore_eos=True)
    base = ids_of(tiny_pair, GenerationConfig(max_new_tokens=160, drafter="none",
                                              ignore_eos=True), "The quick brown")
    assert tiny_pair.draft is not None
    model = ModelDrafter(tiny_pair.draft, tiny_pair.draft.new_cache(1, 512))
    drafter = model if drafter_name == "model" else HybridDrafter(model, NgramDrafter(2))
    widths: list[int] = []
    propose = ModelDrafter.propose

    def spy(self: ModelDrafter, *args: object, **kwargs: object) -> Proposal:
        out = propose(self, *args, **kwargs)  # type: ignore[arg-type]
        widths.append(out.first_width)
        return out

    monkeypatch.setattr(ModelDrafter, "propose", spy)
    plan = resolve_plan(tiny_pair.manifest, has_draft=True, drafter=drafter_name, k=4,
                        adaptive=True)
    committed = list(prompt)
    sampler = RowSampler(SamplingParams(), tiny_pair.target.spec.vocab_size)
    for chunk in decode(tiny_pair.target, tiny_pair.target.new_cache(1, 512), drafter, prompt,
                        plan, sampler, RowOutput(cfg.max_new_tokens, ()), GenerationStats()):
        committed += chunk
        view = model.view(committed)
        assert model.fed == view[:len(model.fed)] and len(model.fed) <= len(view) - 1
        assert int(model.cache.lengths[0]) == len(model.fed)
        assert model.catch_up(committed) <= ModelDrafter.window
    assert committed[len(prompt):] == base
    assert model.skipped > 0, "no catch-up was cut short"
    assert widths and max(widths) <= ModelDrafter.window


def test_same_seed_same_text(tiny_pair: Pair) -> None:
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingParams(temperature=1.0, top_p=0.9,
                                                                      seed=7))
    a, b = tiny_pair.generate("The quick", cfg), tiny_pair.generate("The quick", cfg)
    assert a.tokens == b.tokens and a.text == b.text
    other = tiny_pair.generate("The quick", GenerationConfig(
        max_new_tokens=30, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=8)))
    assert other.tokens != a.tokens


def test_stream_deltas_concatenate_to_text(tiny_pair: Pair) -> None:
    cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingParams(temperature=1.0, seed=3))
    gen = tiny_pair.stream("héllo 🙂", cfg)
    deltas = []
    while True:
        try:
            deltas.append(next(gen))
        except StopIteration as done:
            result = done.value
            break
    assert "".join(deltas) == result.text
    assert result.text == tiny_pair.tokenizer.decode(
        [t for t in result.tokens if t not in tiny_pair.manifest.eos_token_ids])


def test_stop_reason_max_new_tokens(tiny_pair: Pair) -> None:
    r = tiny_pair.generate("The quick", GenerationConfig(max_new_tokens=7, drafter="model",
                                                         num_draft_tokens=5, adaptive=False))
    assert r.stop_reason == "max_new_tokens" and len(r.tokens) == 7
    assert r.stats.new_tokens == 7


def test_stop_reason_eos(tiny_pair: Pair) -> None:
    """Make the first greedy token an eos id: generation ends with reason eos."""
    base = ids_of(tiny_pair, GenerationConfig(max_new_tokens=20, drafter="none"), "The quick")
    eos_pair = Pair(_with_eos(tiny_pair, base[3]), tiny_pair.tokenizer, tiny_pair.target,
                    tiny_pair.draft)
    r = eos_pair.generate("The quick", GenerationConfig(max_new_tokens=20, num_draft_tokens=4,
                                                        adaptive=False))
    assert r.stop_reason == "eos"
    assert r.tokens == base[: base.index(base[3]) + 1]


def _with_eos(pair: Pair, token: int):  # noqa: ANN202
    from dataclasses import replace

    return replace(pair.manifest, eos_token_ids=(token,))


def test_stop_string_spanning_tokens(tiny_pair: Pair) -> None:
    full = tiny_pair.generate("The quick", GenerationConfig(max_new_tokens=40, drafter="none"))
    # A stop string made of the end of one token and the start of a later one.
    toks = [tiny_pair.tokenizer.decode([t]) for t in full.tokens]
    pos = next(i for i in range(2, len(toks) - 1) if toks[i] and toks[i + 1])
    stop = toks[i][-1:] + toks[i + 1][:1] if (i := pos) else ""
    start = full.text.find(stop)
    r = tiny_pair.generate("The quick", GenerationConfig(max_new_tokens=40, stop=(stop,)))
    assert r.stop_reason == "stop"
    assert r.text == full.text[:start]
    assert stop not in r.text


def test_stop_reason_context(tiny_pair: Pair) -> None:
    from dataclasses import replace

    small = replace(tiny_pair.manifest, target=replace(tiny_pair.manifest.target,
                                                       max_seq_len=20))
    pair = Pair(small, tiny_pair.tokenizer, tiny_pair.target, tiny_pair.draft)
    prompt = pair.encode_prompt("The quick brown")
    r = pair.generate("The quick brown", GenerationConfig(max_new_tokens=100,
                                                          num_draft_tokens=4))
    assert r.stop_reason == "context"
    assert len(prompt) + len(r.tokens) == 20
    base = ids_of(tiny_pair, GenerationConfig(max_new_tokens=100, drafter="none"),
                  "The quick brown")
    assert r.tokens == base[: len(r.tokens)]


def test_prompt_longer_than_context(tiny_pair: Pair) -> None:
    with pytest.raises(InputError, match="context"):
        tiny_pair.generate("The quick brown fox " * 200)


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(num_draft_tokens=0),
    dict(num_draft_tokens=65), dict(drafter="magic"), dict(stop=("",)),
])
def test_invalid_generation_config(kwargs: dict) -> None:
    with pytest.raises(InputError):
        GenerationConfig(**kwargs)


def test_bad_prompts(tiny_pair: Pair) -> None:
    with pytest.raises(InputError, match="empty"):
        tiny_pair.generate("")
    with pytest.raises(InputError, match="outside the vocabulary"):
        tiny_pair.generate_ids([1, 2, 10**6])
    with pytest.raises(InputError):
        tiny_pair.generate([{"role": "user"}])


def test_stats_are_consistent(tiny_pair: Pair) -> None:
    r = tiny_pair.generate("The quick", GenerationConfig(max_new_tokens=50, num_draft_tokens=3,
                                                         adaptive=False))
    s = r.stats
    assert s.rounds == s.target_calls == len(s.draft_lengths)
    assert s.proposed == sum(s.draft_lengths) and s.accepted == sum(s.accepted_lengths)
    assert s.new_tokens == len(r.tokens)
    assert 0.0 <= s.acceptance_rate <= 1.0
    assert s.decode_s >= s.draft_s + s.verify_s


def test_ngram_lookup() -> None:
    ng = NgramDrafter(max_ngram=3)
    assert ng.lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert ng.lookup([1, 2, 3], 2) == []
    assert ng.lookup([7, 8, 9, 7], 2) == [8, 9]


@pytest.mark.real_tuner
def test_adaptive_backs_off_when_drafts_never_accepted() -> None:
    ak = AdaptiveK(6, k_start=3)
    for _ in range(60):
        k = ak.k
        ak.update(k, 0, 0.005 * k, k, 0.010 + 0.001 * k)
    assert ak.k == 0 or ak.probing
    assert ak.interval > ak.probe_every  # probes that change nothing get rarer


@pytest.mark.real_tuner
def test_adaptive_grows_when_drafts_always_accepted() -> None:
    ak = AdaptiveK(6, k_start=1)
    for _ in range(60):
        k = ak.k
        ak.update(k, k, 0.001 * k, k, 0.010 + 0.0005 * k)
    assert ak.k >= 4


@pytest.mark.real_tuner
def test_adaptive_unexplored_positions_borrow_the_measured_acceptance() -> None:
    """At k=1 with position 1 always accepted, deeper positions are not assumed to be the 0.7
    prior: the tuner moves up even between probes."""
    ak = AdaptiveK(6, k_start=1, probe_every=1000)
    for _ in range(20):
        k = ak.k
        ak.update(k, k, 0.004 * k, k, 0.010 + 0.001 * k)
    assert ak.k >= 3


def test_first_token_comes_from_the_prefill(tiny_pair: Pair) -> None:
    """Target-only decoding of n tokens costs the prefill plus n - 1 calls (issue 16)."""
    target = tiny_pair.target
    for n in (1, 2, 17):
        before = target.calls
        r = tiny_pair.generate("The quick", GenerationConfig(max_new_tokens=n, drafter="none"))
        assert len(r.tokens) == n and r.stats.target_calls == n - 1
        assert target.calls - before == n


def test_batch_rows_finished_by_their_first_token(tiny_pair: Pair, fixtures_dir) -> None:  # noqa: ANN001
    concat = Pair.load(fixtures_dir / "tiny-llama-concat")
    cfgs = [GenerationConfig(max_new_tokens=1), GenerationConfig(max_new_tokens=9)]
    batch = concat.generate_batch(["The quick", "def add(a, b):"], cfgs)
    for prompt, cfg, got in zip(["The quick", "def add(a, b):"], cfgs, batch.results,
                                strict=True):
        assert got.tokens == concat.generate(prompt, cfg).tokens
    assert [len(r.tokens) for r in batch.results] == [1, 9]
