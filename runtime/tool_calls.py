"""Tool (function) calling: the calls a reply makes, and the grammar that makes a reply nothing
but calls (the tools a request offers are `runtime/tool_set`).

Follows OpenAI's chat API (`tools`, `tool_choice`, `parallel_tool_calls`; a call's `arguments`
is JSON text) and the call syntaxes small open models are trained on, as data (`ToolFormat`):
Hermes-style `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5 and
Qwen3, SmolLM3, Granite 4, Hermes; and specedge's own prompt for templates that take no tools,
`runtime/tool_prompt`), Phi-4-mini's `<|tool_call|>{...}<|/tool_call|>`, Llama 3's bare
`{"name": ..., "parameters": {...}}`, one JSON array of calls after a tag: Mistral's
`[TOOL_CALLS][{...}, ...]` (v3 to v7 tokenizers: Mistral 7B v0.3, Nemo, Small 3.1) and Granite
3's `<|tool_call|>[{...}, ...]`, and each call its name then its arguments after a tag, as
Mistral's v11 and later tokenizers write them: `[TOOL_CALLS]name[ARGS]{...}` (Ministral 3,
Magistral, Devstral) and `[TOOL_CALLS]name[CALL_ID]a1b2c3d4e[ARGS]{...}` (Mistral Small 3.2).

`tool_choice` "required" or a named function makes the reply calls only: a grammar (one JSON
schema per tool, its `parameters` as the arguments' schema, llguidance's `%json` in a Lark
grammar) constrains decoding, so speculation stays exact (`runtime/grammar`) and every call
parses and fits its schema. "auto" decodes freely and finds the calls in the text; "none"
shows the model no tools. `ToolStream` (`runtime/tool_stream`) finds them in a streamed reply,
giving what `parse` gives on the whole text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .grammar import Grammar
from .held_text import partial_suffix
from .tool_set import TOOL_NAME, Tool

__all__ = ["GRANITE3", "HERMES", "LLAMA3_JSON", "MISTRAL", "MISTRAL_ARGS", "MISTRAL_CALL_ID",
           "PHI4", "TOOL_FORMATS", "ToolCall", "ToolFormat", "ToolOutput"]

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# A call id a model writes that the server keeps (as the end of the id it returns).
MODEL_CALL_ID = re.compile(r"[A-Za-z0-9]{1,32}")

@dataclass(frozen=True)
class ToolCall:
    """One call a reply makes: the function's name, its arguments as JSON text and the id the
    model wrote for it, where its format has one (Mistral Small 3.2's `[CALL_ID]a1b2c3d4e`)."""

    name: str
    arguments: str
    model_id: str | None = None


@dataclass(frozen=True)
class ToolOutput:
    """A reply split into its text (None when there is none) and its calls."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls.

    Attributes:
        name: the format's name.
        call_open, call_close: the text around each call ("" for a bare JSON object).
        separator: between two calls of one reply.
        arguments_key: the key of a call's arguments in its JSON object.
        parallel: the format may hold several calls in one reply.
        markers: text in a chat template that says its model writes this format.
        listed: the calls are one JSON array after `call_open` (`separator` between them;
            no `call_close`).
        call_id_length: the length of the call ids its chat template takes, letters and digits
            only (Mistral's templates refuse others); 0: any id.
        args_tag: each call is `call_open`, the function's name, this tag and the arguments as
            one JSON object, the calls of a reply one after another (Mistral v11+:
            `[TOOL_CALLS]name[ARGS]{...}`); "": the name is in the call's JSON.
        id_tag: with `args_tag`, the call's id is written between the name and `args_tag`
            after this tag (Mistral Small 3.2: `name[CALL_ID]a1b2c3d4e[ARGS]`).
    """

    name: str
    call_open: str
    call_close: str
    separator: str
    arguments_key: str
    parallel: bool = True
    markers: tuple[str, ...] = field(default=(), compare=False)
    listed: bool = False
    call_id_length: int = 0
    args_tag: str = ""
    id_tag: str = ""

    def __post_init__(self) -> None:
        assert not (self.listed and self.call_close), "a listed format has no close tag"
        assert not self.args_tag or (self.open_tag and not self.call_close and not self.listed), \
            "a call with its name before its arguments opens with a tag and ends with its JSON"
        assert not self.id_tag or self.args_tag, "a call id goes between a name and arguments"

    @classmethod
    def for_template(cls, source: str | None) -> ToolFormat | None:
        """The format a chat template's model writes: the first of `TOOL_FORMATS` whose
        marker the template holds (None: none)."""
        return next((f for f in TOOL_FORMATS if source and any(m in source for m in f.markers)),
                    None)

    @property
    def open_tag(self) -> str:
        """What opens a call in a reply (`call_open` without its whitespace: a model may
        write the tag and the JSON on one line)."""
        return self.call_open.strip()

    @property
    def close_tag(self) -> str:
        return self.call_close.strip()

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag this format's calls hold (what decoded text must keep: `runtime/text`)."""
        return tuple(t for t in (self.open_tag, self.close_tag, self.id_tag, self.args_tag) if t)

    def write(self, call: ToolCall) -> str:
        """The text of one call in this format (what the model writes)."""
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError:  # a client's malformed arguments: written as the text they are
            arguments = call.arguments
        if self.args_tag:
            own = call.model_id or hashlib.sha256(f"{call.name}{call.arguments}".encode()) \
                .hexdigest()[:self.call_id_length or 9]
            call_id = self.id_tag + own if self.id_tag else ""
            return f"{self.call_open}{call.name}{call_id}{self.args_tag}" + \
                json.dumps(arguments, ensure_ascii=False)
        body = json.dumps({"name": call.name, self.arguments_key: arguments},
                          ensure_ascii=False)
        return self.call_open + (f"[{body}]" if self.listed else body) + self.call_close

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> Grammar:
        """A reply of calls only, one of `tools` each (several when `parallel` and the format
        allows it), each arguments object fitting its tool's schema.

        Raises:
            InputError: a tool's parameters schema that llguidance cannot compile.
        """
        if self.args_tag:
            return self._named_grammar(tools, parallel and self.parallel)
        objects = [{"type": "object",
                    "properties": {"name": {"const": t.name},
                                   self.arguments_key: json.loads(t.parameters)},
                    "required": ["name", self.arguments_key], "additionalProperties": False}
                   for t in tools]
        schema = objects[0] if len(objects) == 1 else {"anyOf": objects}
        body = json.dumps({**schema, "x-guidance": _JSON_STYLE}, ensure_ascii=False)
        tags = tuple(t for t in (self.open_tag, self.close_tag) if t)
        many = parallel and self.parallel
        head, tail = _around(self.call_open, tags), _around(self.call_close, tags)
        if self.listed:  # one array after the tag: [call, call, ...]
            start = " ".join([*head, '" "? "["', "obj", self._more("obj", many), '"]"', *tail])
            rules = f"start: {start}\n"
        else:
            rules = (f"start: call {self._more('call', many)}\n"
                     f"call: {' '.join([*head, 'obj', *tail])}\n")
        rules += f"obj: %json {body}\n"
        return Grammar("grammar", rules, tags=tags)

    def _named_grammar(self, tools: Sequence[Tool], many: bool) -> Grammar:
        """Calls of a format that writes each call's name before its arguments object: one
        alternative a tool, its name then its own schema's object."""
        tags = self.tags
        rule = {tag: f"tag{i}" for i, tag in enumerate(tags)}
        call_id = f" {rule[self.id_tag]} /[A-Za-z0-9]{{{self.call_id_length or 9}}}/" \
            if self.id_tag else ""
        choices = " | ".join(f"{json.dumps(t.name)}{call_id} {rule[self.args_tag]} args{i}"
                             for i, t in enumerate(tools))
        rules = f"start: call{'+' if many else ''}\ncall: {rule[self.open_tag]} ({choices})\n"
        rules += "".join(f"args{i}: %json " + json.dumps(
            {**json.loads(t.parameters), "x-guidance": _JSON_STYLE}, ensure_ascii=False) + "\n"
            for i, t in enumerate(tools))
        return Grammar("grammar", rules, tags=tags)

    def _more(self, item: str, many: bool) -> str:
        """Lark for the further `item`s after the first (none unless `many`)."""
        if not many:
            return ""
        return f"({json.dumps(self.separator)} {item})*" if self.separator else f"{item}*"

    def parse(self, text: str) -> ToolOutput:
        """The calls in a whole reply, and its text outside them (stripped; None if empty). A
        call that is not a JSON object with a string name stays text."""
        opening, closing = self.open_tag, self.close_tag
        if not opening:
            return self._parse_bare(text)
        if self.listed:
            return self._parse_listed(text)
        if self.args_tag:
            return self._parse_named(text)
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while (start := text.find(opening, pos)) >= 0:
            content.append(text[pos:start])
            end = text.find(closing, start + len(opening))
            stop = len(text) if end < 0 else end + len(closing)
            call = self.call_from(text[start + len(opening):end if end >= 0 else len(text)])
            if call is None:
                content.append(text[start:stop])
            else:
                calls.append(call)
            pos = stop
        content.append(text[pos:])
        return ToolOutput("".join(content).strip() or None, tuple(calls))

    def _parse_bare(self, text: str) -> ToolOutput:
        stripped = text.strip()
        calls: list[ToolCall] = []
        pos, decoder = 0, json.JSONDecoder()
        while stripped.startswith("{", pos):
            try:
                obj, pos = decoder.raw_decode(stripped, pos)
            except ValueError:
                break
            call = self._call_object(obj)
            if call is None:
                break
            calls.append(call)
            rest = stripped[pos:].lstrip()
            sep = self.separator.strip()
            if sep and rest.startswith(sep):
                rest = rest[len(sep):].lstrip()
            pos = len(stripped) - len(rest)
        if calls and pos == len(stripped):
            return ToolOutput(None, tuple(calls))
        return ToolOutput(stripped or None)

    def _parse_listed(self, text: str) -> ToolOutput:
        """The calls of the array after the first `call_open` (the text around it is content;
        a reply whose array does not parse, or holds anything but calls, is all text)."""
        start = text.find(self.open_tag)
        found = self.array_after(text[start + len(self.open_tag):]) if start >= 0 else None
        if found is None:
            return ToolOutput(text.strip() or None)
        calls, rest = found
        return ToolOutput((text[:start] + rest).strip() or None, calls)

    def _parse_named(self, text: str) -> ToolOutput:
        """Calls that each open with the tag, up to the first that does not parse (it and all
        after it is text); the text between calls is content."""
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while (start := text.find(self.open_tag, pos)) >= 0:
            found = self.named_after(text[start + len(self.open_tag):])
            if found is None:
                break
            content.append(text[pos:start])
            calls.append(found[0])
            pos = len(text) - len(found[1])
        content.append(text[pos:])
        return ToolOutput("".join(content).strip() or None, tuple(calls))

    def named_after(self, body: str) -> tuple[ToolCall, str] | None:
        """The call `body` (the text after a call's open tag) starts with, `name[ARGS]{...}`
        with `args_tag` (a call id before that tag is kept as `model_id` when it is up to 32
        letters and digits), and the text after it; None when it does not start with one."""
        head, tag, rest = body.partition(self.args_tag)
        name, _, call_id = head.partition(self.id_tag) if self.id_tag else (head, "", "")
        name, call_id = name.strip(), call_id.strip()
        if not tag or not TOOL_NAME.fullmatch(name):
            return None
        rest = rest.lstrip()
        try:
            arguments, end = json.JSONDecoder().raw_decode(rest)
        except ValueError:
            return None
        if not isinstance(arguments, dict):
            return None
        own = call_id if MODEL_CALL_ID.fullmatch(call_id) else None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False), own), rest[end:]

    def named_fails(self, body: str) -> bool:
        """`body` (text after a call's open tag, as far as it has arrived) cannot start a call
        however it goes on: a name that is no name, or arguments that are not an object."""
        head, tag, rest = body.partition(self.args_tag)
        if not tag:  # still in the name: drop what may be the start of a tag
            head = head[:len(head) - max(partial_suffix(head, self.args_tag),
                                         partial_suffix(head, self.id_tag or self.args_tag))]
        name = head.partition(self.id_tag)[0] if self.id_tag else head
        stripped = name.strip()  # space inside it shows once a letter follows
        if len(stripped) > 64 or not re.fullmatch(r"[A-Za-z0-9_-]*", stripped):
            return True
        if tag:
            after = rest.lstrip()
            return not stripped or (bool(after) and not after.startswith("{"))
        return False

    def array_after(self, text: str) -> tuple[tuple[ToolCall, ...], str] | None:
        """The calls of the JSON array (or one object) `text` starts with (after whitespace),
        and the text after it; None when it does not parse as calls."""
        body = text.lstrip()
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [self._call_object(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return tuple(c for c in calls if c is not None), body[end:]

    def call_from(self, body: str) -> ToolCall | None:
        """The call a JSON text between `call_open` and `call_close` makes (None: none)."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return self._call_object(obj)

    def _call_object(self, obj: Any) -> ToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get(self.arguments_key, obj.get("arguments", {}))
        return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _around(text: str, tags: Sequence[str]) -> list[str]:
    """Lark for `text` (the text before or after a call's JSON) with the tag in it as its rule
    (`tag0`, `tag1`: the tag of `tags` at that index; see `Grammar.tags`)."""
    tag = text.strip()
    if not tag:
        return [json.dumps(text)] if text else []
    head, tail = text.split(tag, 1)
    return [json.dumps(head)] * bool(head) + [f"tag{list(tags).index(tag)}"] + \
        [json.dumps(tail)] * bool(tail)


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments",
                    markers=("<tool_call>",))
PHI4 = ToolFormat("phi4", "<|tool_call|>", "<|/tool_call|>", "", "arguments",
                  markers=("<|/tool_call|>",))
GRANITE3 = ToolFormat("granite3", "<|tool_call|>", "", ", ", "arguments", listed=True,
                      markers=("<|tool_call|>",))
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", ", ", "arguments", listed=True,
                     markers=("[TOOL_CALLS]",), call_id_length=9)
MISTRAL_CALL_ID = ToolFormat("mistral_call_id", "[TOOL_CALLS]", "", "", "arguments",
                             markers=("[CALL_ID]",), call_id_length=9, args_tag="[ARGS]",
                             id_tag="[CALL_ID]")
MISTRAL_ARGS = ToolFormat("mistral_args", "[TOOL_CALLS]", "", "", "arguments",
                          markers=("[ARGS]",), args_tag="[ARGS]")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "; ", "parameters", parallel=False,
                         markers=("<|start_header_id|>",))
# The first whose marker a template holds (PHI4 before GRANITE3: Phi-4's template holds both
# tags; Mistral's by the newest tag: a [CALL_ID] template holds [ARGS], both hold
# [TOOL_CALLS]); a template that takes tools and holds none is taken as Hermes.
TOOL_FORMATS = (HERMES, PHI4, GRANITE3, MISTRAL_CALL_ID, MISTRAL_ARGS, MISTRAL, LLAMA3_JSON)
