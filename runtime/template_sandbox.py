"""The bounded jinja2 sandbox chat templates run in.

A chat template is code from a model's files. `BoundedSandbox` is jinja2's immutable sandbox
with the globals and filters transformers gives templates (`raise_exception`, `strftime_now`,
its `tojson`), bounded in time, steps and sizes: every loop, call, lookup and operator counts
against `RENDER_STEPS` and `RENDER_SECONDS`, and any value or the output against a character
limit, so a hostile or broken template raises `LimitExceeded` instead of hanging or building a
huge string. `guard_loops` rewrites a parsed template so that its loops and concatenations are
counted; `environment()` is the sandbox with transformers' settings (`runtime/chat_template`
compiles and renders templates in it; the exporter checks `--chat-template` with it).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor

from .errors import InputError

__all__ = ["MAX_INT_BITS", "RENDER_SECONDS", "RENDER_STEPS", "BoundedSandbox", "LimitExceeded",
           "environment", "guard_loops"]

#: Limits of one chat-template render.
RENDER_SECONDS = 1.0
RENDER_STEPS = 1_000_000  # loop iterations, calls, attribute and item lookups, operators
MAX_INT_BITS = 4096


def _raise_exception(message: Any) -> NoReturn:
    """The `raise_exception` global of chat templates: rejects the conversation.

    Args:
        message: The template's message.

    Raises:
        InputError: Always.
    """
    raise InputError(f"the chat template rejected the messages: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    """The `tojson` filter as transformers defines it (no HTML escaping, unlike jinja2's).

    Args:
        value: The value to serialize.
        ensure_ascii: Escape non-ASCII characters.
        indent: Indentation, or None for one line.
        sort_keys: Sort dict keys.

    Returns:
        The JSON text.
    """
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """The `strftime_now` global of chat templates (used by some templates for the date).

    Args:
        fmt: A `strftime` format.

    Returns:
        The current local time, formatted.
    """
    return datetime.now().strftime(fmt)


class LimitExceeded(Exception):
    """A chat template went past one of its render limits (caught by `render_chat`)."""


_DIGITS = re.compile(r"\d+")


class _Budget(threading.local):
    """The limits of the render running in this thread."""

    deadline = 0.0
    steps = 0
    max_chars = 0  # set by `start` before each render


class _ChecksLoopsAndConcat(jinja2.visitor.NodeTransformer):
    """Rewrites a parsed template so that every `for` loop steps through `__loop_guard` (one
    budget step per item) and every `~` concatenation goes through `__concat_guard` (size
    checked before the string is built). Both are calls, so the sandbox's `call` sees them."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = jinja2.nodes.Call(jinja2.nodes.Name("__loop_guard", "load"), [node.iter],
                                      [], None, None)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return jinja2.nodes.Call(jinja2.nodes.Name("__concat_guard", "load"), list(node.nodes),
                                 [], None, None)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | list | tuple | dict) else 0


