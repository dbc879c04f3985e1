"""Errors raised by specedge.

One base class for the whole package, and a few specific subclasses. Messages name the file or
the key, what was expected, what was found, and what to do. The CLI turns any `SpecEdgeError`
into one clean line and a non-zero exit.
"""

from __future__ import annotations

from collections.abc import Iterable


class SpecEdgeError(Exception):
    """Base class of every error specedge raises on purpose."""


class ManifestError(SpecEdgeError):
    """A pair folder or its `specedge.json` is missing, malformed, tampered or unsupported."""


class InputError(SpecEdgeError):
    """A user-supplied argument (prompt, parameter, path) is invalid."""


class FieldError(InputError):
    """A field of a request that is invalid (`param` names it, as OpenAI's errors do)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ModelError(SpecEdgeError):
    """A model misbehaved at run time (NaN/inf logits, failed session)."""


class ExportError(SpecEdgeError):
    """An export could not be done, or its validation failed."""


class OutputError(SpecEdgeError):
    """An output file or folder cannot be written (full or read-only disk, permissions)."""


def listed(values: Iterable[object]) -> str:
    """Values as a user typed them in an option: `1,2,4` (not a Python tuple)."""
    return ",".join(str(v) for v in values)
