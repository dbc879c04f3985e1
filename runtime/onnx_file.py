"""Reading ONNX files without the onnx package (the runtime does not depend on it): a minimal
protobuf reader, the external-data files a model's tensors name, and the summary of a graph's
top-level nodes and inputs that `build-engine` checks and derives its profiles from.

`fields` walks one message and leaves every payload where it is (spans into the buffer), so a
multi-gigabyte model is read through `mmap` without copying its weights.
"""

from __future__ import annotations

import mmap
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ExportError

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5  # the protobuf wire types ONNX uses
STANDARD_DOMAINS = ("", "ai.onnx")
Dims = tuple[int | str | None, ...]


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


def _spans(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message: ints for varints, bytes for
    length-delimited fields (fixed-width fields are skipped)."""
    for number, wire, a, b in fields(buf):
        if wire == VARINT:
            yield number, wire, a
        elif wire == LENGTH:
            yield number, wire, buf[a:b]


def _graph(path: Path) -> bytes:
    """The GraphProto of an ONNX file (ModelProto field 7)."""
    data = path.read_bytes()
    for number, wire, value in _spans(data):
        if number == 7 and wire == 2:
            return bytes(value)
    raise ValueError("no graph")


@dataclass(frozen=True)
class GraphSummary:
    """The top-level nodes and inputs of an ONNX graph."""

    nodes: list[tuple[str, str, dict[str, int | bytes]]]  # (domain, op_type, int/str attributes)
    inputs: list[tuple[str, Dims]]  # graph inputs that are not initializers


def read_graph(path: Path) -> GraphSummary:
    """Top-level nodes (domain, op type, scalar attributes) and inputs of an ONNX file.

    Raises:
        ExportError: the file is not a well-formed ONNX protobuf.
    """
    try:
        nodes: list[tuple[str, str, dict[str, int | bytes]]] = []
        inputs: list[tuple[str, Dims]] = []
        initializers: set[str] = set()
        for number, wire, value in _spans(_graph(path)):
            if wire != 2:
                continue
            if number == 1:  # NodeProto: op_type 4, domain 7, attribute 5
                op, domain, attrs = "", "", {}
                for n, _, v in _spans(value):
                    if n == 4:
                        op = v.decode()
                    elif n == 7:
                        domain = v.decode()
                    elif n == 5:  # AttributeProto: name 1, i 3, s 4
                        name, scalar = "", None
                        for an, _, av in _spans(v):
                            if an == 1:
                                name = av.decode()
                            elif an in (3, 4):
                                scalar = av
                        if scalar is not None:
                            attrs[name] = scalar
                nodes.append((domain, op, attrs))
            elif number == 5:  # TensorProto initializer: name 8
                initializers.update(v.decode() for n, _, v in _spans(value) if n == 8)
            elif number == 11:  # ValueInfoProto: name 1, type 2
                inputs.append(_value_info(value))
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise ExportError(f"{path}: not a readable ONNX file ({exc}); re-export the pair"
                          ) from None
    return GraphSummary(nodes, [(n, d) for n, d in inputs if n not in initializers])


def _value_info(buf: bytes) -> tuple[str, Dims]:
    name, dims = "", []
    for n, _, v in _spans(buf):
        if n == 1:
            name = v.decode()
        elif n == 2:  # TypeProto.tensor_type 1 -> shape 2 -> dim 1 -> value 1 | param 2
            for tn, _, tv in _spans(v):
                if tn != 1:
                    continue
                for sn, _, sv in _spans(tv):
                    if sn != 2:
                        continue
                    for dn, _, dv in _spans(sv):
                        if dn != 1:
                            continue
                        dim: int | str | None = None
                        for kn, _, kv in _spans(dv):
                            dim = kv if kn == 1 else kv.decode() if kn == 2 else dim
                        dims.append(dim)
    return name, tuple(dims)


def contrib_ops(graph: GraphSummary) -> Counter[str]:
    """Nodes outside the standard ONNX domain, e.g. {"com.microsoft.GroupQueryAttention": 2}."""
    return Counter(f"{d}.{op}" for d, op, _ in graph.nodes if d not in STANDARD_DOMAINS)
