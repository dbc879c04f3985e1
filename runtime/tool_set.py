"""The tools a request offers and how its reply may use them: OpenAI's chat API `tools`
(function tools, each with a JSON schema of its arguments), `tool_choice` and
`parallel_tool_calls`, checked into frozen dataclasses (`ToolSet`); a wrong value is a
`ToolInputError` naming its field. How a model writes calls is `runtime/tool_calls`."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import FieldError

__all__ = ["MAX_TOOLS", "TOOL_NAME", "Tool", "ToolInputError", "ToolSet"]

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolInputError(FieldError):
    """A `tools` / `tool_choice` value a request got wrong (`param` names the field)."""


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, description and the JSON schema of its
    arguments (as JSON text)."""

    name: str
    description: str = ""
    parameters: str = json.dumps(_NO_PARAMETERS)

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's API and chat templates write it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSet:
    """The tools of a request and how the reply may use them.

    Attributes:
        tools: the functions offered.
        choice: "auto" (the model decides), "none" (no calls), "required" (calls only), or the
            name of the one function the reply must call.
        parallel: a reply may make several calls.
    """

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def from_openai(cls, tools: Any, tool_choice: Any = None,
                    parallel_tool_calls: Any = None) -> ToolSet:
        """Checks OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

        Raises:
            ToolInputError: naming the field at fault (a tool without a valid name, a
                duplicate, parameters that are not a JSON schema object, an unknown choice).
        """
        if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
            raise ToolInputError("tools", f"expected a list of 1 to {MAX_TOOLS} tools")
        parsed = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
        names = [t.name for t in parsed]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ToolInputError("tools", f"two tools are named {dup!r}; names must differ")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ToolInputError("parallel_tool_calls", "expected true or false")
        return cls(parsed, _choice(tool_choice, names), parallel_tool_calls is not False)

    def openai(self) -> list[dict[str, Any]]:
        return [t.openai() for t in self.tools]

    def forced(self) -> tuple[Tool, ...]:
        """The tools a reply must call one of ("required" or a named function); () when the
        reply is free ("auto", "none")."""
        if self.choice in ("auto", "none"):
            return ()
        return tuple(t for t in self.tools if self.choice in ("required", t.name))


def _tool(value: Any, where: str) -> Tool:
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type", "function") != "function" or \
            not isinstance(function, dict):
        raise ToolInputError(where, "expected {'type': 'function', 'function': {'name': ..., "
                                    "'parameters': {...}}}")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolInputError(f"{where}.function.name", "expected 1 to 64 letters, digits, _ "
                                                       "or -")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise ToolInputError(f"{where}.function.description", "expected a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise ToolInputError(f"{where}.function.parameters", "expected a JSON schema object")
    return Tool(name, description, json.dumps(parameters, ensure_ascii=False))


def _choice(value: Any, names: Sequence[str]) -> str:
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        return str(value)
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(name, str):
        if name not in names:
            raise ToolInputError("tool_choice", f"names function {name!r}, which is not one of "
                                                "the tools")
        return name
    raise ToolInputError("tool_choice", "expected 'auto', 'none', 'required' or {'type': "
                                        "'function', 'function': {'name': ...}}")
