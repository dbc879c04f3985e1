"""Reading ONNX files without the onnx package (the runtime does not depend on it): a minimal
protobuf reader, and the external-data files a model's tensors name.

`fields` walks one message and leaves every payload where it is (spans into the buffer), so a
multi-gigabyte model is read through `mmap` without copying its weights.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5  # the protobuf wire types ONNX uses


def varint(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """The varint at `buf[pos:end]`: (value, position after it).

    Raises:
        ValueError: it runs past `end` or past 64 bits.
    """
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(buf: Any, pos: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, a, b) for each field of the message `buf[pos:end]` (all of
    `buf` by default): a varint's value is `a` (`b` is where it ends); any other field's payload
    is `buf[a:b]`.

    Raises:
        ValueError: the message is not well-formed (a field runs past it, a group wire type).
    """
    end = len(buf) if end is None else end
    while pos < end:
        tag, pos = varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if wire == VARINT:
            value, pos = varint(buf, pos, end)
            yield number, wire, value, pos
            continue
        if wire == LENGTH:
            size, pos = varint(buf, pos, end)
        elif wire in (FIXED64, FIXED32):
            size = 8 if wire == FIXED64 else 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos + size > end:
            raise ValueError("a field runs past its message")
        yield number, wire, pos, pos + size
        pos += size


# Where TensorProtos can sit in an ONNX ModelProto (field numbers from onnx.proto3); a tensor's
# external data is its field 13 (key/value entries, "location" among them).
_CHILDREN: dict[str, dict[int, str]] = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "node": {5: "attribute"},
    "function": {7: "node", 11: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse",
                  23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {13: "entry"},
    "entry": {},
}


def external_data_files(path: Path) -> set[str]:
    """The external-data locations named by the tensors of an ONNX file (as written in it).

    Walks the messages that can hold tensors (graphs, nodes, attributes, functions, sparse
    tensors, subgraphs); tensor payloads are skipped, never read.

    Raises:
        ValueError: the file is not a well-formed protobuf.
    """
    locations: set[str] = set()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise ValueError("empty file")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            stack: list[tuple[str, int, int]] = [("model", 0, size)]
            while stack:
                kind, start, end = stack.pop()
                children = _CHILDREN[kind]
                key = value = None
                for number, wire, a, b in fields(buf, start, end):
                    if wire != LENGTH:
                        continue
                    if kind == "entry" and number in (1, 2):
                        text = bytes(buf[a:b]).decode("utf-8")
                        key, value = (text, value) if number == 1 else (key, text)
                    elif number in children:
                        stack.append((children[number], a, b))
                if kind == "entry" and key == "location" and value is not None:
                    locations.add(value)
    return locations
