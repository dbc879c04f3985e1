"""Tests of specedge.runtime.sampling: warping, sampling and speculative verification."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.special import softmax
from scipy.stats import chisquare

from specedge.runtime.acceptance import (
    accept_greedy,
    accept_probability,
    accept_sample,
    first_token_marginal,
    residual_probs,
    sample_token,
)
from specedge.runtime.errors import InputError, ModelError, SpecEdgeError
from specedge.runtime.sampling import SamplingParams, warp_probs

FAST = settings(max_examples=100, deadline=None)
THOROUGH = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------------------------
# Strategies and helpers


@st.composite
def distributions(draw: st.DrawFn, vocab: int) -> np.ndarray:
    """A normalized float64 distribution over `vocab` tokens, often with exact zeros."""
    weights = draw(
        st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=vocab, max_size=vocab)
    )
    arr = np.asarray(weights, dtype=np.float64)
    if arr.sum() == 0.0:
        arr[draw(st.integers(0, vocab - 1))] = 1.0
    return arr / arr.sum()


@st.composite
def dist_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """(draft, target) over one vocabulary: random, equal, or with disjoint supports."""
    vocab = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["random", "equal", "disjoint"]))
    if kind == "equal":
        d = draw(distributions(vocab))
        return d, d.copy()
    if kind == "disjoint" and vocab >= 2:
        in_draft = np.asarray(draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab)))
        if in_draft.all() or not in_draft.any():
            in_draft[0] = not in_draft[0]
        d = draw(distributions(vocab)) * in_draft + 1e-3 * in_draft
        t = draw(distributions(vocab)) * ~in_draft + 1e-3 * ~in_draft
        return d / d.sum(), t / t.sum()
    return draw(distributions(vocab)), draw(distributions(vocab))


@st.composite
def verify_cases(
    draw: st.DrawFn, max_k: int = 5, max_vocab: int = 8, same: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(drafts [k], draft_probs [k, V], target_probs [k+1, V], seed), drafts drawn from drafts."""
    k = draw(st.integers(0, max_k))
    vocab = draw(st.integers(1, max_vocab))
    draft = np.zeros((k, vocab))
    for i in range(k):
        draft[i] = draw(distributions(vocab))
    if same:
        target = np.concatenate([draft, draw(distributions(vocab))[None, :]])
    else:
        target = np.stack([draw(distributions(vocab)) for _ in range(k + 1)])
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed ^ 0x5EED)
    drafts = np.asarray([rng.choice(vocab, p=row) for row in draft], dtype=np.int64)
    return drafts, draft, target, seed


def round_distribution(draft: np.ndarray, target: np.ndarray) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one verification round emits, by enumeration.

    `draft` [K, V] are the draft distributions, `target` [K + 1, V] the target ones; drafts are
    drawn independently at each position. Returns {emitted tuple: probability}.
    """
    k, vocab = draft.shape
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def walk(i: int, prefix: tuple[int, ...], prob: float) -> None:
        if i == k:
            for x in range(vocab):
                if target[k, x] > 0:
                    law[prefix + (x,)] += prob * target[k, x]
            return
        accepted = np.minimum(draft[i], target[i])  # P(draft x) * P(accept x)
        reject = float(np.maximum(draft[i] - target[i], 0.0).sum())
        residual = residual_probs(target[i], draft[i])
        for x in range(vocab):
            if accepted[x] > 0:
                walk(i + 1, prefix + (x,), prob * accepted[x])
            if reject * residual[x] > 0:
                law[prefix + (x,)] += prob * reject * residual[x]

    walk(0, (), 1.0)
    return dict(law)


def streamed_pair_law(draft: np.ndarray, target: np.ndarray, k: int) -> np.ndarray:
    """Exact joint law [V, V] of the first two tokens of a stream built from rounds of `k` drafts.

    Position-dependent distributions: `draft` [k + 1, V], `target` [k + 2, V]. A round that
    emits one token is followed by a round starting at position 1.
    """
    vocab = draft.shape[1]
    joint = np.zeros((vocab, vocab))
    second_round = round_distribution(draft[1 : k + 1], target[1 : k + 2])
    first_of_second = np.zeros(vocab)
    for seq, prob in second_round.items():
        first_of_second[seq[0]] += prob
    for seq, prob in round_distribution(draft[:k], target[: k + 1]).items():
        if len(seq) >= 2:
            joint[seq[0], seq[1]] += prob
        else:
            joint[seq[0]] += prob * first_of_second
    return joint


def reference_warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Slow, obvious one-row implementation of warp_probs (full sort, index tie-break)."""
    if params.greedy:
        out = np.zeros(logits.shape)
        out[np.argmax(logits)] = 1.0
        return out
    z = (logits.astype(np.float64) - logits.max()) / params.temperature
    p = softmax(z)
    if 0 < params.top_k < p.size:
        kth = np.sort(z)[::-1][params.top_k - 1]
        p = np.where(z >= kth, p, 0.0)
        p /= p.sum()
    if params.top_p < 1.0:
        order = sorted(range(p.size), key=lambda i: (-p[i], i))
        keep = np.zeros(p.size, dtype=bool)
        cum = 0.0
        for i in order:
            keep[i] = True
            cum += p[i]
            if cum >= params.top_p * p.sum():
                break
        # The logits' argmax always stays, even when exp() rounds it to a tie with lower ids.
        keep[np.argmax(logits)] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


