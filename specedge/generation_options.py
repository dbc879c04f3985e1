"""The generation options `generate` and `chat` share: sampling, penalties, structured output,
drafting, where to stop; one frozen `GenerationOptions` that makes the `GenerationConfig`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specedge.cli_base import (
    MIN_P,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    collect_options,
    max_new_tokens_option,
)
from specedge.runtime.errors import InputError
from specedge.runtime.pair import DRAFTER_CHOICES

if TYPE_CHECKING:
    from specedge.runtime.grammar import Grammar
    from specedge.runtime.pair import GenerationConfig

__all__ = ["GenerationOptions", "generation_options"]


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """The generation options shared by `generate` and `chat`."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_draft_tokens: int | None = None
    drafter: str | None = None
    no_speculation: bool = False
    adaptive: bool | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[str, ...] = ()  # "TOKEN_ID=BIAS" each
    json_schema: str | None = None  # inline JSON or a file's path
    regex: str | None = None
    grammar: str | None = None  # Lark or GBNF, inline or a file's path
    min_tokens: int = 0
    ignore_eos: bool = False
    constrain_thinking: bool = False

    def config(self, chat: bool) -> GenerationConfig:
        """The `GenerationConfig` (validated there: bad values raise InputError)."""
        from specedge.runtime.pair import GenerationConfig
        from specedge.runtime.sampling import SamplingParams, logit_bias_from_json

        sampling = SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                  top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                                  presence_penalty=self.presence_penalty,
                                  frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty,
                                  logit_bias=logit_bias_from_json(_bias_option(self.logit_bias)),
                                  min_tokens=self.min_tokens)
        return GenerationConfig(max_new_tokens=self.max_new_tokens, sampling=sampling,
                                num_draft_tokens=self.num_draft_tokens,
                                drafter="none" if self.no_speculation else self.drafter,
                                adaptive=self.adaptive, stop=self.stop, chat=chat,
                                grammar=self._grammar(), ignore_eos=self.ignore_eos,
                                constrain_thinking=self.constrain_thinking)

    def _grammar(self) -> Grammar | None:
        from specedge.runtime.grammar import Grammar

        given = [(kind, value) for kind, value in (("json_schema", self.json_schema),
                                                   ("regex", self.regex),
                                                   ("grammar", self.grammar))
                 if value is not None]
        if len(given) > 1:
            raise InputError("give one of --json-schema, --regex and --grammar")
        if not given:
            return None
        kind, value = given[0]
        return Grammar(kind, value if kind == "regex" else _text_or_file(value))


def _text_or_file(value: str) -> str:
    """An option's text, or the text of the file it names."""
    path = Path(value)
    try:
        if len(value) < 4096 and path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {value}: {exc}") from None
    return value


def _bias_option(items: tuple[str, ...]) -> dict[str, float]:
    """`--logit-bias TOKEN_ID=BIAS` values as a JSON-shaped `logit_bias` (checked there)."""
    out: dict[str, float] = {}
    for item in items:
        key, _, bias = item.partition("=")
        try:
            out[key.strip()] = float(bias)
        except ValueError:
            raise InputError(f"--logit-bias takes TOKEN_ID=BIAS (e.g. 2=-100 bans token 2), got "
                             f"{item!r}") from None
    return out


generation_options = collect_options("generation", GenerationOptions, [
    max_new_tokens_option(128),
    TEMPERATURE,
    TOP_K,
    TOP_P,
    MIN_P,
    click.option("--seed", default=None, type=int, help="Seed of the sampler."),
    click.option("--num-draft-tokens", "-k", default=None, type=int,
                 help="Draft length K (default: the pair's)."),
    click.option("--drafter", default=None, type=click.Choice(DRAFTER_CHOICES)),
    click.option("--no-speculation", is_flag=True, help="Target-only decoding."),
    click.option("--adaptive/--fixed-k", default=None,
                 help="Adapt K to measured acceptance and cost (default: the pair's)."),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    click.option("--presence-penalty", default=0.0, show_default=True, type=float,
                 help="Subtracted from the logit of each token the output holds (-2..2)."),
    click.option("--frequency-penalty", default=0.0, show_default=True, type=float,
                 help="Subtracted once per occurrence in the output (-2..2)."),
    click.option("--repetition-penalty", default=1.0, show_default=True, type=float,
                 help="Divides positive (multiplies negative) logits of tokens in the prompt "
                      "or output (0..10, 1 = off)."),
    click.option("--logit-bias", multiple=True, metavar="TOKEN_ID=BIAS",
                 help="Added to that token's logit (-100..100; repeatable)."),
    click.option("--min-tokens", default=0, show_default=True, type=int,
                 help="No eos before this many tokens."),
    click.option("--ignore-eos", is_flag=True, help="Do not stop at eos (fixed-length runs)."),
    click.option("--json-schema", default=None, metavar="SCHEMA|FILE",
                 help="Structured output: JSON matching this schema (inline or a file)."),
    click.option("--regex", default=None, metavar="RE",
                 help="Structured output: text matching this regular expression."),
    click.option("--grammar", default=None, metavar="GRAMMAR|FILE",
                 help="Structured output: a Lark or llama.cpp GBNF grammar (inline or a file)."),
    click.option("--constrain-thinking", is_flag=True,
                 help="Structured output (and a forced --tool-choice) constrains a reasoning "
                      "model's thinking too; by default, in a chat, it constrains the answer "
                      "after the thinking, which stays free (as serve does)."),
])
