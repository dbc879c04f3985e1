"""A tokenizer folder read as Hugging Face transformers exports it (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`): in a pair folder only the files its manifest
lists, each confined to the folder and hashed as read; in a plain folder, confined and bounded
in size. `runtime/text.Tokenizer.from_folder` builds the tokenizer from what this reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from .chat_template import pick_chat_template
from .errors import ManifestError
from .files import confine, read_bounded
from .manifest import (
    MANIFEST_NAME,
    MAX_TOKENIZER_FILE_BYTES,
    PairManifest,
    read_listed,
    read_manifest,
)

__all__ = ["DEFAULT_MAX_CHARS", "TOKENIZER_FILES", "TokenizerFiles", "read_tokenizer_folder",
           "token_text"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


#: Text longer than this many characters per token of context cannot fit the context; the
#: bound is the tokenizer's longest token (no token covers more characters), within these.
MIN_MAX_CHARS = 1 << 14
MAX_MAX_CHARS = 1 << 23
DEFAULT_MAX_CHARS = 1 << 20  # a tokenizer folder without a manifest: no context known


def token_text(value: Any) -> str | None:
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


@dataclass(frozen=True)
class TokenizerFiles:
    """What a tokenizer folder holds: the loaded tokenizer, its config (`{}` without one), its
    chat template (None: none), and the longest text worth encoding (`max_chars`)."""

    backend: tokenizers.Tokenizer
    config: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    max_chars: int = DEFAULT_MAX_CHARS


def read_tokenizer_folder(folder: Path, manifest: PairManifest | None = None) -> TokenizerFiles:
    """Reads `folder`'s tokenizer files (a pair folder's as its manifest lists them: the one
    given, or the folder's own `specedge.json`). The chat template is `chat_template.jinja`,
    else the config's (`chat_template.pick_chat_template`); in a pair folder the context
    (`max_seq_len` of the target) bounds the text length.

    Raises:
        ManifestError: `tokenizer.json` is missing, or a file is malformed, unlisted, outside
            the folder or modified.
    """
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
        chat_template = pick_chat_template(config.get("chat_template"))

    max_chars = DEFAULT_MAX_CHARS
    if manifest is not None:
        longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)
        max_chars = min(MAX_MAX_CHARS, max(MIN_MAX_CHARS,
                                           manifest.target.max_seq_len * longest))
    return TokenizerFiles(backend, config, chat_template, max_chars)
