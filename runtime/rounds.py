"""One speculative round, written once: how a row samples, verifies, commits and stops.

Batch-1 decoding (`speculative.decode`) and batched decoding (`batch.BatchDecoder`) both call
these pieces; only the scheduling around them differs, so "a batch row equals batch 1" holds by
construction:

- `RowSampler`: a row's randomness. Greedy takes the argmax (from the logits, or from argmax
  ids the backend computed on the device: `verify_ids`). Seeded sampling is position-keyed:
  the token at output position n is `argmax(p_n / E_n)` with `E_n` i.i.d. Exp(1) noise drawn
  from (seed, n) alone (the Gumbel-max / exponential-race trick), so it is an exact sample of the
  target's warped distribution and the same seed gives the same text for every K, drafter and
  batch composition: the draft samples with the same noise and the target's choice is checked
  greedily. Unseeded sampling uses the rejection rule of Leviathan et al. 2023 / Chen et al. 2023
  (`acceptance.accept_sample`), which accepts most often.
- `RowOutput`: the eos / token budget / stop-string cut, applied token by token, so the result
  (text, tokens, reason) is what target-only decoding gives, whatever K and drafter; and the
  kept tokens' log-probabilities when the row asks for them (`runtime/logprobs`).
- `fed_prefix`: how much of a draft cache survives a commit (rollback by length).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .acceptance import (
    accept_greedy,
    accept_greedy_ids,
    accept_greedy_rows,
    accept_sample_rows,
    sample_token,
)
from .detokenize import IncrementalDetokenizer, StopStrings
from .errors import InputError
from .grammar import GrammarState
from .logprobs import TokenLogprob, token_logprobs
from .penalties import penalize, prompt_tokens, suppress_stops
from .policy import DecodePlan
from .sampling import SamplingParams, warp_probs
from .text import Tokenizer

__all__ = ["RowOutput", "RowSampler", "fed_prefix", "needs_logits"]


class RowSampler:
    """How one row turns logits into tokens: greedy, seeded (position-keyed) or random.

    Args:
        params: the row's sampling parameters.
        vocab_size: the target's vocabulary (the noise covers every token id).
        prompt: the prompt's tokens (the repetition penalty counts them).
        grammar: the row's structured-output matcher (`runtime/grammar`), or None.
        stop_ids: the tokens that end the row (eos, stop token ids), banned before
            `params.min_tokens`.

    Raises:
        InputError: if `params.logit_bias` names a token id outside the vocabulary.
    """

    def __init__(self, params: SamplingParams, vocab_size: int,
                 prompt: Sequence[int] = (), grammar: GrammarState | None = None,
                 stop_ids: Iterable[int] = ()) -> None:
        self.params, self.vocab_size, self.grammar = params, vocab_size, grammar
        self.stop_ids = np.asarray(sorted(int(t) for t in stop_ids), np.int64)
        outside = [t for t, _ in params.logit_bias if t >= vocab_size]
        if outside:
            raise InputError(f"logit_bias names token id {outside[0]}, but the vocabulary has "
                             f"{vocab_size} ids (0..{vocab_size - 1})")
        self.prompt = prompt_tokens(prompt, params)
        self.seeded = not params.greedy and params.seed is not None
        # Unseeded sampling draws from fresh entropy; seeded sampling needs no generator.
        self.rng = params.make_rng() if not params.greedy and not self.seeded else None
        self._noise: dict[int, np.ndarray] = {}

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def adjusts_logits(self) -> bool:
        """Whether the row's logits depend on its context (bias, penalties, a grammar): no
        argmax shortcut then."""
        return self.params.adjusts_logits or self.grammar is not None

    def noise(self, position: int) -> np.ndarray:
        """Exp(1) noise `[vocab]` of output position `position` (seeded rows only)."""
        e = self._noise.get(position)
        if e is None:
            assert self.params.seed is not None
            gen = np.random.Generator(np.random.Philox(
                key=np.asarray([self.params.seed % 2**64, position], dtype=np.uint64)))
            e = gen.standard_exponential(self.vocab_size)
            self._noise[position] = e
        return e

    def forget(self, below: int) -> None:
        """Drop the noise of positions already committed (below `below`)."""
        for pos in [p for p in self._noise if p < below]:
            del self._noise[pos]

    def _race(self, probs: np.ndarray, position: int, ids: np.ndarray | None) -> int:
        e = self.noise(position)
        return int(np.argmax(probs / (e if ids is None else e[ids])))

    def draft_token(self, logits: np.ndarray, position: int, ids: np.ndarray | None = None,
                    history: Sequence[int] = ()) -> tuple[int, np.ndarray | None, float]:
        """Pick the draft token for `position` from draft logits `[draft_vocab]`.

        `ids` maps a reduced draft head's logits to token ids (None: the full vocabulary).
        `history`: the output before `position` (drafts included), for the penalties: the
        draft proposes from logits biased and penalized as the target will verify them
        (acceptance only; exactness holds either way).
        Returns the token; for random sampling, the full-vocabulary draft distribution it was
        drawn from (None otherwise: greedy and seeded verification need no draft
        probabilities); and the draft's confidence, its largest probability (what a
        confidence cut-off compares, as llama.cpp's `--draft-p-min`); -1 when the row's
        grammar allows none of the draft's tokens (drafting stops).
        """
        if self.params.adjusts_logits:
            logits = self._penalized_draft(logits, ids, history)
        if self.grammar is not None:
            logits = self.grammar.constrain_draft(logits, ids, history)
            if not np.isfinite(logits).any():
                return -1, None, -1.0  # the draft has no token the grammar allows: stop
        if position < self.params.min_tokens:
            logits = self._suppressed_draft(logits, ids, position)
        if self.params.greedy:
            pick = int(np.argmax(logits))
            z = np.asarray(logits, np.float64) - float(logits[pick])
            return (pick if ids is None else int(ids[pick])), None, float(1.0 / np.exp(z).sum())
        p = warp_probs(logits, self.params)
        confidence = float(p.max())
        if self.seeded:
            pick = self._race(p, position, ids)
            return (pick if ids is None else int(ids[pick])), None, confidence
        assert self.rng is not None
        pick = sample_token(p, self.rng)
        if ids is None:
            return pick, p, confidence
        full = np.zeros(self.vocab_size)
        full[ids] = p
        return int(ids[pick]), full, confidence

    def _suppressed_draft(self, logits: np.ndarray, ids: np.ndarray | None,
                          position: int) -> np.ndarray:
        """Draft logits with the stop tokens banned (`penalties.suppress_stops`; a reduced
        head's columns are the token ids `ids`)."""
        if ids is None:
            return suppress_stops(logits[None], position, self.params.min_tokens,
                                  self.stop_ids)[0]
        mine = np.flatnonzero(np.isin(ids, self.stop_ids))
        return suppress_stops(logits[None], position, self.params.min_tokens, mine)[0]

    def _penalized_draft(self, logits: np.ndarray, ids: np.ndarray | None,
                         history: Sequence[int]) -> np.ndarray:
        """Draft logits `[draft_vocab]` with the penalties of `history` (`penalties.penalize`;
        a reduced head's columns are the token ids `ids`)."""
        if ids is None:
            return penalize(logits[None], history, (), self.params, self.prompt)[0]
        full = np.full(self.vocab_size, -np.inf)
        full[ids] = logits
        return penalize(full[None], history, (), self.params, self.prompt)[0][ids]

    def forced(self, history: Sequence[int], limit: int) -> list[int]:
        """Tokens the row's grammar forces after the output `history` (at most `limit`; none
        without a grammar): a model drafter drafts them without a call."""
        return self.grammar.forced(history, limit) if self.grammar is not None else []

    def allowed(self, history: Sequence[int], drafts: list[int]) -> list[int]:
        """The drafts up to the first one the row's grammar forbids after the output
        `history` (all of them without a grammar): an n-gram hit that leaves the grammar is
        cut there, since verification would reject the rest."""
        if self.grammar is None or not drafts:
            return drafts
        return drafts[:self.grammar.allowed_prefix(history, drafts)]

    def certain(self, token: int) -> np.ndarray | None:
        """The draft distribution of a token drafted with certainty (a grammar's forced
        token): one-hot `[vocab]` for a row that samples without a seed (its verification
        reads draft probabilities), None for the others."""
        if self.rng is None:
            return None
        p = np.zeros(self.vocab_size)
        p[token] = 1.0
        return p

    def verify_ids(self, drafts: np.ndarray, target_ids: np.ndarray) -> np.ndarray:
        """Greedy verification from the target's argmax ids `[n + 1]` (a greedy row's logits
        need not reach the host); the same tokens as `verify` on the logits."""
        assert self.params.greedy, "only greedy rows verify from argmax ids"
        return accept_greedy_ids(drafts, target_ids)

    def verify(self, drafts: np.ndarray, draft_probs: np.ndarray | None, logits: np.ndarray,
               position: int, history: Sequence[int] = ()) -> np.ndarray:
        """Verify `drafts` `[n]` against target logits `[n + 1, vocab]` (the first row predicts
        output position `position`); returns the accepted drafts and one more token `[a + 1]`.

        `draft_probs` `[n, vocab]` is needed for random sampling with a model draft; None means
        deterministic proposals (n-gram), i.e. one-hot draft distributions. `history`: the
        output's tokens before `position`, which the penalties count (with the drafts before
        each row: `penalties.penalize`).
        """
        logits = penalize(logits, history, drafts, self.params, self.prompt)
        if self.grammar is not None:
            logits = self.grammar.constrain(logits, history, drafts)
        logits = suppress_stops(logits, position, self.params.min_tokens, self.stop_ids)
        if self.params.greedy:
            return accept_greedy(drafts, logits)
        # Each row of logits is warped only when the rule reaches its position: it stops at
        # the first rejection (the rows after it cost 0.1-0.7 ms each for nothing).
        params, vocab = self.params, logits.shape[-1]

        def target_row(i: int) -> np.ndarray:  # [vocab]
            return warp_probs(logits[i:i + 1], params)[0]

        if self.seeded:  # the exponential race of each position, checked greedily
            return accept_greedy_rows(np.asarray(drafts, np.int64), lambda i: int(
                np.argmax(target_row(i) / self.noise(position + i))))
        assert self.rng is not None

        def one_hot(i: int) -> np.ndarray:  # a deterministic proposal's distribution
            row = np.zeros(vocab)
            row[drafts[i]] = 1.0
            return row

        return accept_sample_rows(np.asarray(drafts, np.int64),
                                  one_hot if draft_probs is None else draft_probs.__getitem__,
                                  target_row, self.rng)


class RowOutput:
    """A row's output: the tokens and text kept so far and why the row stopped.

    Tokens are cut token by token, as target-only decoding would: at the token budget, after an
    eos token (kept in `tokens`, never in the text), or after the token whose text completes a
    stop string (the text is cut where the earliest stop string begins). Without a tokenizer
    only tokens are tracked (stop strings need text).

    Args:
        max_new_tokens: the token budget.
        eos_token_ids: tokens that end the generation.
        tokenizer, prompt_ids: for the text (incremental, multi-byte safe); None: tokens only.
        stop: stop strings.
        top_logprobs: None keeps no log-probabilities; n >= 0 keeps each kept token's, with
            its n most likely alternatives (`logprobs`, one per token of `tokens`).
    """

    def __init__(self, max_new_tokens: int, eos_token_ids: Sequence[int], *,
                 tokenizer: Tokenizer | None = None, prompt_ids: Sequence[int] = (),
                 stop: Sequence[str] = (), top_logprobs: int | None = None) -> None:
        self.max_new_tokens = max_new_tokens
        self.top_logprobs = top_logprobs
        self.logprobs: list[TokenLogprob] = []
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.stops = StopStrings(list(stop))
        if self.stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_ids=list(prompt_ids))
                      if tokenizer is not None else None)
        self.tokens: list[int] = []
        self.text = ""
        self.reason: str | None = None
        self._searched = 0  # text[:_searched] holds no stop string
        self._shown = 0  # characters handed out by `delta`
        self._flushed = False

    @property
    def done(self) -> bool:
        return self.reason is not None

    def push(self, new: Sequence[int] | np.ndarray, logits: np.ndarray | None = None
             ) -> list[int]:
        """Add one round's committed tokens; returns the ones kept (a prefix of `new`).

        `logits` `[len(new), vocab]`: the target's logits that produced them, for a row that
        keeps log-probabilities (see `needs_logits`)."""
        kept = self._push(new)
        if self.top_logprobs is not None and kept:
            assert logits is not None, "a row keeping logprobs needs its logits"
            self.logprobs.extend(token_logprobs(logits[:len(kept)], kept, self.top_logprobs))
        return kept

    def _push(self, new: Sequence[int] | np.ndarray) -> list[int]:
        kept: list[int] = []
        for t in new:
            if self.reason is not None:
                break
            if len(self.tokens) >= self.max_new_tokens:
                self.reason = "max_new_tokens"
                break
            self.tokens.append(int(t))
            kept.append(int(t))
            if int(t) in self.eos:
                self.reason = "eos"
            elif self.detok is not None:
                self.text += self.detok.push(int(t))
                self._check_stop()
        if self.reason is None and len(self.tokens) >= self.max_new_tokens:
            self.reason = "max_new_tokens"
        return kept

    def _check_stop(self) -> None:
        if self.stops and (cut := self.stops.find(self.text, self._searched)) is not None:
            self.text, self.reason = self.text[:cut], "stop"
        self._searched = len(self.text)

    def stop_at(self, reason: str) -> None:
        """End the row for a reason the loop decides (e.g. "context")."""
        if self.reason is None:
            self.reason = reason

    def finish(self) -> str:
        """Flush the detokenizer (a stop string may end in its held-back bytes); the reason."""
        if self.reason is None:
            self.reason = "max_new_tokens"
        if self.detok is not None and self.reason != "stop" and not self._flushed:
            self._flushed = True
            self.text += self.detok.flush()
            self._check_stop()
        return self.reason

    def delta(self) -> str:
        """Text not handed out yet that no later token can change (stop-string prefixes and
        unfinished characters are held back until the row decides them)."""
        safe = len(self.text)
        # A stop-string prefix stays held back until `finish`: after the last token, the
        # detokenizer's flush (an unfinished character becomes U+FFFD) may still complete a stop
        # string and cut the text before what a delta would have handed out.
        if self.stops and self.reason != "stop" and not self._flushed:
            safe -= self.stops.holdback(self.text)
        if safe <= self._shown:
            return ""
        out = self.text[self._shown:safe]
        self._shown = safe
        return out


