"""A tool-calling conversation into a prompt, and how its reply is read (`ToolPlan`).

A chat template that names `tools` renders them itself, as its model was trained: the tools as
OpenAI writes them, and earlier calls as messages' `tool_calls` with their arguments as objects
(as transformers' `apply_chat_template` passes them); its call syntax is the `ToolFormat` whose
marker the template holds (`runtime/tool_calls`). A template that takes no tools gets them in
its system message, with the Hermes call syntax explained, and earlier calls and tool results
as text, so any chat model can be offered tools (how well it uses them is the model's).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .grammar import Grammar
from .text import Tokenizer
from .tool_calls import HERMES, ToolCall, ToolFormat
from .tool_set import ToolSet

__all__ = ["ToolPlan", "has_tool_turns"]

_SYSTEM = """Functions you may call:
<tools>
{tools}
</tools>
To call one, reply <tool_call>
{{"name": <name>, "arguments": <object>}}
</tool_call>"""


def has_tool_turns(messages: Sequence[Mapping[str, Any]]) -> bool:
    """The conversation holds earlier calls or tool results."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


@dataclass(frozen=True)
class ToolPlan:
    """How one pair's chat template takes tools, and the request's tools.

    Attributes:
        fmt: the call syntax the model writes.
        native: the chat template renders tools itself (else specedge's system message does).
        tools: the request's tools (None: a conversation with tool turns but no tools now).
    """

    fmt: ToolFormat
    native: bool
    tools: ToolSet | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, tools: ToolSet | None) -> ToolPlan:
        """The plan for a pair's chat template (`pair.tokenizer`).

        Raises:
            InputError: the pair has no chat template, or it does not compile.
        """
        native = tokenizer.chat_takes_tools
        fmt = (ToolFormat.for_template(tokenizer.chat_template) or HERMES) if native else HERMES
        return cls(fmt, native, tools)

    @property
    def shown(self) -> ToolSet | None:
        """The tools the prompt shows ("none" shows none: the reply is text)."""
        return None if self.tools is None or self.tools.choice == "none" else self.tools

    @property
    def grammar(self) -> Grammar | None:
        """The grammar of a reply of calls only ("required" or a named function), else None.

        Raises:
            InputError: a tool's parameters schema that does not compile.
        """
        forced = self.tools.forced() if self.tools is not None else ()
        return self.fmt.grammar(forced, self.tools.parallel) if self.tools and forced else None

    @property
    def parses_calls(self) -> bool:
        """The reply is read for calls (tools are offered and the choice is not "none")."""
        return self.shown is not None

    def messages(self, messages: Sequence[Mapping[str, Any]]
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and the `tools` the chat template gets."""
        shown = self.shown
        if self.native:
            return [_native(m, self.fmt.call_id_length) for m in messages], \
                shown.openai() if shown else None
        out = [_as_text(m) for m in messages]
        if shown is not None:
            listing = "\n".join(json.dumps(t["function"], ensure_ascii=False)
                                for t in shown.openai())
            system = _SYSTEM.format(tools=listing)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
            else:
                out.insert(0, {"role": "system", "content": system})
        return out, None

    def prompt_text(self, tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                    variables: Mapping[str, Any] | None = None, *,
                    add_generation_prompt: bool = True) -> str:
        """The prompt as the chat template renders it (`variables`: more template variables;
        without the generation prompt: a conversation the next message follows).

        Raises:
            InputError: the chat template refuses the messages, tools or variables.
        """
        rendered, tools = self.messages(messages)
        return tokenizer.render_chat(rendered, tools=tools, variables=variables,
                                     add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                   variables: Mapping[str, Any] | None = None) -> list[int]:
        """The prompt's token ids.

        Raises:
            InputError: the chat template refuses the messages, tools or variables.
        """
        return tokenizer.encode_rendered(self.prompt_text(tokenizer, messages, variables))


def _calls(message: Mapping[str, Any]) -> list[tuple[ToolCall, Mapping[str, Any]]]:
    out = []
    for entry in message.get("tool_calls") or []:
        function = entry.get("function") or {}
        arguments = function.get("arguments")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
        out.append((ToolCall(str(function.get("name", "")), text), entry))
    return out


def _native(message: Mapping[str, Any], id_length: int) -> dict[str, Any]:
    out = {**message, "content": message.get("content") or ""}
    if calls := _calls(message):
        out["tool_calls"] = [{**entry, "type": "function",
                              "id": _call_id(entry.get("id"), id_length),
                              "function": {"name": call.name,
                                           "arguments": _object(call.arguments)}}
                             for call, entry in calls]
    if "tool_call_id" in message:
        out["tool_call_id"] = _call_id(message["tool_call_id"], id_length)
    return out


def _call_id(call_id: Any, length: int) -> Any:
    """A call id as a template that takes ids of `length` letters and digits reads it: the
    id's last `length` characters when they are such, else as many of its sha256's (so that a
    call and its result still match); the id itself when `length` is 0."""
    if not length or not isinstance(call_id, str):
        return call_id
    tail = call_id[-length:]
    if len(tail) == length and tail.isascii() and tail.isalnum():
        return tail
    return hashlib.sha256(call_id.encode()).hexdigest()[:length]


def _object(arguments: str) -> Any:
    """A call's arguments as templates take them: the object its JSON text holds."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _as_text(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content") or ""
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if calls := _calls(message):
        written = "\n".join(HERMES.write(call) for call, _ in calls)
        return {"role": message["role"], "content": f"{content}\n{written}" if content
                else written}
    return {"role": message["role"], "content": content}
