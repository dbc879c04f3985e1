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


def read_prompts(path: Path) -> tuple[str, ...]:
    """Prompts from a .txt (one per line) or .jsonl (objects with a "prompt" key) file.

    Raises:
        InputError: the file cannot be read, a .jsonl line is not an object with a "prompt",
            or the file holds no prompt.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read prompts ({exc})") from None
    prompts = _parse(text, path.suffix == ".jsonl", str(path))
    if not prompts:
        raise InputError(f"{path}: no prompts in the file")
    return prompts


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
            prompts.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"{where}:{n}: expected a JSON object with a \"prompt\" key") from None
    return tuple(prompts)
