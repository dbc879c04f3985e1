"""Text side of the runtime: tokenizer, chat template, streaming detokenizer and stop strings.

Everything here is torch-free and transformers-free: it uses the `tokenizers` library for the
tokenizer itself and a sandboxed `jinja2` environment for the chat template, exactly as exported
by Hugging Face transformers next to the model (`tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`).

* `Tokenizer` loads a pair's tokenizer folder, encodes and decodes ids and renders the chat
  template. In a pair folder it reads only the files `specedge.json` lists, each hashed as read.
  The template is untrusted code: it runs in a sandbox bounded in time, steps and sizes
  (`_BoundedSandbox`), and text longer than the context can hold is refused before the
  tokenizer sees it.
* `IncrementalDetokenizer` turns a growing stream of generated ids into text deltas, holding back
  bytes of a multi-byte character that is split across byte-level tokens.
* `StopStrings` finds stop strings that may span token boundaries, and tells a streaming caller
  how many trailing characters it must hold back.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor
import tokenizers

from .errors import InputError, ManifestError
from .manifest import (
    MANIFEST_NAME,
    MAX_TOKENIZER_FILE_BYTES,
    PairManifest,
    confine,
    read_bounded,
    read_listed,
    read_manifest,
)

__all__ = ["IncrementalDetokenizer", "StopStrings", "Tokenizer"]

_REPLACEMENT_CHAR = "\ufffd"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

#: Text longer than this many characters per token of context cannot fit the context; the
#: bound is the tokenizer's longest token (no token covers more characters), within these.
MIN_MAX_CHARS = 1 << 14
MAX_MAX_CHARS = 1 << 23
DEFAULT_MAX_CHARS = 1 << 20  # a tokenizer folder without a manifest: no context known
MAX_TEMPLATE_CHARS = 1 << 20  # real chat templates are a few KiB

#: Limits of one chat-template render.
RENDER_SECONDS = 1.0
RENDER_STEPS = 1_000_000  # loop iterations, calls, attribute and item lookups, operators
MAX_INT_BITS = 4096


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


def check_text(text: str, what: str = "the text") -> str:
    """Refuse text that is not valid Unicode for UTF-8 (a lone surrogate: what undecodable
    bytes on a command line or stdin become); returns `text`.

    Raises:
        InputError: naming the character and its position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"{what} is not valid UTF-8: it holds the lone surrogate U+{ord(text[exc.start]):04X} "
            f"at character {exc.start} (undecodable bytes become such characters); pass UTF-8 "
            "text"
        ) from None
    return text


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



