"""Prompt files for the measuring tools (`bench`, `tune`, `draft`), and the default prompt set.

One reader for every tool: a `.txt` file holds one prompt per line, a `.jsonl` file one object
with a "prompt" key per line; blank lines are skipped. The default set (`data/prompts20.txt`,
twenty mixed prompts) ships inside the package, so it is there in an installed specedge too.
This is tooling: the decoding core never imports it.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .errors import InputError

DEFAULT_PROMPT_FILE = "data/prompts20.txt"
MAX_INPUT_BYTES = 64 << 20  # prompt, batch and calibration files: far more than any real one


def read_text_file(path: Path, what: str, noun: str, limit: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of an input file, never reading more than `limit` bytes (a pipe or a
    device such as /dev/zero has no size to check first). A leading byte-order mark (which
    Windows editors write) is dropped.

    Args:
        path: the file.
        what: what it holds, for messages ("prompts").
        noun: what it is, for messages ("prompt file").

    Raises:
        InputError: "PATH: cannot read WHAT (...)": missing, unreadable, too large, not UTF-8.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except FileNotFoundError:
        raise InputError(f"{path}: cannot read {what} (no such {noun})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise InputError(f"{path}: cannot read {what} (the {noun} is larger than "
                         f"{limit >> 20} MiB)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: cannot read {what} (not UTF-8 text: {exc})") from None


def read_prompts(path: Path) -> tuple[str, ...]:
    """Prompts from a .txt (one per line) or .jsonl (objects with a "prompt" key) file.

    Raises:
        InputError: the file cannot be read, a .jsonl line is not an object with a "prompt",
            or the file holds no prompt.
    """
    text = read_text_file(path, "prompts", "prompt file")
    prompts = _parse(text, path.suffix == ".jsonl", str(path))
    if not prompts:
        raise InputError(f"{path}: no prompts in the file")
    return prompts


def read_categories(path: Path) -> tuple[str, ...] | None:
    """The "category" of each prompt of a .jsonl prompt file (in `read_prompts` order), or None
    when the file is not .jsonl or some line has no string category (results are then not
    broken down by category)."""
    if path.suffix != ".jsonl":
        return None
    categories: list[str] = []
    for line in read_text_file(path, "prompts", "prompt file").splitlines():
        if not line.strip():
            continue
        try:
            category = json.loads(line).get("category")
        except (json.JSONDecodeError, AttributeError, RecursionError):
            return None
        if not isinstance(category, str):
            return None
        categories.append(category)
    return tuple(categories)


def default_prompts() -> tuple[str, ...]:
    """The prompt set shipped with the package (twenty prompts of mixed kinds)."""
    text = resources.files(__package__).joinpath(DEFAULT_PROMPT_FILE).read_text(encoding="utf-8")
    return _parse(text, False, DEFAULT_PROMPT_FILE)


def _parse(text: str, jsonl: bool, where: str) -> tuple[str, ...]:
    prompts: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(line)
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
            raise InputError(f"{where}:{n}: expected a JSON object with a \"prompt\" key") from None
        if not isinstance(prompt, str):
            raise InputError(f"{where}:{n}: \"prompt\" must be a string")
        if not prompt.strip():
            raise InputError(f"{where}:{n}: \"prompt\" is empty; give it some text or drop "
                             "the line")
        prompts.append(prompt)
    return tuple(prompts)
