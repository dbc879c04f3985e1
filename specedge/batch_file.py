"""A `specedge generate --batch` file: JSONL rows, each a prompt or chat messages with the
fields of a request that may differ by row (sampling, stop strings, structured output, ...), the
CLI's options the defaults. Checked row by row: a malformed one is a one-line error naming its
`file:line`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specedge.runtime.errors import InputError

if TYPE_CHECKING:
    from specedge.runtime.pair import GenerationConfig

__all__ = ["BatchFile", "read_batch_file"]


_ROW_KEYS = {"prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "min_p",
             "seed", "stop", "chat", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "logit_bias", "response_format", "structured_outputs",
             "min_tokens", "ignore_eos"}
_ROW_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "max_new_tokens": ((int,), "an integer"), "top_k": ((int,), "an integer"),
    "temperature": ((int, float), "a number"), "top_p": ((int, float), "a number"),
    "min_p": ((int, float), "a number"), "seed": ((int, type(None)), "an integer or null"),
    "chat": ((bool,), "true or false"),
    "presence_penalty": ((int, float), "a number"), "frequency_penalty": ((int, float), "a number"),
    "repetition_penalty": ((int, float), "a number"), "min_tokens": ((int,), "an integer"),
    "ignore_eos": ((bool,), "true or false"),
    "logit_bias": ((dict, type(None)), "an object of token ids (as strings) to biases"),
}


@dataclasses.dataclass(frozen=True)
class BatchFile:
    """The rows of a batch file: prompts, configs, and where each row is (`file:line`)."""

    prompts: list[Any]
    configs: list[GenerationConfig]
    where: list[str]


def _row_stop(row: dict[str, Any]) -> list[str] | None:
    """A batch row's stop strings (one string or a list, as the server's `stop`); None when
    it is neither."""
    stop = row.get("stop", [])
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        return None
    return stop


def _check_row(row: dict[str, Any], where: str) -> None:
    """Types of a batch row's fields (JSON gives any type; bool is not a number here)."""
    from specedge.runtime.text import check_text

    for key, (kinds, name) in _ROW_TYPES.items():
        if key in row and (not isinstance(row[key], kinds) or
                           (isinstance(row[key], bool) and bool not in kinds)):
            raise InputError(f"{where}: \"{key}\" must be {name}, found {row[key]!r}")
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise InputError(f"{where}: \"prompt\" must be a string")
        if not row["prompt"]:
            raise InputError(f"{where}: \"prompt\" is empty; give some text")
        check_text(row["prompt"], f"{where}: \"prompt\"")
    else:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise InputError(f"{where}: \"messages\" must be a non-empty list of "
                             "{\"role\": ..., \"content\": ...} objects with string values")
        for m in messages:
            check_text(m["content"], f"{where}: a message")
    stop = _row_stop(row)
    if stop is None:
        raise InputError(f"{where}: \"stop\" must be a string or a list of strings")
    for x in stop:
        check_text(x, f"{where}: a stop string")


def read_batch_file(path: Path, base: GenerationConfig) -> BatchFile:
    """Prompts and per-row configs from a JSONL batch file (CLI options are the defaults).

    Raises:
        InputError: naming `file:line` for a malformed row.
    """
    from specedge.runtime.prompts import read_text_file
    from specedge.runtime.sampling import SamplingParams, logit_bias_from_json
    from specedge.runtime.structured_api import StructuredFieldError, grammar_field

    lines = read_text_file(path, "the batch file", "batch file").splitlines()
    rows = BatchFile([], [], [])
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise InputError(f"{where}: not a JSON object") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise InputError(f"{where}: give exactly one of \"prompt\" or \"messages\"")
        unknown = set(row) - _ROW_KEYS
        if unknown:
            raise InputError(f"{where}: unknown key(s) {sorted(unknown)}; use "
                             f"{', '.join(sorted(_ROW_KEYS))}")
        _check_row(row, where)
        s = base.sampling
        try:
            sampling = SamplingParams(
                temperature=row.get("temperature", s.temperature),
                top_k=row.get("top_k", s.top_k), top_p=row.get("top_p", s.top_p),
                min_p=row.get("min_p", s.min_p), seed=row.get("seed", s.seed),
                presence_penalty=row.get("presence_penalty", s.presence_penalty),
                frequency_penalty=row.get("frequency_penalty", s.frequency_penalty),
                repetition_penalty=row.get("repetition_penalty", s.repetition_penalty),
                logit_bias=(logit_bias_from_json(row["logit_bias"]) if "logit_bias" in row
                            else s.logit_bias),
                min_tokens=row.get("min_tokens", s.min_tokens))
            rows.configs.append(dataclasses.replace(
                base, sampling=sampling,
                stop=tuple(_row_stop(row) or ()) if "stop" in row else base.stop,
                max_new_tokens=row.get("max_new_tokens", base.max_new_tokens),
                chat=row.get("chat", base.chat or "messages" in row),
                grammar=(grammar_field(row) if {"response_format", "structured_outputs"} & set(row)
                         else base.grammar),
                ignore_eos=row.get("ignore_eos", base.ignore_eos)))
        except StructuredFieldError as exc:
            raise InputError(f"{where}: {exc.param}: {exc}") from None
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None
        rows.prompts.append(row.get("prompt", row.get("messages")))
        rows.where.append(where)
    if not rows.prompts:
        raise InputError(f"{path}: no rows in the batch file")
    return rows
