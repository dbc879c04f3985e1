"""Text side of the runtime: tokenizer, chat template, streaming detokenizer and stop strings.

Everything here is torch-free and transformers-free: it uses the `tokenizers` library for the
tokenizer itself and a sandboxed `jinja2` environment for the chat template, exactly as exported
by Hugging Face transformers next to the model (`tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`).

* `Tokenizer` loads a pair's tokenizer folder, encodes and decodes ids and renders the chat
  template.
* `IncrementalDetokenizer` turns a growing stream of generated ids into text deltas, holding back
  bytes of a multi-byte character that is split across byte-level tokens.
* `StopStrings` finds stop strings that may span token boundaries, and tells a streaming caller
  how many trailing characters it must hold back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from .errors import InputError, ManifestError

__all__ = ["IncrementalDetokenizer", "StopStrings", "Tokenizer"]

_REPLACEMENT_CHAR = "\ufffd"


def _token_text(value: Any) -> str | None:
    """Returns the text of a special token as stored in `tokenizer_config.json`.

    The value is either a plain string or a serialized `AddedToken` (a dict with `content`).

    Args:
        value: The raw JSON value.

    Returns:
        The token text, or None when the value is absent or of another type.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _pick_chat_template(value: Any) -> str | None:
    """Returns the chat template stored in `tokenizer_config.json`, if any.

    Args:
        value: The raw `chat_template` value: a string, or a list of `{name, template}` dicts
            from which the one named "default" is picked.

    Returns:
        The template source, or None when there is no usable template.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if (
                isinstance(entry, Mapping)
                and entry.get("name") == "default"
                and isinstance(entry.get("template"), str)
            ):
                return str(entry["template"])
    return None


def _raise_exception(message: Any) -> NoReturn:
    """The `raise_exception` global of chat templates: rejects the conversation.

    Args:
        message: The template's message.

    Raises:
        InputError: Always.
    """
    raise InputError(f"the chat template rejected the messages: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    """The `tojson` filter as transformers defines it (no HTML escaping, unlike jinja2's).

    Args:
        value: The value to serialize.
        ensure_ascii: Escape non-ASCII characters.
        indent: Indentation, or None for one line.
        sort_keys: Sort dict keys.

    Returns:
        The JSON text.
    """
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """The `strftime_now` global of chat templates (used by some templates for the date).

    Args:
        fmt: A `strftime` format.

    Returns:
        The current local time, formatted.
    """
    return datetime.now().strftime(fmt)


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks chat messages and returns plain dict copies of them.

    Args:
        messages: A non-empty sequence of mappings, each with a str `role` and a str `content`.

    Returns:
        The messages as a list of dicts.

    Raises:
        InputError: If the messages are not of that shape.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InputError(
            f"chat messages must be a list of {{'role': ..., 'content': ...}} dicts, "
            f"got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise InputError("chat messages must be a non-empty list, got an empty one")
    result: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InputError(
                f"chat message {i} must be a dict with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise InputError(f"chat message {i} has no {key!r} key")
            if not isinstance(message[key], str):
                raise InputError(
                    f"chat message {i} {key!r} must be a string, got {type(message[key]).__name__}"
                )
        result.append(dict(message))
    return result


class Tokenizer:
    """A pair's tokenizer and chat template, backed by the `tokenizers` library.

    Build it with `from_folder`. Encoding never adds special tokens unless asked: a rendered chat
    template already contains the BOS/turn tokens as text, and `tokenizers` maps that text to the
    special ids, so the template output must be encoded as-is with `add_special_tokens=False`
    (what `encode` and `encode_chat` do by default), or the BOS would be doubled.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
    ) -> None:
        """Wraps a loaded `tokenizers.Tokenizer`.

        Args:
            backend: The loaded tokenizer.
            chat_template: The jinja chat template source, or None if the pair has none.
            bos_token: The BOS token text (exposed to the chat template as `bos_token`).
            eos_token: The EOS token text (exposed to the chat template as `eos_token`).
            bos_token_id: The BOS id; looked up from `bos_token` when None.
            eos_token_ids: The ids that end generation; looked up from `eos_token` when empty.
            add_bos_token: Prepend the BOS id in `encode(..., add_special_tokens=True)` when the
                tokenizer's own post-processor does not already.
        """
        self._backend = backend
        self._chat_template = chat_template
        self._bos_token = bos_token
        self._eos_token = eos_token
        if bos_token_id is None and bos_token is not None:
            bos_token_id = backend.token_to_id(bos_token)
        self._bos_token_id = bos_token_id
        eos_ids = tuple(int(i) for i in eos_token_ids)
        if not eos_ids and eos_token is not None:
            found = backend.token_to_id(eos_token)
            eos_ids = () if found is None else (found,)
        self._eos_token_ids = eos_ids
        self._add_bos_token = add_bos_token
        self._compiled_template: jinja2.Template | None = None

    @classmethod
    def from_folder(
        cls,
        folder: Path | str,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> Tokenizer:
        """Loads a tokenizer folder as exported by Hugging Face transformers.

        `tokenizer.json` is required. `tokenizer_config.json` is optional and gives `bos_token`,
        `eos_token`, `add_bos_token` and possibly `chat_template` (a string, or a list of
        `{name, template}` of which "default" is used). `chat_template.jinja`, when present,
        takes precedence over the config's template.

        Args:
            folder: The folder holding the files.
            bos_token_id: Overrides the BOS id looked up from the config's `bos_token`.
            eos_token_ids: Overrides the EOS ids looked up from the config's `eos_token`.

        Returns:
            The tokenizer.

        Raises:
            ManifestError: If `tokenizer.json` is missing or any file is malformed.
        """
        folder = Path(folder)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise ManifestError(
                f"tokenizer file {tokenizer_path} not found; the pair folder is incomplete, "
                f"re-export the pair"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ManifestError(
                f"tokenizer file {tokenizer_path} is malformed ({exc}); re-export the pair"
            ) from exc

        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                loaded = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ManifestError(
                    f"tokenizer config {config_path} is malformed ({exc}); re-export the pair"
                ) from exc
            if not isinstance(loaded, dict):
                raise ManifestError(
                    f"tokenizer config {config_path} must hold a JSON object, "
                    f"got {type(loaded).__name__}; re-export the pair"
                )
            config = loaded

        chat_template: str | None = None
        template_path = folder / "chat_template.jinja"
        if template_path.is_file():
            try:
                chat_template = template_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ManifestError(
                    f"chat template {template_path} cannot be read ({exc}); re-export the pair"
                ) from exc
        else:
            chat_template = _pick_chat_template(config.get("chat_template"))

        add_bos = config.get("add_bos_token", False)
        return cls(
            backend,
            chat_template=chat_template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            add_bos_token=add_bos is True,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token(self) -> str | None:
        """The BOS token text, if the config names one."""
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        """The EOS token text, if the config names one."""
        return self._eos_token

    @property
    def bos_token_id(self) -> int | None:
        """The BOS id, if known."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end generation (may be empty)."""
        return self._eos_token_ids

    @property
    def has_chat_template(self) -> bool:
        """Whether the pair ships a chat template."""
        return self._chat_template is not None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Encodes text to ids.

        Special-token text inside `text` (such as `<|im_start|>`) is mapped to its id either
        way. Leave `add_special_tokens` False for rendered chat templates, which already hold the
        BOS text.

        Args:
            text: The text.
            add_special_tokens: Apply the tokenizer's post-processor (and prepend BOS when the
                config sets `add_bos_token` and the post-processor did not).

        Returns:
            The ids.

        Raises:
            InputError: If `text` is not a string.
        """
        if not isinstance(text, str):
            raise InputError(f"text to encode must be a string, got {type(text).__name__}")
        ids = list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if (
            add_special_tokens
            and self._add_bos_token
            and self._bos_token_id is not None
            and (not ids or ids[0] != self._bos_token_id)
        ):
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Decodes ids to text.

        Ids the tokenizer does not know are dropped, as `tokenizers` does. Bytes that do not
        form valid UTF-8 come out as U+FFFD.

        Args:
            ids: The ids.
            skip_special_tokens: Leave special tokens out of the text.

        Returns:
            The text.

        Raises:
            InputError: If an id is negative or not an integer.
        """
        values: list[int] = []
        for i in ids:
            try:
                value = int(i)
            except (TypeError, ValueError) as exc:
                raise InputError(f"token ids must be integers, got {i!r}") from exc
            if value < 0:
                raise InputError(f"token ids must be non-negative, got {value}")
            values.append(value)
        return str(self._backend.decode(values, skip_special_tokens=skip_special_tokens))

    def _template(self) -> jinja2.Template:
        """Compiles (once) the chat template in a sandboxed jinja environment."""
        if self._compiled_template is None:
            if self._chat_template is None:
                raise InputError(
                    "the pair has no chat template; pass a plain prompt instead of chat messages"
                )
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[jinja2.ext.loopcontrols],
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._compiled_template = env.from_string(self._chat_template)
            except jinja2.TemplateError as exc:
                raise InputError(f"the chat template is invalid: {exc}") from exc
        return self._compiled_template

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """Renders chat messages with the pair's chat template.

        The template runs in a sandboxed, immutable jinja environment with `messages`,
        `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`. Encode the
        result with `add_special_tokens=False` (it already holds any BOS text).

        Args:
            messages: A non-empty sequence of `{"role": str, "content": str}` mappings (other
                keys are passed through to the template).
            add_generation_prompt: End with the header of an assistant turn.

        Returns:
            The prompt text.

        Raises:
            InputError: If the messages are malformed, the pair has no chat template, the
                template is invalid, or the template rejects the messages.
        """
        checked = _validate_messages(messages)
        template = self._template()
        try:
            return template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token or "",
            )
        except InputError:
            raise
        except jinja2.TemplateError as exc:
            raise InputError(f"the chat template failed to render: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                ZeroDivisionError, RecursionError, MemoryError) as exc:
            # Templates are untrusted code run in a sandbox: any failure is a clear input error.
            raise InputError(
                f"the chat template failed to render: {type(exc).__name__}: {exc}"
            ) from None

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Renders chat messages and encodes the result as-is (no extra special tokens).

        Args:
            messages: See `render_chat`.
            add_generation_prompt: See `render_chat`.

        Returns:
            The prompt ids.

        Raises:
            InputError: See `render_chat`.
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


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
