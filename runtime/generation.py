"""What a generation is asked for and what it returns: `GenerationConfig` (validated once, where
it is built), `GenerationResult` and `BatchResult`, and the checks every entry point applies to
them (`as_config`, `row_configs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .batch import BatchStats
from .detokenize import StopStrings
from .errors import InputError
from .grammar import Grammar
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from .policy import DRAFTER_CHOICES
from .rounds import RowOutput
from .sampling import SamplingParams
from .stats import GenerationStats

# Text, chat messages, or token ids (as the completions API and evaluation harnesses send them).
Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]


def prompt_ids(prompt: object) -> list[int] | None:
    """The token ids of a prompt given as ids (a non-empty sequence of ints), else None."""
    if isinstance(prompt, str | bytes | Mapping) or not isinstance(prompt, Sequence) or \
            not prompt:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate.

    Attributes:
        max_new_tokens: upper bound on generated tokens (1..1_000_000).
        sampling: temperature / top-k / top-p / min-p / seed (temperature 0 = greedy).
        num_draft_tokens: k; None takes the pair's default (from export or `specedge tune`).
        drafter: "model", "ngram", "hybrid" or "none" (target only); None = pair default.
        adaptive: adapt k to measured acceptance and costs; None = pair default.
        stop: stop strings (may span tokens); the text is cut before the stop string. One
            string is one stop string (as the server's `stop`); a list becomes a tuple.
        chat: render a str prompt through the chat template as one user message.
        draft_p_min: the draft model stops proposing at a token it gives less than this
            probability (0 = never; None = the default, `policy.DRAFT_P_MIN`).
        logprobs: None returns no log-probabilities; n in 0..20 returns each generated token's
            (the target's own distribution, before sampling's warping: `runtime/logprobs`)
            with its n most likely alternatives, in `GenerationResult.logprobs`. A greedy row
            then takes its argmax from the float logits it reports (as `--head whole`).
        grammar: structured output (`runtime/grammar`): a JSON schema, any JSON object, a
            regex, a Lark or GBNF grammar, or a choice of strings that the output must match;
            None: free text.
        ignore_eos: eos tokens do not end the generation (benchmarks of fixed lengths).
        stop_token_ids: more tokens that end the generation, as eos does (kept in `tokens`,
            never in the text).
        constrain_thinking: the grammar constrains a reasoning model's thinking too. By
            default a chat the pair renders (messages, or a str prompt with `chat`) of a
            reasoning model keeps its thinking free and the grammar holds for the answer after
            it, as the server does (`prompting.reply_grammar`); a prompt of token ids is
            decoded with the grammar as given.
    """

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int | None = None
    drafter: str | None = None
    adaptive: bool | None = None
    stop: tuple[str, ...] = ()
    chat: bool = False
    draft_p_min: float | None = None
    logprobs: int | None = None
    grammar: Grammar | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    constrain_thinking: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or \
                not 1 <= self.max_new_tokens <= 1_000_000:
            raise InputError(f"max_new_tokens must be an integer in [1, 1000000], got "
                             f"{self.max_new_tokens!r}")
        k = self.num_draft_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64):
            raise InputError(f"num_draft_tokens must be an integer in [1, 64], got {k!r}")
        if self.drafter is not None and self.drafter not in DRAFTER_CHOICES:
            raise InputError(f"drafter must be one of {', '.join(DRAFTER_CHOICES)}, got "
                             f"{self.drafter!r}")
        if isinstance(self.stop, str):  # one stop string, as the server's `stop` takes it
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list | tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        else:
            raise InputError(f"stop must be a string or a list of strings, got {self.stop!r}")
        StopStrings(self.stop)  # validates
        if not isinstance(self.sampling, SamplingParams):
            raise InputError(f"sampling must be a SamplingParams, got {self.sampling!r}")
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise InputError(f"adaptive must be true, false or None, got {self.adaptive!r}")
        if not isinstance(self.chat, bool):
            raise InputError(f"chat must be true or false, got {self.chat!r}")
        p = self.draft_p_min
        if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or
                              not 0.0 <= p < 1.0):
            raise InputError(f"draft_p_min must be a number in [0, 1), got {p!r}")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or
                              not 0 <= n <= MAX_TOP_LOGPROBS):
            raise InputError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}] "
                             f"(the alternatives returned per token), got {n!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.constrain_thinking, bool):
            raise InputError("constrain_thinking must be true or false, got "
                             f"{self.constrain_thinking!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple) or len(ids) > 64 or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InputError(f"stop_token_ids must be a list of at most 64 token ids >= 0, got "
                             f"{ids!r:.60}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InputError(f"grammar must be a Grammar or None, got {self.grammar!r:.60}")


@dataclass(frozen=True)
class GenerationResult:
    """The outcome of one generation."""

    text: str
    tokens: list[int]  # generated token ids (after the prompt)
    prompt_tokens: list[int]
    stop_reason: str  # "eos" | "max_new_tokens" | "context" | "stop"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token, when the config asked

    @classmethod
    def of(cls, output: RowOutput, prompt_ids: list[int], stats: GenerationStats
           ) -> GenerationResult:
        """The result of a finished row (its detokenizer is flushed first: a stop string may
        end in its held-back bytes)."""
        reason = output.finish()
        return cls(text=output.text, tokens=list(output.tokens), prompt_tokens=prompt_ids,
                   stop_reason=reason, stats=stats,
                   logprobs=None if output.top_logprobs is None else list(output.logprobs))


@dataclass(frozen=True)
class BatchResult:
    """The outcome of one batched generation: one result per prompt, in order, and totals."""

    results: list[GenerationResult]
    stats: BatchStats


def as_config(config: object) -> GenerationConfig:
    """`config`, or the default for None; anything else (a dict of options, say) is refused in
    one line instead of failing on a missing attribute later."""
    if config is None:
        return GenerationConfig()
    if not isinstance(config, GenerationConfig):
        raise InputError(f"expected a GenerationConfig (or None), got {type(config).__name__}; "
                         "build one: GenerationConfig(max_new_tokens=..., ...)")
    return config


def row_configs(n: int, configs: GenerationConfig | Sequence[GenerationConfig] | None
                 ) -> Sequence[GenerationConfig]:
    """One config per row of a batch of `n` (one given for all is repeated); the rows must
    share their decoding plan."""
    if configs is None or isinstance(configs, GenerationConfig):
        configs = [as_config(configs)] * n
    if isinstance(configs, str | bytes | Mapping) or not isinstance(configs, Sequence):
        raise InputError(f"expected a GenerationConfig or a list of them, got "
                         f"{type(configs).__name__}")
    configs = [as_config(c) for c in configs]
    if len(configs) != n:
        raise InputError(f"{n} prompts but {len(configs)} configs; give one "
                         "config per prompt or one for all")
    shared = {(c.drafter, c.num_draft_tokens, c.adaptive, c.draft_p_min) for c in configs}
    if len(shared) > 1:
        raise InputError("the rows of a batch share drafter, num_draft_tokens, adaptive and "
                         "draft_p_min; "
                         "per row: sampling, seed, max_new_tokens, stop, chat")
    return configs