class FixedRandom:
    """Stand-in for np.random.Generator whose random() returns given values."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


# --------------------------------------------------------------------------------------------
# Analytic properties of the verification rule


@THOROUGH
@given(dist_pairs())
def test_first_token_marginal_equals_target(pair: tuple[np.ndarray, np.ndarray]) -> None:
    draft, target = pair
    marginal = first_token_marginal(draft, target)
    np.testing.assert_allclose(marginal, target, rtol=0, atol=1e-9)
    assert not np.isnan(marginal).any()
    accept = accept_probability(draft, target)
    assert -1e-12 <= accept <= 1 + 1e-12
    np.testing.assert_allclose(accept, 1.0 - 0.5 * np.abs(draft - target).sum(), atol=1e-9)


def test_disjoint_supports_never_accept_and_still_give_target() -> None:
    draft = np.array([0.5, 0.5, 0.0, 0.0])
    target = np.array([0.0, 0.0, 0.25, 0.75])
    assert accept_probability(draft, target) == 0.0
    np.testing.assert_allclose(first_token_marginal(draft, target), target, atol=1e-12)
    np.testing.assert_allclose(residual_probs(target, draft), target, atol=1e-12)


@FAST
@given(st.integers(1, 2), st.integers(2, 4), st.data())
def test_two_token_stream_is_exactly_target(k: int, vocab: int, data: st.DataObject) -> None:
    draft = np.stack([data.draw(distributions(vocab)) for _ in range(k + 1)])
    target = np.stack([data.draw(distributions(vocab)) for _ in range(k + 2)])
    joint = streamed_pair_law(draft, target, k)
    np.testing.assert_allclose(joint, np.outer(target[0], target[1]), rtol=0, atol=1e-9)


def test_residual_probs() -> None:
    target = np.array([0.5, 0.3, 0.2, 0.0])
    draft = np.array([0.2, 0.4, 0.2, 0.2])
    np.testing.assert_allclose(residual_probs(target, draft), [1.0, 0.0, 0.0, 0.0])
    same = residual_probs(target, target.copy())
    np.testing.assert_array_equal(same, target)
    batched = residual_probs(np.stack([target, target]), np.stack([draft, target]))
    np.testing.assert_allclose(batched, [[1.0, 0.0, 0.0, 0.0], target])
    with pytest.raises(InputError):
        residual_probs(target, draft[:3])


# --------------------------------------------------------------------------------------------
# accept_sample / accept_greedy contracts


@FAST
@given(verify_cases(same=True))
def test_accept_sample_draft_equals_target_accepts_everything(
    case: tuple[np.ndarray, np.ndarray, np.ndarray, int],
) -> None:
    drafts, draft, target, seed = case
    out = accept_sample(drafts, draft, target, np.random.default_rng(seed))
    assert out.dtype == np.int64
    assert out.shape == (drafts.size + 1,)
    np.testing.assert_array_equal(out[:-1], drafts)
    assert target[-1, out[-1]] > 0
    for row in draft:
        assert not np.isnan(residual_probs(row, row)).any()


@FAST
@given(verify_cases())
def test_accept_sample_emits_accepted_prefix_plus_one(
    case: tuple[np.ndarray, np.ndarray, np.ndarray, int],
) -> None:
    drafts, draft, target, seed = case
    k = drafts.size
    rng = np.random.default_rng(seed)
    out = accept_sample(drafts, draft, target, rng)
    assert out.dtype == np.int64 and out.ndim == 1
    assert 1 <= out.size <= k + 1
    accepted = out.size - 1
    np.testing.assert_array_equal(out[:-1], drafts[:accepted])
    # Every accepted draft has positive target probability.
    assert all(target[i, drafts[i]] > 0 for i in range(accepted))
    last = int(out[-1])
    if accepted == k:
        assert target[k, last] > 0
    else:
        assert residual_probs(target[accepted], draft[accepted])[last] > 0

    # Same seed, same output.
    again = accept_sample(drafts, draft, target, np.random.default_rng(seed))
    np.testing.assert_array_equal(out, again)

    # Exactly one draw per examined position plus one for the final token.
    examined = k if accepted == k else accepted + 1
    reference = np.random.default_rng(seed)
    reference.random(examined + 1)
    assert rng.random() == reference.random()


@FAST
@given(st.integers(0, 5), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_accept_greedy_matches_reference(k: int, vocab: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.integers(-3, 3, size=(k + 1, vocab)).astype(np.float32)  # ties on purpose
    best = np.argmax(logits, axis=-1)
    drafts = np.where(rng.random(k) < 0.7, best[:k], rng.integers(0, vocab, size=k))
    out = accept_greedy(drafts, logits)
    expected: list[int] = []
    for i in range(k):
        if drafts[i] != best[i]:
            break
        expected.append(int(drafts[i]))
    expected.append(int(best[len(expected)]))
    assert out.dtype == np.int64
    assert 1 <= out.size <= k + 1
    np.testing.assert_array_equal(out[:-1], drafts[: out.size - 1])
    np.testing.assert_array_equal(out, expected)


def test_accept_greedy_examples() -> None:
    logits = np.full((4, 6), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 5] = 3.0
    # Full accept: the drafts then the bonus argmax of the last row.
    np.testing.assert_array_equal(accept_greedy(np.array([2, 4, 1]), logits), [2, 4, 1, 5])
    # First mismatch at position 1: the correction is the target argmax there.
    np.testing.assert_array_equal(accept_greedy(np.array([2, 0, 1]), logits), [2, 4])
    # Mismatch at position 0.
    np.testing.assert_array_equal(accept_greedy(np.array([3, 4, 1]), logits), [2])
    # No drafts: just the next target token.
    np.testing.assert_array_equal(accept_greedy(np.array([], dtype=np.int64), logits[:1]), [2])
    # Ties go to the lowest token id, like np.argmax.
    np.testing.assert_array_equal(accept_greedy(np.array([1]), np.zeros((2, 3))), [0])


def test_accept_sample_rule_with_fixed_draws() -> None:
    draft = np.array([[0.5, 0.5, 0.0], [0.1, 0.1, 0.8]])
    target = np.array([[0.25, 0.75, 0.0], [0.0, 0.5, 0.5], [0.0, 0.0, 1.0]])
    # target/draft for token 0 at position 0 is 0.5: u = 0.49 accepts, then token 1 at
    # position 1 has ratio 5 (always accepted), then the bonus comes from target[2].
    out = accept_sample(np.array([0, 1]), draft, target, FixedRandom(0.49, 0.99, 0.3))
    np.testing.assert_array_equal(out, [0, 1, 2])
    # u = 0.51 rejects token 0; the residual is all on token 1.
    out = accept_sample(np.array([0, 1]), draft, target, FixedRandom(0.51, 0.0))
    np.testing.assert_array_equal(out, [1])
    # A token the target gives probability 0 is never accepted, even with u == 0.
    out = accept_sample(np.array([0]), draft[1:], target[1:], FixedRandom(0.0, 0.0))
    assert out.tolist() == [1]
    # A draft of probability 0 that the target likes is accepted.
    out = accept_sample(
        np.array([1]),
        np.array([[1.0, 0.0]]),
        np.array([[0.5, 0.5], [1, 0]]),
        FixedRandom(0.999, 0.5),
    )
    assert out.tolist() == [1, 0]


def test_accept_sample_rejects_bad_shapes() -> None:
    draft = np.full((2, 3), 1 / 3)
    target = np.full((3, 3), 1 / 3)
    rng = np.random.default_rng(0)
    with pytest.raises(InputError):
        accept_sample(np.array([0, 1]), draft, target[:2], rng)
    with pytest.raises(InputError):
        accept_sample(np.array([0, 1]), draft[:, :2], target, rng)
    with pytest.raises(InputError):
        accept_sample(np.array([0, 3]), draft, target, rng)
    with pytest.raises(InputError):
        accept_sample(np.array([0.0, 1.0]), draft, target, rng)
    with pytest.raises(InputError):
        accept_greedy(np.array([0, 1]), target[:2])
    out = accept_sample(np.array([], dtype=np.int64), np.zeros((0, 3)), target[:1], rng)
    assert out.shape == (1,)


# --------------------------------------------------------------------------------------------
# sample_token


def test_sample_token_inverse_cdf_and_rounding() -> None:
    probs = np.array([0.25, 0.0, 0.75, 0.0])
    assert sample_token(probs, FixedRandom(0.0)) == 0
    assert sample_token(probs, FixedRandom(0.2499)) == 0
    assert sample_token(probs, FixedRandom(0.25)) == 2
    # The last draw below 1 never lands on a trailing zero-probability token.
    assert sample_token(probs, FixedRandom(np.nextafter(1.0, 0.0))) == 2
    # Unnormalized (rounded) probabilities still work.
    assert sample_token(probs * (1 - 1e-15), FixedRandom(np.nextafter(1.0, 0.0))) == 2
    for bad in (np.zeros(3), np.array([0.5, -0.1, 0.6]), np.array([np.nan, 1.0]), np.ones((2, 2))):
        with pytest.raises(InputError):
            sample_token(bad, np.random.default_rng(0))


def test_sample_token_frequencies() -> None:
    probs = np.array([0.1, 0.0, 0.6, 0.3])
    rng = np.random.default_rng(7)
    counts = np.bincount([sample_token(probs, rng) for _ in range(5000)], minlength=4)
    assert counts[1] == 0
    keep = probs > 0
    assert chisquare(counts[keep], 5000 * probs[keep]).pvalue > 1e-3


# --------------------------------------------------------------------------------------------
# Chi-square: the full K = 3 procedure, simulated


K = 3
VOCAB = 5
# Position-dependent distributions; the stream starts at position 0, a second round (when the
# first emits a single token) starts at position 1. Zeros on purpose: the target never emits
# token 4 at position 0 while the draft proposes it often.
DRAFT = np.array(
    [
        [0.10, 0.20, 0.30, 0.10, 0.30],
        [0.40, 0.10, 0.10, 0.20, 0.20],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.05, 0.15, 0.50, 0.00, 0.30],
    ]
)
TARGET = np.array(
    [
        [0.30, 0.25, 0.15, 0.30, 0.00],
        [0.10, 0.30, 0.20, 0.15, 0.25],
        [0.35, 0.05, 0.30, 0.10, 0.20],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.50, 0.10, 0.10, 0.20, 0.10],
    ]
)
RUNS = 20000


def _draw_drafts(rng: np.random.Generator, rows: np.ndarray, n: int) -> np.ndarray:
    """[n, len(rows)] drafts, column j drawn from rows[j], independently."""
    cdf = np.cumsum(rows, axis=-1)
    u = rng.random((n, rows.shape[0])) * cdf[:, -1]
    return np.stack(
        [np.searchsorted(cdf[j], u[:, j], side="right") for j in range(rows.shape[0])], axis=1
    )


class Simulation(NamedTuple):
    rounds: list[np.ndarray]  # what the first round emitted, per run
    streams: np.ndarray  # [RUNS, 2] the first two tokens of the stream
    drafts: np.ndarray  # [RUNS, K] the first round's drafts


@pytest.fixture(scope="module")
def simulated() -> Simulation:
    rng = np.random.default_rng(20240613)
    first_drafts = _draw_drafts(rng, DRAFT[:K], RUNS)
    second_drafts = _draw_drafts(rng, DRAFT[1 : K + 1], RUNS)
    rounds: list[np.ndarray] = []
    streams: list[tuple[int, int]] = []
    for n in range(RUNS):
        out = accept_sample(first_drafts[n], DRAFT[:K], TARGET[: K + 1], rng)
        rounds.append(out)
        if out.size >= 2:
            streams.append((int(out[0]), int(out[1])))
        else:
            nxt = accept_sample(second_drafts[n], DRAFT[1 : K + 1], TARGET[1 : K + 2], rng)
            streams.append((int(out[0]), int(nxt[0])))
    return Simulation(rounds, np.asarray(streams), first_drafts)


def _assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square of observed counts against probabilities; zero-probability cells must be 0."""
    counts = counts.ravel()
    probs = probs.ravel()
    zero = probs <= 1e-15
    assert counts[zero].sum() == 0
    expected = counts.sum() * probs[~zero] / probs[~zero].sum()
    assert chisquare(counts[~zero], expected).pvalue > 1e-3