def needs_logits(sampler: RowSampler, output: RowOutput) -> bool:
    """Whether a row's verification needs the target's logits on the host: sampled rows, and
    greedy rows that keep log-probabilities or adjust their logits (others take argmax ids,
    maybe from the device)."""
    return not sampler.greedy or output.top_logprobs is not None or sampler.adjusts_logits


def fed_prefix(fed: list[int], tokens: Sequence[int], stable: int = 0) -> int:
    """How many fed tokens stay valid after a commit: the common prefix of `fed` and the
    committed `tokens`, at most `len(tokens) - 1` (the last token is fed next round).
    `fed[:stable]` is known to be committed already and is not compared again."""
    keep = min(len(fed), len(tokens) - 1)
    n = min(stable, keep)
    while n < keep and fed[n] == tokens[n]:
        n += 1
    return n


def tokens_left(output: RowOutput, n_tokens: int, limit: int) -> int:
    """The most tokens a row holding `n_tokens` (prompt + committed) may still generate: its
    remaining budget within the context limit (eos or a stop string may end it sooner)."""
    return max(0, min(output.max_new_tokens - len(output.tokens), limit - n_tokens))


def round_k(k: int, output: RowOutput, n_tokens: int, limit: int) -> int:
    """The draft length a row can use this round: a round commits at most k + 1 tokens, which
    must fit the row's remaining budget and the context limit."""
    return max(0, min(k, tokens_left(output, n_tokens, limit) - 1))