def _decode_file(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: not UTF-8 text ({exc}); re-export the pair") from None


def _pair_reader(manifest: PairManifest, folder: Path) -> Callable[[str], str | None]:
    """Reads a tokenizer file of a pair: listed, confined and hashed, or refused."""

    def read(name: str) -> str | None:
        if name in manifest.tokenizer_files:
            return _decode_file(read_listed(manifest, name), folder / name)
        if os.path.lexists(folder / name):
            raise ManifestError(
                f"{folder / name}: present in the pair folder but not listed under "
                f"tokenizer.files in {folder / MANIFEST_NAME}; the runtime reads only listed, "
                "hashed files: re-export the pair, or delete the file"
            )
        return None

    return read


def _folder_reader(folder: Path) -> Callable[[str], str | None]:
    """Reads a tokenizer file of a plain folder (no manifest): confined and bounded in size."""

    def read(name: str) -> str | None:
        path = folder / name
        if not os.path.lexists(path):
            return None
        confine(folder, name, file=path, key=name)
        return _decode_file(read_bounded(path, MAX_TOKENIZER_FILE_BYTES), path)

    return read


class _LimitExceeded(Exception):
    """A chat template went past one of its render limits (caught by `render_chat`)."""


_DIGITS = re.compile(r"\d+")


class _Budget(threading.local):
    """The limits of the render running in this thread."""

    deadline = 0.0
    steps = 0
    max_chars = DEFAULT_MAX_CHARS


class _ChecksLoopsAndConcat(jinja2.visitor.NodeTransformer):
    """Rewrites a parsed template so that every `for` loop steps through `__loop_guard` (one
    budget step per item) and every `~` concatenation goes through `__concat_guard` (size
    checked before the string is built). Both are calls, so the sandbox's `call` sees them."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = jinja2.nodes.Call(jinja2.nodes.Name("__loop_guard", "load"), [node.iter],
                                      [], None, None)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return jinja2.nodes.Call(jinja2.nodes.Name("__concat_guard", "load"), list(node.nodes),
                                 [], None, None)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | list | tuple | dict) else 0


class _BoundedFormatter(jinja2.sandbox.SandboxedFormatter):
    """`str.format` in the sandbox, refusing field widths beyond the size limit."""

    def __init__(self, env: _BoundedSandbox) -> None:
        super().__init__(env)
        self._bounded = env

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._bounded.check_format(format_spec)
        return super().format_field(value, format_spec)


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """An immutable jinja sandbox whose renders are bounded in time, steps and sizes.

    Every hook the sandbox offers (calls, attribute and item lookups, the arithmetic
    operators) takes one step and checks the deadline; `for` loops and `~` are rewritten into
    calls (`_ChecksLoopsAndConcat`); filters are wrapped. Operations that can build a large value
    from a small one (`*`, `**`, `+`, `%`, `~`, `str.format` widths, `center`, `indent`,
    `join`, `replace`, `batch`) are checked *before* they run, and every value a hook returns
    after. A render that exceeds a limit raises `_LimitExceeded`.
    """

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.budget = _Budget()
        self.globals.pop("lipsum", None)  # builds text of any size from one call
        self.globals["__loop_guard"] = self._loop_guard
        self.globals["__concat_guard"] = self._concat_guard
        self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}

    # ---------------------------------------------------------------- budget

    def start(self, max_chars: int) -> None:
        """Reset the limits for a render in this thread."""
        self.budget.deadline = time.monotonic() + RENDER_SECONDS
        self.budget.steps = 0
        self.budget.max_chars = max_chars

    def step(self) -> None:
        b = self.budget
        b.steps += 1
        if b.steps > RENDER_STEPS:
            raise _LimitExceeded(f"more than {RENDER_STEPS} steps")
        if time.monotonic() > b.deadline:
            raise _LimitExceeded(f"more than {RENDER_SECONDS:g} s")

    def check_size(self, size: int, what: str = "a value") -> None:
        if size > self.budget.max_chars:
            raise _LimitExceeded(f"{what} of {size} characters or items (at most "
                                 f"{self.budget.max_chars})")

    def checked(self, value: Any) -> Any:
        self.check_size(_size(value))
        if isinstance(value, int) and not isinstance(value, bool) and \
                value.bit_length() > MAX_INT_BITS:
            raise _LimitExceeded(f"an integer of {value.bit_length()} bits")
        return value

    def check_format(self, fmt: Any) -> None:
        """Field widths and precisions in a format string (or spec) within the size limit."""
        if isinstance(fmt, str):
            for digits in _DIGITS.findall(fmt):
                if len(digits) > 12 or int(digits) > self.budget.max_chars:
                    raise _LimitExceeded(f"a format width of {digits}")

    # ---------------------------------------------------------------- hooks

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.step()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.step()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            __self._check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return __self.checked(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.step()
        ints = [isinstance(x, int) and not isinstance(x, bool) for x in (left, right)]
        if operator == "*":
            if all(ints):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise _LimitExceeded("an integer product beyond the limit")
            elif ints[0] or ints[1]:
                count, seq = (left, right) if ints[0] else (right, left)
                self.check_size(max(0, count) * _size(seq), "a repeated value")
        elif operator == "**" and all(ints) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > MAX_INT_BITS:
                raise _LimitExceeded("a power beyond the integer limit")
        elif operator == "+" and _size(left) and _size(right):
            self.check_size(_size(left) + _size(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            self._check_percent(left, right)
        return self.checked(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if super().wrap_str_format(value) is None:
            return None
        f_self: str = value.__self__
        formatter = _BoundedFormatter(self)
        is_format_map = value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                kwargs, args = args[0], ()
            return str(self.checked(formatter.vformat(f_self, args, kwargs)))

        return functools.update_wrapper(wrapper, value)

    # ---------------------------------------------------------------- guards

    def _loop_guard(self, iterable: Iterable[Any]) -> Iterable[Any]:
        for item in iterable:
            self.step()
            yield item

    def _concat_guard(self, *parts: Any) -> str:
        texts = [str(p) for p in parts]
        self.check_size(sum(map(len, texts)), "a concatenation")
        return "".join(texts)

    def _check_percent(self, fmt: str, args: Any) -> None:
        self.check_format(fmt)
        if "*" in fmt:
            for arg in args if isinstance(args, tuple) else (args,):
                if isinstance(arg, int) and abs(arg) > self.budget.max_chars:
                    raise _LimitExceeded(f"a format width of {arg}")

    def _check_str_method(self, text: str, name: str, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> None:
        values = list(args) + list(kwargs.values())
        if name in ("center", "ljust", "rjust", "zfill") and values:
            self.check_size(values[0] if isinstance(values[0], int) else 0, "a padded string")
        elif name == "expandtabs":
            width = values[0] if values and isinstance(values[0], int) else 8
            self.check_size(len(text) + max(0, width) * text.count("\t"), "expanded tabs")
        elif name == "replace" and len(values) >= 2:
            self._check_replace(text, values[0], values[1])
        elif name == "join" and values:
            self._check_join(text, values[0])

    def _check_replace(self, text: str, old: Any, new: Any) -> None:
        if isinstance(old, str) and isinstance(new, str):
            count = text.count(old) if old else len(text) + 1
            self.check_size(len(text) + count * len(new), "a replacement")

    def _check_join(self, sep: Any, items: Any) -> None:
        if isinstance(items, list | tuple):
            total = len(str(sep)) * max(0, len(items) - 1)
            for item in items:
                total += len(item) if isinstance(item, str) else 16
                self.check_size(total, "a joined string")

    def _guard_filter(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        passes = getattr(fn, "jinja_pass_arg", None) is not None

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.step()
            given = list(args[1:] if passes else args)
            value, rest = (given[0] if given else None), given[1:] + list(kwargs.values())
            if name in ("center", "batch", "slice") and rest and isinstance(rest[0], int):
                self.check_size(rest[0], f"the {name} filter's size")
            elif name == "indent" and isinstance(value, str) and rest:
                width = rest[0] if isinstance(rest[0], int) else _size(rest[0])
                self.check_size(len(value) + (value.count("\n") + 1) * max(0, width),
                                "an indented string")
            elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
                self._check_replace(value, rest[0], rest[1])
            elif name == "join":
                if value is not None and not isinstance(value, list | tuple | str | dict):
                    value = list(self._loop_guard(value))
                    given[0] = value
                self._check_join(rest[0] if rest else "", value)
            elif name == "format" and isinstance(value, str):
                self._check_percent(value, tuple(rest))
            elif name == "tojson":
                for v in rest:
                    if isinstance(v, int) and not isinstance(v, bool) and v > 64:
                        raise _LimitExceeded(f"a JSON indent of {v}")
            args = (*args[:1], *given) if passes else tuple(given)
            return self.checked(fn(*args, **kwargs))

        return guarded


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
        max_chars: int = DEFAULT_MAX_CHARS,
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
            max_chars: Refuse to encode (or render) text longer than this: it cannot fit the
                context anyway, and the tokenizer's memory grows with the text.
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
        self.max_chars = int(max_chars)
        self._compiled_template: jinja2.Template | None = None
        self._env: _BoundedSandbox | None = None

    @classmethod
    def from_folder(
        cls,
        folder: Path | str,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        manifest: PairManifest | None = None,
    ) -> Tokenizer:
        """Loads a tokenizer folder as exported by Hugging Face transformers.

        `tokenizer.json` is required. `tokenizer_config.json` is optional and gives `bos_token`,
        `eos_token`, `add_bos_token` and possibly `chat_template` (a string, or a list of
        `{name, template}` of which "default" is used). `chat_template.jinja`, when present,
        takes precedence over the config's template.

        In a pair folder (one with `specedge.json`, or given `manifest`) only the files the
        manifest lists under `tokenizer.files` are read, each confined to the folder and checked
        against its sha256 as it is read; one of these files present but not listed is refused.
        The context (`max_seq_len` of the target) then bounds the text length (`max_chars`).

        Args:
            folder: The folder holding the files.
            bos_token_id: Overrides the BOS id looked up from the config's `bos_token`.
            eos_token_ids: Overrides the EOS ids looked up from the config's `eos_token`.
            manifest: The pair's manifest (read from the folder when it has one and this is
                None).

        Returns:
            The tokenizer.

        Raises:
            ManifestError: If `tokenizer.json` is missing, any file is malformed, unlisted,
                outside the folder or modified.
        """
        folder = Path(folder)
        if manifest is None and os.path.lexists(folder / MANIFEST_NAME):
            manifest = read_manifest(folder)
        read = _pair_reader(manifest, folder) if manifest is not None else _folder_reader(folder)

        text = read("tokenizer.json")
        tokenizer_path = folder / "tokenizer.json"
        if text is None:
            raise ManifestError(
                f"tokenizer file {tokenizer_path} not found; the pair folder is incomplete, "
                f"re-export the pair"
            )
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ManifestError(
                f"tokenizer file {tokenizer_path} is malformed ({str(exc)[:300]}); re-export the "
                "pair"
            ) from None

        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        raw_config = read("tokenizer_config.json")
        if raw_config is not None:
            try:
                loaded = json.loads(raw_config)
            except (ValueError, RecursionError) as exc:
                raise ManifestError(
                    f"tokenizer config {config_path} is malformed ({str(exc)[:300]}); re-export "
                    "the pair"
                ) from None
            if not isinstance(loaded, dict):
                raise ManifestError(
                    f"tokenizer config {config_path} must hold a JSON object, "
                    f"got {type(loaded).__name__}; re-export the pair"
                )
            config = loaded

        chat_template = read("chat_template.jinja")
        if chat_template is None:
            chat_template = _pick_chat_template(config.get("chat_template"))

        max_chars = DEFAULT_MAX_CHARS
        if manifest is not None:
            longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)
            max_chars = min(MAX_MAX_CHARS, max(MIN_MAX_CHARS,
                                               manifest.target.max_seq_len * longest))
        add_bos = config.get("add_bos_token", False)
        return cls(
            backend,
            chat_template=chat_template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            add_bos_token=add_bos is True,
            max_chars=max_chars,
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
            InputError: If `text` is not a string, is not valid UTF-8 (holds a lone surrogate,
                which is what undecodable bytes on a command line or stdin become), or is
                longer than `max_chars` (it could not fit the context).
        """
        if not isinstance(text, str):
            raise InputError(f"text to encode must be a string, got {type(text).__name__}")
        if len(text) > self.max_chars:
            raise InputError(
                f"the text has {len(text)} characters, more than the context can hold (at most "
                f"{self.max_chars} with this tokenizer); shorten it"
            )
        check_text(text)
        try:
            ids = list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        except Exception as exc:  # the Rust side raises TypeError or a bare Exception
            raise InputError(f"the tokenizer could not encode the text ({str(exc)[:200]})"
                             ) from None
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

    def _template(self) -> tuple[jinja2.Template, _BoundedSandbox]:
        """Compiles (once) the chat template in the bounded sandbox."""
        if self._compiled_template is None or self._env is None:
            if self._chat_template is None:
                raise InputError(
                    "the pair has no chat template; pass a plain prompt instead of chat messages"
                )
            if len(self._chat_template) > MAX_TEMPLATE_CHARS:
                raise InputError(f"the chat template has {len(self._chat_template)} characters "
                                 f"(at most {MAX_TEMPLATE_CHARS}); re-export the pair")
            env = _BoundedSandbox(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[jinja2.ext.loopcontrols],
            )
            env.filters["tojson"] = env._guard_filter("tojson", _tojson)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                tree = _ChecksLoopsAndConcat().visit(env.parse(self._chat_template))
                self._compiled_template = env.from_string(tree)
            except jinja2.TemplateError as exc:
                raise InputError(f"the chat template is invalid: {exc}") from None
            except (RecursionError, MemoryError, ValueError, SyntaxError) as exc:
                raise InputError(f"the chat template is invalid: {type(exc).__name__}") from None
            self._env = env
        return self._compiled_template, self._env

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """Renders chat messages with the pair's chat template.

        The template runs in a sandboxed, immutable jinja environment with `messages`,
        `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`, bounded to
        `RENDER_SECONDS`, `RENDER_STEPS` and `max_chars` characters for any value and for the
        output. Encode the result with `add_special_tokens=False` (it already holds any BOS
        text).

        Args:
            messages: A non-empty sequence of `{"role": str, "content": str}` mappings (other
                keys are passed through to the template).
            add_generation_prompt: End with the header of an assistant turn.

        Returns:
            The prompt text.

        Raises:
            InputError: If the messages are malformed, the pair has no chat template, the
                template is invalid, rejects the messages or exceeds a render limit.
        """
        checked = _validate_messages(messages)
        template, env = self._template()
        env.start(self.max_chars)
        parts: list[str] = []
        size = 0
        try:
            for part in template.generate(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token or "",
            ):
                size += len(part)
                env.check_size(size, "the rendered prompt")
                env.step()
                parts.append(part)
        except InputError:
            raise
        except _LimitExceeded as exc:
            raise InputError(
                f"the chat template exceeded its limits ({exc}); the pair's chat template is "
                "broken or hostile, or the conversation is too long for the context"
            ) from None
        except jinja2.TemplateError as exc:
            raise InputError(f"the chat template failed to render: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                ZeroDivisionError, RecursionError, MemoryError) as exc:
            # Templates are untrusted code run in a sandbox: any failure is a clear input error.
            raise InputError(
                f"the chat template failed to render: {type(exc).__name__}: {str(exc)[:200]}"
            ) from None
        return "".join(parts)

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
