"""A chat reply read as the API returns it: its reasoning (a reasoning model's thinking,
`runtime/reasoning`), its answer, and the tool calls in the answer (`runtime/tool_calls`).

`ReplyReader` reads a streamed reply delta by delta and a whole one alike (`read` is `feed` of
the whole text, then `finish`), so a streamed reply gives out what the whole one holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning import ReasoningFormat, ReasoningStream
from .tool_calls import ToolCall, ToolFormat
from .tool_stream import ToolStream

__all__ = ["ReplyPart", "ReplyReader"]


@dataclass
class ReplyPart:
    """What a piece of a reply gives out: reasoning text, answer text, and the calls that
    closed in it."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: ReplyPart) -> ReplyPart:
        return ReplyPart(self.reasoning + other.reasoning, self.content + other.content,
                         self.calls + other.calls)


class ReplyReader:
    """Reads one reply: `tools` (None: the answer is text only) and `reasoning` (None: no
    thinking to split off; `inside`: the prompt opened the thinking block)."""

    def __init__(self, tools: ToolFormat | None, reasoning: ReasoningFormat | None,
                 inside: bool = False) -> None:
        self._thinking = ReasoningStream(reasoning, inside) if reasoning is not None else None
        self._tools = ToolStream(tools) if tools is not None else None

    @property
    def reasoned(self) -> bool:
        """The reply opened a thinking block (its `reasoning_content` is then given)."""
        return self._thinking is not None and self._thinking.reasoned

    def feed(self, text: str) -> ReplyPart:
        if self._thinking is None:
            return self._answer(text, last=False)
        split = self._thinking.feed(text)
        return ReplyPart(split.reasoning or "").add(self._answer(split.content or "", False))

    def finish(self) -> ReplyPart:
        if self._thinking is None:
            return self._answer("", last=True)
        split = self._thinking.finish()
        return ReplyPart(split.reasoning or "").add(self._answer(split.content or "", True))

    def read(self, text: str) -> ReplyPart:
        """A whole reply."""
        return self.feed(text).add(self.finish())

    def _answer(self, text: str, last: bool) -> ReplyPart:
        if self._tools is None:
            return ReplyPart(content=text)
        content, calls = self._tools.feed(text)
        if last:
            more, closed = self._tools.finish()
            content, calls = content + more, calls + closed
        return ReplyPart(content=content, calls=calls)
