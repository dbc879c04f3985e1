"""Chat templates: untrusted jinja2 code rendered in a bounded sandbox.

A pair's chat template (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`, as
Hugging Face transformers exports them) is code from the model's files. `ChatTemplate` compiles it
once in `template_sandbox.BoundedSandbox` (jinja2's immutable sandbox, bounded in time, steps and
sizes) and renders chat messages: a hostile or broken template ends in a one-line `InputError`,
never a hang or a huge string. `environment()` is the same sandbox for checking a template's
syntax (the exporter's `--chat-template`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta

from .errors import FieldError, InputError
from .template_sandbox import LimitExceeded, environment, guard_loops

MAX_TEMPLATE_CHARS = 1 << 20  # real chat templates are a few KiB
# The variables the renderer sets itself, which a request's template variables may not replace.
RESERVED_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                      "raise_exception", "strftime_now")
MAX_VARIABLES = 32


def pick_chat_template(value: Any) -> str | None:
    """Returns the chat template stored in `tokenizer_config.json`, if any.

    Args:
        value: The raw `chat_template` value: a string, or a list of `{name, template}` dicts
            from which the one named "default" is picked.

    Returns:
        The template source, or None when there is no usable template.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if (
                isinstance(entry, Mapping)
                and entry.get("name") == "default"
                and isinstance(entry.get("template"), str)
            ):
                return str(entry["template"])
    return None



def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks chat messages and returns plain dict copies of them.

    Args:
        messages: A non-empty sequence of mappings, each with a str `role` and a str `content`.

    Returns:
        The messages as a list of dicts.

    Raises:
        InputError: If the messages are not of that shape.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InputError(
            f"chat messages must be a list of {{'role': ..., 'content': ...}} dicts, "
            f"got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise InputError("chat messages must be a non-empty list, got an empty one")
    result: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InputError(
                f"chat message {i} must be a dict with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise InputError(f"chat message {i} has no {key!r} key")
            if not isinstance(message[key], str):
                raise InputError(
                    f"chat message {i} {key!r} must be a string, got {type(message[key]).__name__}"
                )
        result.append(dict(message))
    return result


class ChatTemplate:
    """A chat template compiled once in the bounded sandbox (thread-safe: each thread renders
    with its own budget)."""

    def __init__(self, source: str) -> None:
        """Compiles `source`.

        Raises:
            InputError: the template is too long or not valid jinja.
        """
        if len(source) > MAX_TEMPLATE_CHARS:
            raise InputError(f"the chat template has {len(source)} characters "
                             f"(at most {MAX_TEMPLATE_CHARS}); re-export the pair")
        self.env = environment()
        try:
            tree = guard_loops(self.env.parse(source))
            self.template = self.env.from_string(tree)
            self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(tree)
        except jinja2.TemplateError as exc:
            raise InputError(f"the chat template is invalid: {exc}") from None
        except (RecursionError, MemoryError, ValueError, SyntaxError) as exc:
            raise InputError(f"the chat template is invalid: {type(exc).__name__}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               bos_token: str, eos_token: str, max_chars: int,
               tools: Sequence[Mapping[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """Renders chat messages with `messages`, `add_generation_prompt`, `bos_token`,
        `eos_token` and `tools` (None, as transformers passes it, when there are none), and
        `variables` (more template variables, e.g. `enable_thinking`: `template_variables`),
        bounded to `template_sandbox.RENDER_SECONDS`, `RENDER_STEPS` and `max_chars`
        characters for any value and for the output.

        Raises:
            InputError: the messages are malformed, or the template rejects them, fails or
                exceeds a render limit.
        """
        checked = validate_messages(messages)
        env = self.env
        env.start(max_chars)
        parts: list[str] = []
        size = 0
        try:
            for part in self.template.generate(
                **template_variables(variables),
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
                tools=None if tools is None else [dict(t) for t in tools],
            ):
                size += len(part)
                env.check_size(size, "the rendered prompt")
                env.step()
                parts.append(part)
        except InputError:
            raise
        except LimitExceeded as exc:
            raise InputError(
                f"the chat template exceeded its limits ({exc}); the pair's chat template is "
                "broken or hostile, or the conversation is too long for the context"
            ) from None
        except jinja2.TemplateError as exc:
            raise InputError(f"the chat template failed to render: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                ZeroDivisionError, RecursionError, MemoryError) as exc:
            # Templates are untrusted code run in a sandbox: any failure is a clear input error.
            raise InputError(
                f"the chat template failed to render: {type(exc).__name__}: {str(exc)[:200]}"
            ) from None
        return "".join(parts)


def template_variables(value: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """Extra chat template variables (a request's `chat_template_kwargs`, as vLLM and
    llama.cpp's server take them: `{"enable_thinking": false}` for Qwen3), checked: at most
    `MAX_VARIABLES` names, none of the `RESERVED_VARIABLES` the renderer sets.

    Raises:
        FieldError: naming `where` (or the offending name in it).
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping) or len(value) > MAX_VARIABLES:
        raise FieldError(where, f"expected an object of at most {MAX_VARIABLES} template "
                                "variables, e.g. {\"enable_thinking\": false}")
    for name in value:
        if not isinstance(name, str) or not name.isidentifier():
            raise FieldError(where, f"{name!r} is not a template variable name")
        if name in RESERVED_VARIABLES:
            raise FieldError(f"{where}.{name}", "is set by the server itself; send it the "
                                                "way the API does (messages, tools, ...)")
    return dict(value)

