"""The files of a model folder, read bounded and with one-line errors: config.json (as JSON and
as transformers' config), generation_config.json, tokenizer_config.json and tokenizer.json.

A folder comes from a user or a download, so nothing here trusts it: a file that is too large, not
a regular file, not JSON or not an object fails with the file's name and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specedge.runtime.errors import ExportError


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of an HF folder, with a clear error when it is unreadable."""
    return read_json_file(folder / "config.json")


MAX_JSON_BYTES = 64 << 20  # config files are KiB; tokenizer.json is read by `tokenizer_vocab`
MAX_TOKENIZER_FILE_BYTES = 256 << 20  # tokenizer.json of a 256k vocabulary is ~20 MiB


def read_json_file(file: Path) -> dict[str, Any]:
    """A JSON object file of a model folder (config.json, generation_config.json,
    tokenizer_config.json), read bounded.

    Raises:
        ExportError: unreadable, not a regular file, too large, not JSON or not an object.
    """
    fix = "the model folder is corrupt; pass a Hugging Face model folder"
    try:
        if not file.is_file():
            raise ExportError(f"{file}: not a regular file; {fix}")
        with open(file, "rb") as fh:
            data = fh.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise ExportError(f"{file}: unreadable ({exc.strerror or exc}); {fix}") from None
    if len(data) > MAX_JSON_BYTES:
        raise ExportError(f"{file}: larger than {MAX_JSON_BYTES >> 20} MiB; {fix}")
    try:
        doc = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ExportError(f"{file}: unreadable (not JSON: {exc}); {fix}") from None
    if not isinstance(doc, dict):
        raise ExportError(f"{file}: not a JSON object; {fix}")
    return doc


def tokenizer_vocab(folder: Path) -> dict[str, int]:
    """token -> id of an HF folder's fast tokenizer (added tokens included)."""
    from tokenizers import Tokenizer

    file = folder / "tokenizer.json"
    if not file.exists():
        raise ExportError(f"{folder}: no tokenizer.json (a fast tokenizer is required)")
    if not file.is_file():
        raise ExportError(f"{file}: not a regular file; a model folder's tokenizer.json is a "
                          "JSON file")
    if file.stat().st_size > MAX_TOKENIZER_FILE_BYTES:
        raise ExportError(f"{file}: larger than {MAX_TOKENIZER_FILE_BYTES >> 20} MiB; not a "
                          "tokenizer")
    try:
        return dict(Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True))
    except Exception as exc:  # the tokenizers library raises its own Exception for bad files
        what = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ExportError(f"{file}: not a tokenizer the tokenizers library can read ({what}); "
                          "the model folder is corrupt or has a slow tokenizer only") from None


def hf_config(folder: Path) -> Any:
    """transformers' config of an HF folder, with a clear error where transformers refuses it
    (a field of the wrong type, an unknown model type)."""
    from transformers import AutoConfig

    refused: tuple[type[Exception], ...] = (ValueError, TypeError, KeyError, OSError)
    try:  # transformers 5 validates configs with huggingface_hub's strict dataclasses
        from huggingface_hub.errors import StrictDataclassError

        refused += (StrictDataclassError,)
    except ImportError:
        pass
    file = folder / "config.json"
    try:
        return AutoConfig.from_pretrained(str(folder))
    except refused as exc:
        what = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ExportError(f"{file}: transformers cannot read it ({what}); pass a valid "
                          "Hugging Face model folder") from None