def test_chisquare_first_emitted_token(simulated: Simulation) -> None:
    streams = simulated.streams
    _assert_matches(np.bincount(streams[:, 0], minlength=VOCAB), TARGET[0])
    # The test has power: the raw drafts (the draft distribution) fail it badly.
    raw = np.bincount(simulated.drafts[:, 0], minlength=VOCAB)[:4]
    assert chisquare(raw, raw.sum() * TARGET[0, :4] / TARGET[0, :4].sum()).pvalue < 1e-6


def test_chisquare_second_emitted_token_and_joint(simulated: Simulation) -> None:
    streams = simulated.streams
    _assert_matches(np.bincount(streams[:, 1], minlength=VOCAB), TARGET[1])
    joint = np.zeros((VOCAB, VOCAB))
    np.add.at(joint, (streams[:, 0], streams[:, 1]), 1)
    exact = streamed_pair_law(DRAFT, TARGET, K)
    np.testing.assert_allclose(exact, np.outer(TARGET[0], TARGET[1]), atol=1e-12)
    _assert_matches(joint, exact)


def test_chisquare_round_lengths_and_conditional_second_token(
    simulated: Simulation,
) -> None:
    rounds = simulated.rounds
    law = round_distribution(DRAFT[:K], TARGET[: K + 1])
    assert math.isclose(sum(law.values()), 1.0, abs_tol=1e-12)
    length_law = np.zeros(K + 2)
    second_law = np.zeros(VOCAB)
    for seq, prob in law.items():
        length_law[len(seq)] += prob
        if len(seq) >= 2:
            second_law[seq[1]] += prob
    # Given a first accept, the second emitted token follows the position-1 target exactly.
    np.testing.assert_allclose(second_law / second_law.sum(), TARGET[1], atol=1e-12)
    lengths = np.bincount([r.size for r in rounds], minlength=K + 2)
    _assert_matches(lengths[1:], length_law[1:])
    seconds = Counter(int(r[1]) for r in rounds if r.size >= 2)
    _assert_matches(np.array([seconds[x] for x in range(VOCAB)]), second_law)


