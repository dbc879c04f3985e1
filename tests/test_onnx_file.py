"""The runtime's protobuf reader (`runtime/onnx_file.py`): fields round-trip what an encoder
wrote, malformed messages raise ValueError (never hang or read past the message), and the
external-data files of a real exported model are found."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specedge.runtime.onnx_file import external_data_files, fields


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


FIELD = st.one_of(
    st.tuples(st.integers(1, 2000), st.just(0), st.integers(0, 2**64 - 1)),
    st.tuples(st.integers(1, 2000), st.just(2), st.binary(max_size=300)),
    st.tuples(st.integers(1, 2000), st.sampled_from([1, 5]), st.integers(0, 2**32 - 1)),
)


def encode(message: list[tuple[int, int, int | bytes]]) -> bytes:
    out = bytearray()
    for number, wire, value in message:
        out += encode_varint(number << 3 | wire)
        if wire == 0:
            assert isinstance(value, int)
            out += encode_varint(value)
        elif wire == 2:
            assert isinstance(value, bytes)
            out += encode_varint(len(value)) + value
        else:
            assert isinstance(value, int)
            out += value.to_bytes(8 if wire == 1 else 4, "little")
    return bytes(out)


@given(st.lists(FIELD, max_size=12), st.binary(max_size=8), st.binary(max_size=8))
def test_fields_round_trip(message: list[tuple[int, int, int | bytes]], before: bytes,
                           after: bytes) -> None:
    body = encode(message)
    buf = before + body + after  # a message inside a larger buffer: read only its span
    parsed = []
    for number, wire, a, b in fields(buf, len(before), len(before) + len(body)):
        if wire == 0:
            parsed.append((number, wire, a))
        elif wire == 2:
            parsed.append((number, wire, buf[a:b]))
        else:
            parsed.append((number, wire, int.from_bytes(buf[a:b], "little")))
    assert parsed == message


@given(st.lists(FIELD, min_size=1, max_size=6), st.data())
def test_a_cut_message_never_reads_past_its_end(message: list[tuple[int, int, int | bytes]],
                                               data: st.DataObject) -> None:
    body = encode(message)
    cut = data.draw(st.integers(0, len(body) - 1))
    buf = body[:cut] + b"\x01" * 16  # bytes after the message that would parse
    try:  # a cut between two fields is a shorter, well-formed message
        spans = [(wire, a, b) for _, wire, a, b in fields(buf, 0, cut)]
    except ValueError:
        return
    assert all(b <= cut for wire, _, b in spans if wire != 0)
    assert len(spans) < len(message)


def test_malformed_messages() -> None:
    with pytest.raises(ValueError, match="overlong varint"):
        list(fields(b"\x08" + b"\xff" * 11))
    with pytest.raises(ValueError, match="runs past"):
        list(fields(encode_varint(1 << 3 | 2) + encode_varint(10) + b"abc"))
    with pytest.raises(ValueError, match="runs past"):
        list(fields(encode_varint(1 << 3 | 1) + b"1234"))
    with pytest.raises(ValueError, match="wire type 3"):
        list(fields(encode_varint(1 << 3 | 3)))


def test_external_data_files_of_an_export(fixtures_dir: Path, tmp_path: Path) -> None:
    model = fixtures_dir / "tiny-llama" / "target" / "model.onnx"
    assert external_data_files(model) == {"model.onnx.data"}
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty file"):
        external_data_files(empty)
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(model.read_bytes()[:-7])
    with pytest.raises(ValueError):
        external_data_files(cut)