class _BoundedFormatter(jinja2.sandbox.SandboxedFormatter):
    """`str.format` in the sandbox, refusing field widths beyond the size limit."""

    def __init__(self, env: BoundedSandbox) -> None:
        super().__init__(env)
        self._bounded = env

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._bounded.check_format(format_spec)
        return super().format_field(value, format_spec)


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """An immutable jinja sandbox whose renders are bounded in time, steps and sizes.

    Every hook the sandbox offers (calls, attribute and item lookups, the arithmetic
    operators) takes one step and checks the deadline; `for` loops and `~` are rewritten into
    calls (`_ChecksLoopsAndConcat`); filters are wrapped. Operations that can build a large value
    from a small one (`*`, `**`, `+`, `%`, `~`, `str.format` widths, `center`, `indent`,
    `join`, `replace`, `batch`) are checked *before* they run, and every value a hook returns
    after. A render that exceeds a limit raises `LimitExceeded`.
    """

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.budget = _Budget()
        self.globals.pop("lipsum", None)  # builds text of any size from one call
        self.globals["__loop_guard"] = self._loop_guard
        self.globals["__concat_guard"] = self._concat_guard
        self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}

    # ---------------------------------------------------------------- budget

    def start(self, max_chars: int) -> None:
        """Reset the limits for a render in this thread."""
        self.budget.deadline = time.monotonic() + RENDER_SECONDS
        self.budget.steps = 0
        self.budget.max_chars = max_chars

    def step(self) -> None:
        b = self.budget
        b.steps += 1
        if b.steps > RENDER_STEPS:
            raise LimitExceeded(f"more than {RENDER_STEPS} steps")
        if time.monotonic() > b.deadline:
            raise LimitExceeded(f"more than {RENDER_SECONDS:g} s")

    def check_size(self, size: int, what: str = "a value") -> None:
        if size > self.budget.max_chars:
            raise LimitExceeded(f"{what} of {size} characters or items (at most "
                                 f"{self.budget.max_chars})")

    def checked(self, value: Any) -> Any:
        self.check_size(_size(value))
        if isinstance(value, int) and not isinstance(value, bool) and \
                value.bit_length() > MAX_INT_BITS:
            raise LimitExceeded(f"an integer of {value.bit_length()} bits")
        return value

    def check_format(self, fmt: Any) -> None:
        """Field widths and precisions in a format string (or spec) within the size limit."""
        if isinstance(fmt, str):
            for digits in _DIGITS.findall(fmt):
                if len(digits) > 12 or int(digits) > self.budget.max_chars:
                    raise LimitExceeded(f"a format width of {digits}")

    # ---------------------------------------------------------------- hooks

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.step()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.step()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            __self._check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return __self.checked(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.step()
        ints = [isinstance(x, int) and not isinstance(x, bool) for x in (left, right)]
        if operator == "*":
            if all(ints):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise LimitExceeded("an integer product beyond the limit")
            elif ints[0] or ints[1]:
                count, seq = (left, right) if ints[0] else (right, left)
                self.check_size(max(0, count) * _size(seq), "a repeated value")
        elif operator == "**" and all(ints) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > MAX_INT_BITS:
                raise LimitExceeded("a power beyond the integer limit")
        elif operator == "+" and _size(left) and _size(right):
            self.check_size(_size(left) + _size(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            self._check_percent(left, right)
        return self.checked(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if super().wrap_str_format(value) is None:
            return None
        f_self: str = value.__self__
        formatter = _BoundedFormatter(self)
        is_format_map = value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                kwargs, args = args[0], ()
            return str(self.checked(formatter.vformat(f_self, args, kwargs)))

        return functools.update_wrapper(wrapper, value)

    # ---------------------------------------------------------------- guards

    def _loop_guard(self, iterable: Iterable[Any]) -> Iterable[Any]:
        for item in iterable:
            self.step()
            yield item

    def _concat_guard(self, *parts: Any) -> str:
        texts = [str(p) for p in parts]
        self.check_size(sum(map(len, texts)), "a concatenation")
        return "".join(texts)

    def _check_percent(self, fmt: str, args: Any) -> None:
        self.check_format(fmt)
        if "*" in fmt:
            for arg in args if isinstance(args, tuple) else (args,):
                if isinstance(arg, int) and abs(arg) > self.budget.max_chars:
                    raise LimitExceeded(f"a format width of {arg}")

    def _check_str_method(self, text: str, name: str, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> None:
        values = list(args) + list(kwargs.values())
        if name in ("center", "ljust", "rjust", "zfill") and values:
            self.check_size(values[0] if isinstance(values[0], int) else 0, "a padded string")
        elif name == "expandtabs":
            width = values[0] if values and isinstance(values[0], int) else 8
            self.check_size(len(text) + max(0, width) * text.count("\t"), "expanded tabs")
        elif name == "replace" and len(values) >= 2:
            self._check_replace(text, values[0], values[1])
        elif name == "join" and values:
            self._check_join(text, values[0])

    def _check_replace(self, text: str, old: Any, new: Any) -> None:
        if isinstance(old, str) and isinstance(new, str):
            count = text.count(old) if old else len(text) + 1
            self.check_size(len(text) + count * len(new), "a replacement")

    def _check_join(self, sep: Any, items: Any) -> None:
        if isinstance(items, list | tuple):
            total = len(str(sep)) * max(0, len(items) - 1)
            for item in items:
                total += len(item) if isinstance(item, str) else 16
                self.check_size(total, "a joined string")

    def _guard_filter(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        passes = getattr(fn, "jinja_pass_arg", None) is not None

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.step()
            given = list(args[1:] if passes else args)
            value, rest = (given[0] if given else None), given[1:] + list(kwargs.values())
            if name in ("center", "batch", "slice") and rest and isinstance(rest[0], int):
                self.check_size(rest[0], f"the {name} filter's size")
            elif name == "indent" and isinstance(value, str) and rest:
                width = rest[0] if isinstance(rest[0], int) else _size(rest[0])
                self.check_size(len(value) + (value.count("\n") + 1) * max(0, width),
                                "an indented string")
            elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
                self._check_replace(value, rest[0], rest[1])
            elif name == "join":
                if value is not None and not isinstance(value, list | tuple | str | dict):
                    value = list(self._loop_guard(value))
                    given[0] = value
                self._check_join(rest[0] if rest else "", value)
            elif name == "format" and isinstance(value, str):
                self._check_percent(value, tuple(rest))
            elif name == "tojson":
                for v in rest:
                    if isinstance(v, int) and not isinstance(v, bool) and v > 64:
                        raise LimitExceeded(f"a JSON indent of {v}")
            args = (*args[:1], *given) if passes else tuple(given)
            return self.checked(fn(*args, **kwargs))

        return guarded


def environment() -> BoundedSandbox:
    """The sandbox chat templates run in, with transformers' template globals and filters:
    `trim_blocks`, `lstrip_blocks`, the loop controls, `raise_exception`, `strftime_now` and
    `tojson` (without HTML escaping)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = env._guard_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def guard_loops(tree: jinja2.nodes.Template) -> jinja2.nodes.Template:
    """`tree` with its loops and concatenations counted against the render's budget."""
    out: jinja2.nodes.Template = _ChecksLoopsAndConcat().visit(tree)
    return out