def draft_budget(plan: DecodePlan, k: int, output: RowOutput, n_tokens: int,
                 limit: int, free_hits: bool = False) -> tuple[int, int]:
    """(k for model drafts, k for free n-gram drafts) of a round, given the tuner's k.

    Hybrid drafting lets n-gram hits run to the plan's full K whatever k > 0 the tuner chose for
    the draft model: they cost no draft steps, so the tuner's cost model does not apply to them
    (capping them at the model's best k lost most of what they gain). When the tuner chose
    k = 0, free hits run only where `free_hits` says they still pay (`AdaptiveK.free_hits_pay`,
    batch 1): they cost a verification of k + 1 positions, which an int8 target once lost 8%
    to, and where the draft model loses they are all that speculation gains (the same int8
    target at k = 0: 1.10-1.14x with them, 0.97-1.00x without, `docs/results/
    hybrid_adaptive.md`). A batch stops them at k = 0: its plain rounds measure plain decoding
    for the realized-rate check, which hits in the same rounds would blur."""
    if plan.drafter == "none":
        return 0, 0
    own = round_k(k, output, n_tokens, limit)
    hybrid_free = plan.drafter == "hybrid" and (k > 0 or not plan.adaptive or free_hits)
    free = round_k(plan.k, output, n_tokens, limit) if hybrid_free else own
    return own, free


def tuned_round(plan: DecodePlan, proposal: object | None) -> bool:
    """Whether a round's k came from the tuner (so it should learn from the round): not a
    hybrid round whose drafts were a free n-gram hit."""
    return not (plan.drafter == "hybrid" and getattr(proposal, "free", False))