# --------------------------------------------------------------------------------------------
# warp_probs


logit_rows = st.integers(1, 3).flatmap(
    lambda rows: st.integers(1, 40).flatmap(
        lambda vocab: st.lists(
            st.floats(-30, 30, allow_nan=False), min_size=rows * vocab, max_size=rows * vocab
        ).map(lambda xs: np.asarray(xs).reshape(rows, vocab))
    )
)
params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 5.0)),
    top_k=st.integers(0, 50),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.9)),
)


@THOROUGH
@given(logit_rows, params_strategy)
@example(  # regression (CI, stop 24): logits that differ by less than exp() resolves
    np.asarray([[-1.0, -1.0, -2.0, -2.189458710796879e-121, -2.377186443690369e-280, 0.0]]),
    SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0),
)
def test_warp_probs_matches_reference(logits: np.ndarray, params: SamplingParams) -> None:
    probs = warp_probs(logits, params)
    assert probs.dtype == np.float64 and probs.shape == logits.shape
    assert (probs >= 0).all()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-12)
    assert (probs[np.arange(len(logits)), np.argmax(logits, axis=-1)] > 0).all()
    for row, got in zip(logits, probs, strict=True):
        np.testing.assert_allclose(got, reference_warp(row, params), rtol=1e-9, atol=1e-12)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.3, 3.0), st.floats(0.05, 0.999), st.integers(0, 2))
