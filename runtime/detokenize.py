"""Streaming text: generated ids to text deltas, and stop strings across token boundaries.

* `IncrementalDetokenizer` turns a growing stream of generated ids into text deltas, holding back
  bytes of a multi-byte character that is split across byte-level tokens (the sliding window of
  HF TGI and vLLM).
* `StopStrings` finds stop strings that may span token boundaries, and tells a streaming caller
  how many trailing characters it must hold back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .errors import InputError
from .text import check_text

if TYPE_CHECKING:
    from .text import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopStrings"]

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas.

    Correct for multi-byte characters split across tokens (byte-level BPE): like HF TGI and vLLM
    it decodes a small sliding window, `decode(ids[prefix:])` against `decode(ids[prefix:read])`,
    and emits the new text only once it does not end with the replacement character U+FFFD (an
    incomplete character). The prefix tokens give the decoder context (e.g. SentencePiece's
    leading-space handling). The window is dropped as text is emitted, so each push costs a
    decode of a few tokens, never of the whole text.

    For any id sequence, `"".join(deltas) + flush()` equals `tokenizer.decode(ids)` (with the
    same `skip_special_tokens`) for decoders that work byte by byte, such as byte-level BPE. A
    byte sequence that stays invalid for more than `max_pending` tokens is emitted as U+FFFD.
    """

    #: Prompt ids kept as decoding context when `prompt_ids` is given (as vLLM does).
    PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
        max_pending: int = 32,
    ) -> None:
        """Starts an empty stream.

        Args:
            tokenizer: The tokenizer.
            skip_special_tokens: Leave special tokens out of the text.
            prompt_ids: The prompt, whose last few ids serve as decoding context; none of its
                text is emitted.
            max_pending: Emit held-back text anyway once this many tokens are waiting (bounds
                the window for streams of invalid bytes or of skipped special tokens).
        """
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._max_pending = max(1, int(max_pending))
        context = [int(i) for i in prompt_ids][-self.PROMPT_CONTEXT :] if prompt_ids else []
        # The window holds ids[prefix:]; `_read` is the read offset inside it.
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text = self._decode(context) if context else ""
        self._parts: list[str] = []
        self._text_cache: str | None = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, new_text: str) -> str:
        """Emits the text after the prefix and slides the window past the emitted tokens."""
        delta = new_text[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window) if self._window else ""
        if delta:
            self._parts.append(delta)
            self._text_cache = None
        return delta

    def push(self, token_id: int) -> str:
        """Adds one generated id.

        Args:
            token_id: The id.

        Returns:
            The new text ('' while a character is incomplete).
        """
        self._window.append(int(token_id))
        new_text = self._decode(self._window)
        pending = len(self._window) - self._read
        if new_text.endswith(_REPLACEMENT_CHAR) and pending < self._max_pending:
            return ""
        if len(new_text) > len(self._prefix_text):
            return self._emit(new_text)
        # Nothing visible yet (e.g. a skipped special token): keep the context, move on.
        self._read = len(self._window)
        self._prefix_text = new_text
        if len(self._window) > 4 * self._max_pending:
            return self._emit(new_text)
        return ""

    def push_many(self, ids: Sequence[int]) -> str:
        """Adds several generated ids.

        Args:
            ids: The ids, in order.

        Returns:
            The new text they complete.
        """
        return "".join([self.push(i) for i in ids])

    def flush(self) -> str:
        """Emits whatever is held back (an incomplete character comes out as U+FFFD).

        Returns:
            The held-back text.
        """
        if len(self._window) == self._read:
            return ""
        self._read = len(self._window)
        return self._emit(self._decode(self._window))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            joined = "".join(self._parts)
            self._parts = [joined]
            self._text_cache = joined
        return self._text_cache


class StopStrings:
    """Detects stop strings that may span token boundaries in the emitted text."""

    def __init__(self, stops: Sequence[str]) -> None:
        """Stores the stop strings.

        Args:
            stops: The stop strings (may be empty; duplicates are ignored).

        Raises:
            InputError: If a stop string is empty or not a string, or `stops` is one string.
        """
        if isinstance(stops, str):
            raise InputError(f"stop strings must be a list of strings, got the string {stops!r}")
        unique: list[str] = []
        for stop in stops:
            if not isinstance(stop, str):
                raise InputError(f"stop strings must be strings, got {type(stop).__name__}")
            if not stop:
                raise InputError("stop strings must be non-empty")
            check_text(stop, f"the stop string {stop!r}")
            if stop not in unique:
                unique.append(stop)
        self._stops = tuple(unique)
        self._longest = max((len(s) for s in unique), default=0)

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings."""
        return self._stops

    @property
    def longest(self) -> int:
        """Length of the longest stop string (0 if none)."""
        return self._longest

    def __bool__(self) -> bool:
        return bool(self._stops)

    def find(self, text: str, start: int = 0) -> int | None:
        """Finds the earliest stop string in `text`.

        Only text from `max(0, start - longest + 1)` on is searched, so a caller that already
        searched `text[:start]` passes `start=len(old_text)` and still finds a stop string that
        spans the boundary.

        Args:
            text: The text emitted so far.
            start: Where the not-yet-searched text begins.

        Returns:
            The index where the earliest stop string begins, or None.
        """
        begin = max(0, start - self._longest + 1)
        best: int | None = None
        for stop in self._stops:
            index = text.find(stop, begin)
            if index >= 0 and (best is None or index < best):
                best = index
        return best

    def holdback(self, text: str) -> int:
        """Counts the trailing characters that could be the start of a stop string.

        A streaming caller must not show those characters until more text decides them.

        Args:
            text: The text emitted so far.

        Returns:
            The number of trailing characters to hold back (less than `longest`).
        """
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
