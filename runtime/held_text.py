"""Text given out as it streams, holding back what is not decided yet: the end of a chunk that
may begin a tag, and whitespace at the ends of a part (`Trimmed`), so that the pieces a stream
gives out add up to what parsing the whole text gives (`runtime/tool_stream.ToolStream`,
`runtime/reasoning.ReasoningStream`)."""

from __future__ import annotations

__all__ = ["Trimmed", "partial_suffix"]


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Trimmed:
    """One part of a streamed text, given out stripped: whitespace before its first
    non-space is dropped, and whitespace after its last is held until more text follows."""

    def __init__(self) -> None:
        self.started = False  # some text was given out
        self._held = ""

    def give(self, text: str) -> str:
        """`text` as it may be sent now."""
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out, self._held = self._held + body, text[len(body):]
        return out
