"""Text side of the runtime: the tokenizer of a pair, and its text limits.

Everything here is torch-free and transformers-free: it uses the `tokenizers` library for the
tokenizer itself, with the files Hugging Face transformers exports next to a model
(`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`).

`Tokenizer` loads a pair's tokenizer folder (`runtime/tokenizer_files`), encodes and decodes ids
and renders the chat template (`runtime/chat_template`: untrusted code, run in a bounded
sandbox). In a pair folder it reads only the files `specedge.json` lists, each hashed as read,
and text longer than the context can hold is refused before the tokenizer sees it. Streaming
text (the incremental detokenizer and stop strings) is `runtime/detokenize`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from .chat_template import ChatTemplate
from .errors import InputError
from .manifest import PairManifest
from .reasoning import ReasoningFormat
from .token_bytes import token_bytes
from .tokenizer_files import DEFAULT_MAX_CHARS, read_tokenizer_folder, token_text
from .tool_calls import ToolFormat

__all__ = ["Tokenizer", "check_text"]


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
        self._compiled: ChatTemplate | None = None
        # A reasoning model's tags and its tool-call tags that its tokenizer marks special:
        # decoded text keeps them, or the thinking could not be told from the answer, nor a
        # call from text (`runtime/reasoning`, `runtime/tool_calls`).
        reasoning = ReasoningFormat.for_template(chat_template)
        calls = ToolFormat.for_template(chat_template)
        tags = ((reasoning.open_tag, reasoning.close_tag) if reasoning else ()) + \
            (calls.tags if calls else ())
        added = backend.get_added_tokens_decoder().items()
        self._shown = {int(i): t.content for i, t in added if t.special and t.content in tags}
        self._hidden = {int(i) for i, t in added if t.special} - self._shown.keys()

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
        files = read_tokenizer_folder(Path(folder), manifest)
        config = files.config
        add_bos = config.get("add_bos_token", False)
        return cls(
            files.backend,
            chat_template=files.chat_template,
            bos_token=token_text(config.get("bos_token")),
            eos_token=token_text(config.get("eos_token")),
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            add_bos_token=add_bos is True,
            max_chars=files.max_chars,
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
    def chat_template(self) -> str | None:
        """The chat template's jinja source (None: the pair has none)."""
        return self._chat_template

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
            skip_special_tokens: Leave special tokens out of the text (but a reasoning model's
                and its tool calls' tags, which the text needs: see `__init__`).

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
        if not skip_special_tokens or not self._shown.keys() & set(values):
            return str(self._backend.decode(values, skip_special_tokens=skip_special_tokens))
        # The other special tokens dropped, the rest decoded as one text: decoded apart, the
        # runs between kept tags lost the space a SentencePiece (metaspace) decoder strips at a
        # text's start (`[TOOL_CALLS] [` came out `[TOOL_CALLS][`).
        kept = [v for v in values if v not in self._hidden]
        return str(self._backend.decode(kept, skip_special_tokens=False))

    def to_json(self) -> str:
        """The tokenizer serialized as `tokenizers` writes it (what llguidance loads)."""
        return str(self._backend.to_str())

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for, read from the vocabulary (a token may hold
        part of a UTF-8 character; see `runtime/token_bytes`)."""
        return token_bytes(self._backend, token_id)

    def _template(self) -> ChatTemplate:
        """The chat template, compiled once in the bounded sandbox."""
        if self._compiled is None:
            if self._chat_template is None:
                raise InputError(
                    "the pair has no chat template; pass a plain prompt instead of chat messages"
                )
            self._compiled = ChatTemplate(self._chat_template)
        return self._compiled

    @property
    def chat_takes_tools(self) -> bool:
        """The chat template renders a `tools` list itself (a tool-calling model's template)."""
        return self._template().takes_tools

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Renders chat messages with the pair's chat template.

        The template runs in a sandboxed, immutable jinja environment with `messages`,
        `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`, bounded to
        `template_sandbox.RENDER_SECONDS`, `RENDER_STEPS` and `max_chars` characters for any
        value and for the output. Encode the result with `add_special_tokens=False` (it
        already holds any BOS text).

        Args:
            messages: A non-empty sequence of `{"role": str, "content": str}` mappings (other
                keys are passed through to the template).
            add_generation_prompt: End with the header of an assistant turn.
            tools: The tools offered, as OpenAI writes them (`runtime/tool_prompt`).
            variables: More template variables (`chat_template.template_variables`).

        Returns:
            The prompt text.

        Raises:
            InputError: If the messages are malformed, the pair has no chat template, the
                template is invalid, rejects the messages or exceeds a render limit.
        """
        return self._template().render(
            messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token or "", eos_token=self._eos_token or "",
            max_chars=self.max_chars, tools=tools, variables=variables)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Renders chat messages and encodes the result as-is (no extra special tokens).

        Args:
            messages: See `render_chat`.
            add_generation_prompt: See `render_chat`.
            tools: See `render_chat`.
            variables: See `render_chat`.

        Returns:
            The prompt ids.

        Raises:
            InputError: See `render_chat`; or the template rendered no tokens.
        """
        return self.encode_rendered(self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools,
            variables=variables))

    def encode_rendered(self, text: str) -> list[int]:
        """The ids of a prompt `render_chat` rendered (as it is: no extra special tokens).

        Raises:
            InputError: the template rendered no tokens.
        """
        ids = self.encode(text, add_special_tokens=False)
        if not ids:
            raise InputError("the chat template rendered these messages as no tokens; fix the "
                             "pair's template (re-export with --chat-template FILE)")
        return ids
