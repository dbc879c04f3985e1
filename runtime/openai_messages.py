"""The chat API's `messages`, checked: roles, text content, and the turns of a tool-calling
conversation (an assistant's `tool_calls`, a `tool` message's result), as OpenAI's chat API
writes them. Pure functions; a bad message is a `FieldError` naming it."""

from __future__ import annotations

from typing import Any

from .errors import FieldError

__all__ = ["ROLES", "messages_field"]

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
MAX_CALLS = 128  # calls in one assistant message


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise FieldError(where, "only text content parts ({'type': 'text', 'text': "
                                        "...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise FieldError(where, f"expected a string or a list of text parts, got {_short(value)}")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`: `{"id", "type": "function", "function": {"name",
    "arguments"}}` each, the arguments as JSON text."""
    if not isinstance(value, list) or len(value) > MAX_CALLS:
        raise FieldError(where, f"expected a list of at most {MAX_CALLS} tool calls")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name or not isinstance(arguments, str):
            raise FieldError(f"{where}[{i}]", "expected {'id': ..., 'type': 'function', "
                                              "'function': {'name': ..., 'arguments': "
                                              "'<JSON text>'}}")
        call_id = call.get("id")
        calls.append({"id": call_id if isinstance(call_id, str) else f"call_{i}",
                      "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def messages_field(value: Any) -> list[dict[str, Any]]:
    """A request's `messages`: each one's role and text content (an assistant's may be null),
    its calls and the `reasoning_content` a reply came with (as the server returns it), and a
    tool message's `tool_call_id` and `name`.

    Raises:
        FieldError: naming the message and field at fault.
    """
    if not isinstance(value, list) or not value:
        raise FieldError("messages", "expected a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise FieldError(where, f"expected an object, got {_short(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise FieldError(f"{where}.role", f"expected one of {', '.join(ROLES)}, got "
                                              f"{_short(role)}")
        if message.get("function_call"):
            raise FieldError(f"{where}.function_call", "the deprecated function_call is not "
                                                       "supported; send tool_calls")
        calls = message.get("tool_calls")
        if calls and role != "assistant":
            raise FieldError(f"{where}.tool_calls", "only assistant messages make tool calls")
        content = message.get("content")
        # An assistant's content may be null (OpenAI's API allows it): a reply of calls only,
        # or one that ended inside its thinking, as the server returns them.
        entry: dict[str, Any] = {"role": ROLES[role], "content": "" if content is None and (
            calls or role == "assistant") else _content(content, f"{where}.content")}
        if calls:
            entry["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "assistant" and isinstance(message.get("reasoning_content"), str):
            entry["reasoning_content"] = message["reasoning_content"]  # Qwen3's template reads it
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    entry[key] = message[key]
        out.append(entry)
    return out