def test_warp_probs_large_vocab_nucleus(
    seed: int, temperature: float, top_p: float, mode: int
) -> None:
    """Large vocabularies take the candidate fast path; it must agree with the full sort."""
    rng = np.random.default_rng(seed)
    vocab = 3000
    logits = rng.standard_normal((2, vocab)) * 4
    if mode == 1:
        logits = np.round(logits)  # many ties
    elif mode == 2:
        logits[:, rng.integers(0, vocab, 500)] = -np.inf
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=[0, 2000, 0][mode])
    probs = warp_probs(logits.astype(np.float32), params)
    for row, got in zip(logits.astype(np.float32), probs, strict=True):
        np.testing.assert_allclose(got, reference_warp(row, params), rtol=1e-9, atol=1e-15)


def _reference_nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The nucleus of one row by a full sort (ties to the lower id), as `reference_warp`."""
    keep = np.zeros(p.size, dtype=bool)
    cum = 0.0
    for i in sorted(range(p.size), key=lambda i: (-p[i], i)):
        keep[i] = True
        cum += p[i]
        if cum >= top_p * p.sum():
            break
    return keep


@THOROUGH
@given(logit_rows, st.floats(0.05, 5.0), st.floats(0.01, 0.999), st.integers(0, 2))
def test_nucleus_threshold_path_equals_sorting(logits: np.ndarray, temperature: float,
                                               top_p: float, rounding: int) -> None:
    """The threshold search (`_nucleus_by_threshold`, tried first) keeps exactly the set that
    sorting keeps, ties included (rounded logits make many), and so does the sorting path it
    falls back to."""
    from specedge.runtime import sampling

    z = np.round(logits, rounding) if rounding else logits
    p2 = softmax(z / temperature, axis=-1)
    total = p2.sum(axis=-1)
    threshold = top_p * total
    nonzero = np.count_nonzero(p2, axis=-1)
    fast = sampling._nucleus_by_threshold(p2, total, threshold, nonzero)
    slow = sampling._nucleus_by_sorting(p2, threshold, nonzero)
    for r, row in enumerate(p2):
        want = _reference_nucleus(row, top_p)
        np.testing.assert_array_equal(slow[r], want)
        if fast is not None:
            np.testing.assert_array_equal(fast[r], want)


def test_nucleus_threshold_path_runs_on_a_real_vocabulary_and_falls_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peaked row of a 49k vocabulary takes the threshold path (a compare and a small sort:
    ~0.26 ms a row against ~0.83 ms by argpartition, on the reference pair's logits); a row with
    more candidates than `_THRESHOLD_CANDIDATES` falls back to sorting, and warp_probs is the
    reference's either way."""
    from specedge.runtime import sampling

    rng = np.random.default_rng(7)
    logits = rng.standard_normal((2, 49152)).astype(np.float32) * 3
    logits[:, :8] += 12  # a few likely tokens, as a language model's next token
    params = SamplingParams(temperature=0.7, top_p=0.9)
    p2 = softmax(logits.astype(np.float64) / 0.7, axis=-1)
    total = p2.sum(axis=-1)
    assert sampling._nucleus_by_threshold(p2, total, 0.9 * total,
                                          np.count_nonzero(p2, axis=-1)) is not None
    fast = warp_probs(logits, params)
    monkeypatch.setattr(sampling, "_THRESHOLD_CANDIDATES", 0)
    assert sampling._nucleus_by_threshold(p2, total, 0.9 * total,
                                          np.count_nonzero(p2, axis=-1)) is None
    np.testing.assert_array_equal(warp_probs(logits, params), fast)
    for row, got in zip(logits, fast, strict=True):
        np.testing.assert_allclose(got, reference_warp(row, params), rtol=1e-9, atol=1e-15)


