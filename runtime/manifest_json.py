"""Typed, bounded reading of an untrusted JSON document (the pair manifest's parser).

`Reader` gives typed access to one JSON object, and every error names the file and the key path
and says what to do; the free-form objects are bounded in depth and size; paths are confined to
the pair folder and digests checked for form (the hashes themselves are checked on load).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .errors import ManifestError
from .files import confine

MAX_DEPTH = 32  # nesting of the free-form objects (validation, source, provenance)
MAX_NODES = 200_000  # values in one free-form object


class Reader:
    """Typed access to an untrusted JSON object; errors name the file and the key path."""

    def __init__(self, file: Path, data: Any, where: str = "") -> None:
        self.file, self.data, self.where = file, data, where
        if not isinstance(data, dict):
            self.fail(where or "<root>", "a JSON object", type(data).__name__)

    def fail(self, key: str, expected: str, found: Any) -> None:
        raise ManifestError(
            f"{self.file}: key '{key}' must be {expected}, found {short(found)}; "
            "re-export the pair with `specedge export`"
        )

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def get(self, name: str, kind: type | tuple[type, ...], *, required: bool = True,
            default: Any = None) -> Any:
        if name not in self.data:
            if required:
                raise ManifestError(
                    f"{self.file}: missing key '{self.key(name)}'; re-export the pair with "
                    "`specedge export`"
                )
            return default
        value = self.data[name]
        # bool is an int subclass: never accept it where a number is expected.
        if isinstance(value, bool) and bool not in _as_tuple(kind):
            self.fail(self.key(name), _kind_name(kind), value)
        if not isinstance(value, kind):
            self.fail(self.key(name), _kind_name(kind), value)
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(self.key(name), "a finite number", value)
        return value

    def int_in(self, name: str, lo: int, hi: int, *, required: bool = True,
               default: int | None = None) -> Any:
        value = self.get(name, int, required=required, default=default)
        if value is not None and not lo <= value <= hi:
            self.fail(self.key(name), f"an integer in [{lo}, {hi}]", value)
        return value

    def choice(self, name: str, options: tuple[str, ...], *, required: bool = True,
               default: str | None = None) -> Any:
        value = self.get(name, str, required=required, default=default)
        if value is not None and value not in options:
            self.fail(self.key(name), f"one of {', '.join(options)}", value)
        return value

    def sub(self, name: str, *, required: bool = True) -> Reader | None:
        if name not in self.data and not required:
            return None
        return Reader(self.file, self.get(name, dict), self.key(name))


def short(value: Any, limit: int = 200) -> str:
    """repr() for an error message: bounded in length, safe for any nesting."""
    try:
        text = repr(value)
    except RecursionError:
        return "<a deeply nested value>"
    return text if len(text) <= limit else text[:limit] + "..."


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def free_form(r: Reader, name: str) -> dict[str, Any]:
    """A free-form object (validation figures, provenance): any JSON, but bounded in depth and
    size, so that copying or serializing it later cannot blow the stack or the memory."""
    value = r.get(name, dict, required=False, default={})
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_DEPTH or nodes > MAX_NODES:
            r.fail(r.key(name), f"an object nested at most {MAX_DEPTH} deep with at most "
                   f"{MAX_NODES} values", f"<{'deeper' if depth > MAX_DEPTH else 'larger'}>")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return dict(value)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", str: "a string", dict: "an object", list: "a list",
             float: "a number", bool: "true or false", type(None): "null"}
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))


def file_map(r: Reader, name: str, root: Path) -> dict[str, str]:
    raw = r.get(name, dict)
    if not raw:
        r.fail(r.key(name), "a non-empty object of path -> sha256", raw)
    out: dict[str, str] = {}
    for rel, digest in raw.items():
        key = f"{r.key(name)}.{rel}"
        confine(root, rel, file=r.file, key=key)
        if not isinstance(digest, str) or len(digest) != 64 or \
                not all(c in "0123456789abcdef" for c in digest):
            r.fail(key, "a sha256 hex digest", digest)
        out[rel] = digest
    return out


def short_string(r: Reader, name: str, limit: int = 200) -> str:
    value: str = r.get(name, str)
    if not 0 < len(value) <= limit:
        r.fail(r.key(name), f"a string of 1 to {limit} characters", value)
    return value


def _reject_constant(name: str) -> None:
    """JSON has no NaN or Infinity: read them as null (older writers could emit them)."""
    return None


def json_loads_bounded(data: bytes, file: Path) -> Any:
    """Parse JSON (NaN/Infinity read as null); a ManifestError names `file` on failure."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{file}: not valid JSON ({short(exc)}); re-export the pair"
                            ) from None
