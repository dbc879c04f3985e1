"""Structured output as the OpenAI-compatible servers take it, into a `Grammar`.

- OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
- vLLM's `structured_outputs`: exactly one of `json` (a schema, as an object or JSON text),
  `regex`, `choice` (a list of strings), `grammar` (Lark or llama.cpp GBNF) or
  `json_object: true`; and its older top-level `guided_json`, `guided_regex`, `guided_choice`
  and `guided_grammar`.

A request gives at most one of these. Pure functions: no HTTP, no decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import FieldError, InputError
from .grammar import Grammar

__all__ = ["StructuredFieldError", "grammar_field"]

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredFieldError(FieldError):
    """A structured-output field the request got wrong (`param` names it)."""


def grammar_field(body: Mapping[str, Any]) -> Grammar | None:
    """The grammar a request body asks for (None: free text).

    Raises:
        StructuredFieldError: naming the field at fault: a malformed value, a grammar that does
            not compile, or more than one structured-output field.
    """
    found: list[tuple[str, Any]] = []
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        found.append(("response_format", fmt))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", body["structured_outputs"]))
    found += [(name, {key: body[name]}) for name, key in _GUIDED.items()
              if body.get(name) is not None]
    if not found:
        return None
    if len(found) > 1:
        raise StructuredFieldError(found[1][0], f"give one structured-output field, not both "
                                                f"{found[0][0]} and {found[1][0]}")
    param, value = found[0]
    try:
        return _response_format(value) if param == "response_format" else _vllm(value)
    except InputError as exc:
        raise StructuredFieldError(param, str(exc)) from None


def _response_format(fmt: Any) -> Grammar:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InputError("a json_schema response_format needs json_schema.schema, a JSON "
                             "schema object")
        return Grammar.json_schema(schema)
    raise InputError("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                     "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")


def _vllm(value: Any) -> Grammar:
    keys = [k for k in _VLLM_KEYS if isinstance(value, dict) and value.get(k) is not None]
    if not isinstance(value, dict) or len(keys) != 1 or set(value) - set(_VLLM_KEYS):
        raise InputError(f"give exactly one of {', '.join(_VLLM_KEYS)}")
    key, item = keys[0], value[keys[0]]
    if key == "json_object":
        if item is not True:
            raise InputError("json_object must be true")
        return Grammar("json_object")
    if key == "json":
        if not isinstance(item, dict | str):
            raise InputError("json must be a JSON schema, as an object or as JSON text")
        return Grammar.json_schema(item)
    if key == "choice":
        if not isinstance(item, list) or not item or \
                not all(isinstance(c, str) and c for c in item):
            raise InputError("choice must be a non-empty list of non-empty strings")
        return Grammar.choice(item)
    if not isinstance(item, str):
        raise InputError(f"{key} must be a string")
    return Grammar(key, item)