def test_warp_probs_temperature_is_softmax() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 3, 17)).astype(np.float32) * 5
    for temperature in (0.1, 0.7, 1.0, 2.5):
        probs = warp_probs(logits, SamplingParams(temperature=temperature))
        expected = softmax(logits.astype(np.float64) / temperature, axis=-1)
        np.testing.assert_allclose(probs, expected, rtol=1e-10, atol=1e-15)
    # Tiny temperature: no overflow, no NaN, the mass goes to the argmax.
    probs = warp_probs(logits, SamplingParams(temperature=1e-300))
    assert not np.isnan(probs).any()
    np.testing.assert_array_equal(np.argmax(probs, axis=-1), np.argmax(logits, axis=-1))


def test_warp_probs_top_k_keeps_exactly_k() -> None:
    rng = np.random.default_rng(2)
    logits = np.stack([rng.permutation(50).astype(np.float64) / 7 for _ in range(4)])
    for k in (1, 2, 10, 49, 50, 60):
        probs = warp_probs(logits, SamplingParams(temperature=1.0, top_k=k))
        assert ((probs > 0).sum(axis=-1) == min(k, 50)).all()
        top = np.argsort(-logits, axis=-1)[:, : min(k, 50)]
        assert (np.take_along_axis(probs, top, axis=-1) > 0).all()


