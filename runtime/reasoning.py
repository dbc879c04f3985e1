"""A reasoning model's reply split into its thinking and its answer.

Reasoning models write their thinking between tags before the answer: `<think>` and
`</think>` (Qwen3, SmolLM3, the DeepSeek-R1 distills), `[THINK]` and `[/THINK]` (Magistral,
Ministral 3's reasoning models; tokens of their own). The server returns it apart, as
DeepSeek's API, vLLM's reasoning parsers and llama.cpp's server do: `message.reasoning_content`
beside `message.content` (streamed as `delta.reasoning_content`), and tool calls are read from
the answer only. A pair is a reasoning model when its chat template holds both tags of a format
(data, as `ToolFormat` markers are); a template whose generation prompt already opens the block
(R1 distills; Qwen3 with `enable_thinking: false` closes it empty instead) starts the reply
inside it, which `opened_by` tells from the rendered prompt's end.

A reply that starts with the open tag (after whitespace), or inside a block the prompt opened,
is reasoning up to the close tag (all of it when the reply ends first: cut by `max_tokens`),
the rest is the answer; any other reply is all answer. `ReasoningStream` gives, delta by delta,
what `split` gives on the whole text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from .held_text import Trimmed, partial_suffix

__all__ = ["MISTRAL_THINK", "REASONING_FORMATS", "THINK", "ReasoningFormat", "ReasoningStream",
           "Split", "Thinking"]


@dataclass(frozen=True)
class Split:
    """A reply's thinking and its answer (None when empty)."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningFormat:
    """The tags around a model's thinking."""

    open_tag: str = "<think>"
    close_tag: str = "</think>"

    @classmethod
    def for_template(cls, source: str | None) -> ReasoningFormat | None:
        """The format a chat template's model writes: the first of `REASONING_FORMATS` whose
        two tags the template holds (None: the model is not a reasoning model)."""
        return next((f for f in REASONING_FORMATS
                     if source and f.open_tag in source and f.close_tag in source), None)

    def opened_by(self, prompt: str) -> bool:
        """Whether the rendered `prompt` ends inside a thinking block (its generation prompt
        opened one), so that the reply starts as reasoning."""
        return prompt.rfind(self.open_tag) > prompt.rfind(self.close_tag)

    def split(self, text: str, inside: bool = False) -> Split:
        """The reasoning and answer of a whole reply (`inside`: the prompt opened the block)."""
        stream = ReasoningStream(self, inside)
        parts = [stream.feed(text), stream.finish()]
        reasoning = "".join(p.reasoning or "" for p in parts)
        content = "".join(p.content or "" for p in parts)
        return Split(reasoning or None, content or None)


@dataclass(frozen=True)
class Thinking:
    """The thinking a reply starts with, before the text a grammar constrains: a block in
    `fmt`'s tags, required when the prompt opened it (`inside`: only its rest and the close
    tag), optional otherwise (a reply may answer straight away)."""

    fmt: ReasoningFormat
    inside: bool = False

    def lark(self, token_of: Callable[[str], int | None]) -> str:
        """llguidance Lark rules defining `lead`: the thinking and the whitespace after it
        (up to 8 ASCII characters: models write a blank line or two).

        Args:
            token_of: a tag's token id when the tokenizer has it as one token of its own
                (llguidance then matches it only as that token), else None.
        """
        close = token_of(self.fmt.close_tag)
        if close is None:  # a text tag: the thinking ends at its first occurrence
            rules = f"thought[suffix={json.dumps(self.fmt.close_tag)}]: /(?s:.*)/\n"
            body = "thought"
        else:
            rules = (f"THOUGHT: ANY & ~(ANY {json.dumps(self.fmt.close_tag)} ANY)\n"
                     "ANY: /(?s:.*)/\n")
            body = f"THOUGHT <[{close}]>"
        if not self.inside:
            opening = token_of(self.fmt.open_tag)
            body = (f"<[{opening}]>" if opening is not None
                    else json.dumps(self.fmt.open_tag)) + " " + body
        block = f"{body} /[ \\t\\r\\n]{{0,8}}/"  # bounded: no endless run of whitespace
        return f"lead: {block if self.inside else f'({block})?'}\n{rules}"


class ReasoningStream:
    """Splits a reply as its text arrives (`feed` each delta, then `finish`): text that may
    be a tag is held back, and so is whitespace at the ends of the reasoning and at the start
    of the answer, so the pieces add up to `ReasoningFormat.split` of the whole reply."""

    def __init__(self, fmt: ReasoningFormat, inside: bool = False) -> None:
        self.fmt = fmt
        self._state = "thinking" if inside else "start"  # start | thinking | answer
        self.reasoned = inside  # the reply has a reasoning part
        self._buffer = ""  # text not decided yet
        self._reasoning = Trimmed()
        self._answered = False  # some answer was given out

    def feed(self, text: str) -> Split:
        """The reasoning and answer text `text` lets out now."""
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            head = self._buffer.lstrip()
            if not head or (len(head) < len(self.fmt.open_tag)
                            and self.fmt.open_tag.startswith(head)):
                return Split(None, None)  # may still open a block
            self._state = "answer"
            if head.startswith(self.fmt.open_tag):
                self._state, self.reasoned = "thinking", True
                self._buffer = head[len(self.fmt.open_tag):]
        if self._state == "thinking":
            end = self._buffer.find(self.fmt.close_tag)
            if end < 0:
                keep = partial_suffix(self._buffer, self.fmt.close_tag)
                reasoning = self._reasoning.give(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return Split(reasoning or None, None)
            reasoning = self._reasoning.give(self._buffer[:end])
            self._buffer = self._buffer[end + len(self.fmt.close_tag):]
            self._state = "answer"
        content, self._buffer = self._answer_text(self._buffer), ""
        return Split(reasoning or None, content or None)

    def finish(self) -> Split:
        """What is left at the end of the reply."""
        rest, self._buffer = self._buffer, ""
        if self._state == "thinking":  # cut inside the block: all of it was reasoning
            return Split(self._reasoning.give(rest) or None, None)
        return Split(None, self._answer_text(rest) or None)

    def _answer_text(self, text: str) -> str:
        """The answer without the whitespace before it (its end is the model's)."""
        if not self._answered:
            text = text.lstrip()
            self._answered = bool(text)
        return text


THINK = ReasoningFormat()
MISTRAL_THINK = ReasoningFormat("[THINK]", "[/THINK]")
REASONING_FORMATS = (THINK, MISTRAL_THINK)

