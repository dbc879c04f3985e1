"""Tool calls found in a reply as its text streams (`ToolStream`), giving what
`ToolFormat.parse` (`runtime/tool_calls`) gives on the whole reply: text that may open a call is
held back, and so is whitespace at either end of the reply's text."""

from __future__ import annotations

from .held_text import Trimmed, partial_suffix
from .tool_calls import ToolCall, ToolFormat

__all__ = ["ToolStream"]


class ToolStream:
    """Finds the calls in a reply as its text arrives (`feed` each delta, then `finish`).

    Text that may open a call is held back, and so is whitespace at either end of the reply's
    text, so the content and calls given out add up to what `ToolFormat.parse` finds in the
    whole reply.
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._buffer = ""  # text not decided yet
        self._content = Trimmed()  # the text outside calls
        self._bare: bool | None = None  # a bare format: the reply is calls (True) or text
        self._listed = "before"  # a listed format: before | array (after the tag) | after
        self._named_text = False  # a named format: a call failed, the rest is text

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content to send now, and the calls `text` completed."""
        self._buffer += text
        if not self.fmt.open_tag:
            return self._feed_bare()
        if self.fmt.listed:
            return self._feed_listed()
        if self.fmt.args_tag:
            return self._feed_named()
        opening, closing = self.fmt.open_tag, self.fmt.close_tag
        content, calls = "", list[ToolCall]()
        while True:
            given, start = self._give_until(opening)
            if start < 0:
                return content + given, calls
            content += self._give(self._buffer[:start])
            self._buffer = self._buffer[start:]
            end = self._buffer.find(closing, len(opening))
            if end < 0:
                return content, calls
            stop = end + len(closing)
            call = self.fmt.call_from(self._buffer[len(opening):end])
            if call is None:
                content += self._give(self._buffer[:stop])
            else:
                calls.append(call)
            self._buffer = self._buffer[stop:]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: text held back, and a call the reply left open (when it parses)."""
        rest, self._buffer = self._buffer, ""
        if not self.fmt.open_tag:
            if not self._bare:
                return self._give(rest), []
            found = self.fmt.parse(rest)
            return self._give(found.content or ""), list(found.calls)
        if self.fmt.listed:
            if self._listed != "array":
                return self._give(rest), []
            array = self.fmt.array_after(rest)
            if array is None:  # not calls: the tag and all after it are text
                return self._give(self.fmt.open_tag + rest), []
            return self._give(array[1]), list(array[0])
        if self.fmt.args_tag:  # a call left unfinished is text, as `parse` takes it
            return self._give(rest), []
        if rest.startswith(self.fmt.open_tag):
            call = self.fmt.call_from(rest[len(self.fmt.open_tag):])
            if call is not None:
                return "", [call]
        return self._give(rest), []

    def _feed_listed(self) -> tuple[str, list[ToolCall]]:
        """A listed format: text up to the first tag, then its array (held until it parses as
        calls, or the reply ends), then text."""
        content = ""
        if self._listed == "before":
            opening = self.fmt.open_tag
            given, start = self._give_until(opening)
            if start < 0:
                return given, []
            content = self._give(self._buffer[:start])
            self._buffer, self._listed = self._buffer[start + len(opening):], "array"
        if self._listed == "array":
            head = self._buffer.lstrip()
            if head and head[0] not in "[{":  # no array: the tag and the rest are text
                self._buffer, self._listed = self.fmt.open_tag + self._buffer, "after"
            elif (array := self.fmt.array_after(self._buffer)) is not None:
                self._buffer, self._listed = array[1], "after"
                return content + self._give(self._buffer_out()), list(array[0])
            else:
                return content, []
        return content + self._give(self._buffer_out()), []

    def _feed_named(self) -> tuple[str, list[ToolCall]]:
        """A format whose calls each open with the tag and end with their arguments: text up
        to a tag, then the call (held until it parses, fails, or the reply ends), and so on;
        after a call that fails, text."""
        content, calls, opening = "", list[ToolCall](), self.fmt.open_tag
        while not self._named_text:
            given, start = self._give_until(opening)
            if start < 0:
                return content + given, calls
            body = self._buffer[start + len(opening):]
            found = self.fmt.named_after(body)
            if found is None and not self.fmt.named_fails(body):
                content += self._give(self._buffer[:start])
                self._buffer = self._buffer[start:]
                return content, calls
            if found is None:
                self._named_text = True
            else:
                content += self._give(self._buffer[:start])
                calls.append(found[0])
                self._buffer = found[1]
        return content + self._give(self._buffer_out()), calls

    def _give_until(self, tag: str) -> tuple[str, int]:
        """Where `tag` first starts in the buffer, with "" to send; when it is not there (-1),
        the buffer's text as content to send, all but an end that may begin the tag."""
        start = self._buffer.find(tag)
        if start >= 0:
            return "", start
        keep = partial_suffix(self._buffer, tag)
        given = self._give(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return given, -1

    def _buffer_out(self) -> str:
        text, self._buffer = self._buffer, ""
        return text

    def _feed_bare(self) -> tuple[str, list[ToolCall]]:
        if self._bare is None:
            if not self._buffer.strip():
                return "", []
            self._bare = self._buffer.lstrip().startswith("{")
        if self._bare:
            return "", []  # calls, or text that starts like one: decided at the end
        text, self._buffer = self._buffer, ""
        return self._give(text), []

    def _give(self, text: str) -> str:
        """`text` as content to send (stripped at the reply's ends: `Trimmed`)."""
        return self._content.give(text)