def test_warp_probs_top_p_keeps_minimal_nucleus() -> None:
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5]]))
    cases = {0.49: 1, 0.51: 2, 0.69: 2, 0.71: 3, 0.86: 4, 0.96: 5, 1e-9: 1}
    for top_p, kept in cases.items():
        probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert ((probs > 0).sum(axis=-1) == kept).all(), top_p
        np.testing.assert_allclose(probs[0], probs[1, ::-1], atol=1e-15)
        base = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
        np.testing.assert_allclose(probs[0, :kept], base[:kept] / base[:kept].sum(), rtol=1e-12)


def test_warp_probs_min_p() -> None:
    base = np.array([0.4, 0.3, 0.2, 0.06, 0.04])
    probs = warp_probs(np.log(base), SamplingParams(temperature=1.0, min_p=0.5))
    np.testing.assert_allclose(probs, [4 / 9, 3 / 9, 2 / 9, 0, 0], atol=1e-12)


def test_warp_probs_greedy_is_one_hot() -> None:
    logits = np.array([[1.0, 3.0, 3.0, -np.inf], [0.0, 0.0, 0.0, 0.0], [-np.inf, -5, -6, -7]])
    probs = warp_probs(logits.astype(np.float32), SamplingParams())
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]])
    assert probs.dtype == np.float64
    # Top-k/top-p/min-p do not matter when greedy.
    again = warp_probs(logits, SamplingParams(top_k=2, top_p=0.5, min_p=0.5))
    np.testing.assert_array_equal(again, probs)


def test_warp_probs_masks_and_bad_logits() -> None:
    logits = np.array([0.0, -np.inf, 1.0, -np.inf])
    probs = warp_probs(logits, SamplingParams(temperature=1.0))
    assert probs[1] == 0.0 and probs[3] == 0.0
    np.testing.assert_allclose(probs[[0, 2]], softmax([0.0, 1.0]))
    for bad in ([0.0, np.nan], [np.inf, 0.0], [[0.0, 1.0], [-np.inf, -np.inf]]):
        with pytest.raises(ModelError):
            warp_probs(np.asarray(bad), SamplingParams(temperature=1.0))
        with pytest.raises(ModelError):
            warp_probs(np.asarray(bad), SamplingParams())
    with pytest.raises(InputError):
        warp_probs(np.float64(1.0), SamplingParams())
    with pytest.raises(InputError):
        warp_probs(np.zeros((2, 0)), SamplingParams())


# --------------------------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(InputError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert name in message and "\n" not in message
    assert isinstance(info.value, SpecEdgeError)


def test_sampling_params_defaults_and_greedy() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy
    params = SamplingParams(temperature=1, top_k=5, top_p=1.0, min_p=0.0, seed=0)
    assert not params.greedy
    assert params.make_rng().random() == np.random.default_rng(0).random()


def test_top_p_keeps_the_argmax_when_logits_tie_below_exp_resolution() -> None:
    # Found by hypothesis in CI: exp() makes these four probabilities exactly equal, and the
    # nucleus broke the tie towards id 0 while the logits' argmax is id 3.
    logits = np.array([[0.0, 0.0, 0.0, 1.6462122195908998e-197]])
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert probs[0, 3] > 0
    np.testing.assert_allclose(probs.sum(), 1.0)
