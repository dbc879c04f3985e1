"""The pair manifest and the model files are untrusted input.

Every malformed, tampered or unsafe pair folder must be refused with a `ManifestError` (or a
`ModelError` when ONNX Runtime cannot load a model) whose message names the file and the key;
never a bare KeyError/TypeError/ValueError or an onnxruntime traceback. Tests that tamper with
files work on a copy of the shared tiny pair (`pair_copy`), never on the shared folder.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.runtime.errors import ManifestError, ModelError, SpecEdgeError
from specedge.runtime.manifest import (
    MANIFEST_NAME,
    PairManifest,
    load_manifest,
    parse_manifest,
    write_manifest,
)
from specedge.runtime.pair import Pair

Doc = dict[str, Any]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def pair_copy(tiny_pair_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny pair that a test may tamper with."""
    dest = tmp_path / "pair"
    shutil.copytree(tiny_pair_dir, dest)
    return dest


@pytest.fixture(scope="session")
def valid_doc(tiny_pair_dir: Path) -> Doc:
    doc: Doc = json.loads((tiny_pair_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    return doc


def read_doc(root: Path) -> Doc:
    doc: Doc = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    return doc


def write_doc(root: Path, doc: Any) -> None:
    (root / MANIFEST_NAME).write_text(json.dumps(doc), encoding="utf-8")


def edit(root: Path, change: Callable[[Doc], None]) -> Path:
    """Apply `change` to the manifest of the pair folder `root` in place."""
    doc = read_doc(root)
    change(doc)
    write_doc(root, doc)
    return root / MANIFEST_NAME


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def target(doc: Doc) -> Doc:
    model: Doc = doc["models"]["target"]
    return model


def draft(doc: Doc) -> Doc:
    model: Doc = doc["models"]["draft"]
    return model


def key_msg(key: str) -> str:
    """Regex matching the message part that names a key."""
    return re.escape(f"key '{key}'")


# ----------------------------------------------------------------------------- the valid pair


def test_valid_pair_loads(tiny_pair_dir: Path) -> None:
    m = load_manifest(tiny_pair_dir)
    assert isinstance(m, PairManifest)
    assert m.draft is not None
    assert m.vocab_size == m.target.vocab_size == m.draft.vocab_size
    assert m.target.path in m.target.files


def test_round_trip_to_json(tiny_pair_dir: Path) -> None:
    m = load_manifest(tiny_pair_dir)
    again = parse_manifest(tiny_pair_dir, m.to_json())
    assert again.to_json() == m.to_json()
    assert again == m
    # and through the JSON text itself
    text = json.dumps(m.to_json())
    assert parse_manifest(tiny_pair_dir, json.loads(text)).to_json() == m.to_json()


def test_write_manifest_round_trip(pair_copy: Path) -> None:
    m = load_manifest(pair_copy)
    (pair_copy / MANIFEST_NAME).unlink()
    out = write_manifest(m, pair_copy)
    assert out == pair_copy / MANIFEST_NAME
    assert not list(pair_copy.glob("*.tmp"))
    assert load_manifest(pair_copy).to_json() == m.to_json()


# ----------------------------------------------------------------------------- folder and JSON


def test_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ManifestError, match=f"{re.escape(str(missing))}: no such pair folder"):
        load_manifest(missing)


def test_folder_without_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"specedge\.json: missing; .*not a specedge pair"):
        load_manifest(tmp_path)


def test_manifest_is_a_folder(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).mkdir()
    with pytest.raises(ManifestError, match=r"specedge\.json: missing"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("text", ["{not json", "", '{"format": "specedge.pair",', "\ufeff{}"])
def test_invalid_json(tmp_path: Path, text: str) -> None:
    (tmp_path / MANIFEST_NAME).write_text(text, encoding="utf-8")
    with pytest.raises(ManifestError, match=r"specedge\.json: not valid JSON"):
        load_manifest(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(ManifestError, match=r"specedge\.json: not valid JSON"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("doc", [[], [1, 2], "specedge.pair", 3, None])
def test_json_not_an_object(tmp_path: Path, doc: Any) -> None:
    write_doc(tmp_path, doc)
    with pytest.raises(ManifestError, match=r"specedge\.json: key '<root>' must be a JSON object"):
        load_manifest(tmp_path)


def test_deeply_nested_json(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(ManifestError, match=r"specedge\.json"):
        load_manifest(tmp_path)


# ----------------------------------------------------------------------------- format, version


def test_wrong_format(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: d.update(format="gguf"))
    with pytest.raises(ManifestError,
                       match=r"specedge\.json: key 'format' must be 'specedge\.pair'"):
        load_manifest(pair_copy)


def test_newer_version_says_upgrade(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: d.update(version=99))
    with pytest.raises(ManifestError, match=r"specedge\.json: format version 99 is newer.*upgrade"):
        load_manifest(pair_copy)


@pytest.mark.parametrize("version", [0, -1])
def test_version_too_old(pair_copy: Path, version: int) -> None:
    edit(pair_copy, lambda d: d.update(version=version))
    with pytest.raises(ManifestError, match=key_msg("version") + r" must be an integer in \[1,"):
        load_manifest(pair_copy)


@pytest.mark.parametrize("version", ["1", 1.0, True, None])
def test_version_wrong_type(pair_copy: Path, version: Any) -> None:
    edit(pair_copy, lambda d: d.update(version=version))
    with pytest.raises(ManifestError, match=key_msg("version") + " must be an integer"):
        load_manifest(pair_copy)


# ----------------------------------------------------------------------------- schema


@pytest.mark.parametrize("path", [
    ("models", "target", "num_layers"),
    ("models", "target", "kv", "dtype"),
    ("models", "target"),
    ("models",),
    ("vocab_size",),
    ("special_tokens", "eos"),
    ("tokenizer", "files"),
])
def test_missing_key(pair_copy: Path, path: tuple[str, ...]) -> None:
    def drop(doc: Doc) -> None:
        node = doc
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]

    file = edit(pair_copy, drop)
    with pytest.raises(ManifestError, match=re.escape(f"{file}: missing key '{'.'.join(path)}'")):
        load_manifest(pair_copy)


@pytest.mark.parametrize(("value", "found"), [
    ("2", "'2'"),
    (True, "True"),
    (2.0, "2.0"),
    (None, "None"),
    ([2], r"\[2\]"),
])
def test_wrong_type_for_int(pair_copy: Path, value: Any, found: str) -> None:
    file = edit(pair_copy, lambda d: target(d).update(num_layers=value))
    with pytest.raises(ManifestError,
                       match=re.escape(f"{file}: key 'models.target.num_layers' must be an integer")
                       + f", found {found}"):
        load_manifest(pair_copy)


@pytest.mark.parametrize(("key", "value"), [
    ("num_layers", 0), ("num_layers", -3), ("num_layers", 10**9),
    ("head_dim", 0), ("max_seq_len", 1), ("num_kv_heads", 0),
])
def test_out_of_range(pair_copy: Path, key: str, value: int) -> None:
    edit(pair_copy, lambda d: target(d).update({key: value}))
    with pytest.raises(ManifestError, match=key_msg(f"models.target.{key}")
                       + r" must be an integer in \["):
        load_manifest(pair_copy)


@pytest.mark.parametrize(("key", "value"), [
    ("precision", "fp64"), ("graph", "magic"), ("logits_dtype", "int8"),
])
def test_bad_choice(pair_copy: Path, key: str, value: str) -> None:
    edit(pair_copy, lambda d: target(d).update({key: value}))
    with pytest.raises(ManifestError, match=key_msg(f"models.target.{key}") + " must be one of"):
        load_manifest(pair_copy)


def test_kv_pattern_without_layer_index(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: target(d)["kv"].update(past_key="past_key_values.key"))
    with pytest.raises(ManifestError, match=key_msg("models.target.kv.past_key") + ".*'{i}'"):
        load_manifest(pair_copy)


def test_defaults_out_of_range(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: d["defaults"].update(num_draft_tokens=65))
    with pytest.raises(ManifestError, match=key_msg("defaults.num_draft_tokens")):
        load_manifest(pair_copy)


def test_nan_is_not_a_number(pair_copy: Path) -> None:
    # json.dumps writes NaN, and Python's json.loads accepts it: it must still be refused.
    edit(pair_copy, lambda d: d.update(vocab_size=float("nan")))
    with pytest.raises(ManifestError, match=key_msg("vocab_size")):
        load_manifest(pair_copy)


# ----------------------------------------------------------------------------- special tokens


@pytest.mark.parametrize("eos", [[], [320], [-1], [2, 10_000], ["2"], [True], 2, None])
def test_bad_eos(pair_copy: Path, eos: Any) -> None:
    edit(pair_copy, lambda d: d["special_tokens"].update(eos=eos))
    with pytest.raises(ManifestError, match=key_msg("special_tokens.eos")):
        load_manifest(pair_copy)


@pytest.mark.parametrize("key", ["bos", "pad"])
def test_bos_pad_out_of_vocab(pair_copy: Path, key: str) -> None:
    edit(pair_copy, lambda d: d["special_tokens"].update({key: 320}))
    with pytest.raises(ManifestError, match=key_msg(f"special_tokens.{key}") + " must be a token"):
        load_manifest(pair_copy)


def test_draft_vocab_differs(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: draft(d).update(vocab_size=321))
    with pytest.raises(ManifestError,
                       match=r"models\.draft\.vocab_size is 321 but the pair's vocab_size is 320"):
        load_manifest(pair_copy)


def test_pair_vocab_differs_from_target(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: d.update(vocab_size=400))
    with pytest.raises(ManifestError, match=r"models\.target\.vocab_size is 320"):
        load_manifest(pair_copy)


# ----------------------------------------------------------------------------- path confinement


@pytest.mark.parametrize("path", [
    "/etc/passwd",
    "../outside.onnx",
    "target/../../outside.onnx",
    "target/../target/model.onnx",  # stays inside, but `..` is refused outright
    "target\\model.onnx",
    "",
])
def test_model_path_must_stay_inside(pair_copy: Path, path: str) -> None:
    file = edit(pair_copy, lambda d: target(d).update(path=path))
    with pytest.raises(ManifestError, match=re.escape(
            f"{file}: key 'models.target.path' must be a relative path inside the pair folder")):
        load_manifest(pair_copy)


@pytest.mark.parametrize("rel", ["../secret.bin", "/etc/passwd", "target/../../secret.bin"])
def test_files_key_must_stay_inside(pair_copy: Path, rel: str) -> None:
    edit(pair_copy, lambda d: target(d)["files"].update({rel: "0" * 64}))
    with pytest.raises(ManifestError, match=key_msg(f"models.target.files.{rel}")
                       + " must be a relative path inside"):
        load_manifest(pair_copy)


def test_tokenizer_files_key_must_stay_inside(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: d["tokenizer"]["files"].update({"../tokenizer.json": "0" * 64}))
    with pytest.raises(ManifestError, match=key_msg("tokenizer.files.../tokenizer.json")):
        load_manifest(pair_copy)


def test_symlink_leaving_the_pair_is_refused(pair_copy: Path, tmp_path: Path) -> None:
    # The outside file has the very same bytes, so the sha256 check alone would pass: the load
    # must be refused because of where the link points.
    model = pair_copy / "target" / "model.onnx"
    outside = tmp_path / "outside.onnx"
    shutil.copyfile(model, outside)
    model.unlink()
    model.symlink_to(outside)
    with pytest.raises(ManifestError, match=re.escape("key 'models.target.path' points outside "
                                                      "the pair folder")):
        load_manifest(pair_copy)
    with pytest.raises(ManifestError, match="points outside the pair folder"):
        Pair.load(pair_copy)


def test_symlinked_folder_leaving_the_pair_is_refused(pair_copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    shutil.move(pair_copy / "draft", outside)
    (pair_copy / "draft").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ManifestError, match=re.escape("key 'models.draft.path' points outside")):
        load_manifest(pair_copy)


def test_symlink_inside_the_pair_is_allowed(pair_copy: Path) -> None:
    real = pair_copy / "target" / "real.onnx"
    (pair_copy / "target" / "model.onnx").rename(real)
    (pair_copy / "target" / "model.onnx").symlink_to("real.onnx")
    assert load_manifest(pair_copy).target.path == "target/model.onnx"


@pytest.mark.parametrize("where", ["path", "files"])
def test_nul_byte_in_path(pair_copy: Path, where: str) -> None:
    if where == "path":
        edit(pair_copy, lambda d: target(d).update(path="target/model.onnx\x00"))
    else:
        edit(pair_copy, lambda d: target(d)["files"].update({"x\x00y": "0" * 64}))
    with pytest.raises(ManifestError, match="models.target"):
        load_manifest(pair_copy)


def test_model_file_not_listed(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: target(d)["files"].pop("target/model.onnx"))
    with pytest.raises(ManifestError,
                       match=key_msg("models.target.files") + " must be an object that lists"):
        load_manifest(pair_copy)


@pytest.mark.parametrize("digest", ["abc", 123, None, "0" * 63])
def test_bad_digest(pair_copy: Path, digest: Any) -> None:
    edit(pair_copy, lambda d: d["tokenizer"]["files"].update({"tokenizer.json": digest}))
    with pytest.raises(ManifestError, match=key_msg("tokenizer.files.tokenizer.json")
                       + " must be a sha256 hex digest"):
        load_manifest(pair_copy)


def test_non_hex_digest_is_a_schema_error(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: d["tokenizer"]["files"].update({"tokenizer.json": "z" * 64}))
    with pytest.raises(ManifestError, match="must be a sha256 hex digest"):
        load_manifest(pair_copy)


# ----------------------------------------------------------------------------- files and hashes


@pytest.mark.parametrize("rel", ["target/model.onnx.data", "target/model.onnx", "tokenizer.json"])
def test_sha256_mismatch(pair_copy: Path, rel: str) -> None:
    with open(pair_copy / rel, "ab") as fh:
        fh.write(b"\x00")
    with pytest.raises(ManifestError, match=re.escape(f"{pair_copy / rel}: sha256 does not match")
                       + ".*corrupt or was modified"):
        load_manifest(pair_copy)


def test_sha256_skipped_on_request_is_logged(pair_copy: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with open(pair_copy / "target" / "model.onnx.data", "ab") as fh:
        fh.write(b"\x00")
    with caplog.at_level(logging.WARNING, logger="specedge.runtime.manifest"):
        m = load_manifest(pair_copy, verify_hashes=False)
    assert isinstance(m, PairManifest)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("sha256 check" in r.getMessage() and "skipped" in r.getMessage()
               and str(pair_copy) in r.getMessage() for r in warnings)


def test_verified_load_logs_no_warning(tiny_pair_dir: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="specedge.runtime.manifest"):
        load_manifest(tiny_pair_dir)
    assert not [r for r in caplog.records if "skipped" in r.getMessage()]


@pytest.mark.parametrize("rel", ["draft/model.onnx.data", "chat_template.jinja"])
@pytest.mark.parametrize("verify", [True, False])
def test_listed_file_missing(pair_copy: Path, rel: str, verify: bool) -> None:
    (pair_copy / rel).unlink()
    with pytest.raises(ManifestError, match=re.escape(f"listed file {rel!r} is missing")):
        load_manifest(pair_copy, verify_hashes=verify)


def test_listed_file_is_a_folder(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: d["tokenizer"]["files"].update({"target": "0" * 64}))
    with pytest.raises(ManifestError, match=re.escape("listed file 'target' is missing")):
        load_manifest(pair_copy)


def _truncate_and_rehash(root: Path, rel: str) -> None:
    path = root / rel
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    digest = sha256(path)
    edit(root, lambda d: target(d)["files"].update({rel: digest}))


@pytest.mark.parametrize("rel", ["target/model.onnx", "target/model.onnx.data"])
def test_truncated_onnx_is_a_model_error(pair_copy: Path, rel: str) -> None:
    _truncate_and_rehash(pair_copy, rel)
    load_manifest(pair_copy)  # the hashes match: only ONNX Runtime can notice
    with pytest.raises(ModelError, match=r"target/model\.onnx: .*truncated or corrupt") as info:
        Pair.load(pair_copy)
    assert isinstance(info.value, SpecEdgeError)
    assert "Traceback" not in str(info.value)
    assert "\n" not in str(info.value)
    assert info.value.__cause__ is None  # raised `from None`: no onnxruntime chain


def test_garbage_onnx_is_a_model_error(pair_copy: Path) -> None:
    (pair_copy / "draft" / "model.onnx").write_bytes(b"this is not a protobuf" * 10)
    digest = sha256(pair_copy / "draft" / "model.onnx")
    edit(pair_copy, lambda d: draft(d)["files"].update({"draft/model.onnx": digest}))
    with pytest.raises(ModelError, match=r"draft/model\.onnx: .*draft model"):
        Pair.load(pair_copy)


def test_manifest_tensor_names_must_exist(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: target(d).update(logits="no_such_output"))
    with pytest.raises(ModelError, match="lacks the tensors the manifest names.*no_such_output"):
        Pair.load(pair_copy)


def test_kv_pattern_with_extra_fields(pair_copy: Path) -> None:
    edit(pair_copy, lambda d: target(d)["kv"].update(past_key="past.{i}.{j}"))
    with pytest.raises(SpecEdgeError, match="past_key"):
        Pair.load(pair_copy)


# ----------------------------------------------------------------------------- fuzzing

# Any code point: lone surrogates (category Cs, what undecodable bytes become) and NUL included.
_text = st.lists(st.one_of(st.characters(codec=None),
                           st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
                 max_size=12).map("".join)
_interesting = st.sampled_from([
    "", ".", "..", "/etc/passwd", "../x", "target/model.onnx", "target/model.onnx.data",
    "draft/model.onnx", "tokenizer.json", "{i}", "x.{i}", "BHSD", "float32", "float16", "fp32",
    "gqa-shared", "concat", "model", "ngram", "specedge.pair", "0" * 64, "target/\ud800",
    "\udcff", "a\x00b",
])
_huge = st.sampled_from([1 << 22, (1 << 22) + 1, 1 << 24, 1 << 40, 1 << 63, 1 << 64])
_scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2, 600) | _huge
            | st.floats(allow_nan=True, allow_infinity=True) | _text | _interesting)
json_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(_text | _interesting, children, max_size=4),
    max_leaves=12,
)

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _locations(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path (dict keys and list indexes) in a JSON document."""
    out: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else (
        enumerate(node) if isinstance(node, list) else ())
    for key, child in items:
        out.append(prefix + (key,))
        out.extend(_locations(child, prefix + (key,)))
    return out


def _parse_or_manifest_error(root: Path, doc: Any) -> PairManifest | None:
    try:
        m = parse_manifest(root, doc)
    except ManifestError as exc:
        assert str(exc).startswith(str(root / MANIFEST_NAME))
        return None
    assert isinstance(m, PairManifest)
    return m


@FUZZ
@given(value=json_values)
def test_fuzz_random_documents(tiny_pair_dir: Path, value: Any) -> None:
    _parse_or_manifest_error(tiny_pair_dir, value)


@FUZZ
@given(data=st.data())
def test_fuzz_mutated_manifest(tiny_pair_dir: Path, valid_doc: Doc, data: st.DataObject) -> None:
    doc = copy.deepcopy(valid_doc)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        locations = _locations(doc)
        if not locations:
            break
        where = data.draw(st.sampled_from(locations), label="where")
        parent = doc
        for part in where[:-1]:
            parent = parent[part]
        if data.draw(st.booleans(), label="delete"):
            del parent[where[-1]]
        else:
            parent[where[-1]] = data.draw(json_values, label="value")
    m = _parse_or_manifest_error(tiny_pair_dir, doc)
    if m is not None:
        # Whatever was accepted must survive a round trip unchanged.
        assert parse_manifest(tiny_pair_dir, m.to_json()).to_json() == m.to_json()


# An `engines` entry as `specedge build-engine` writes it (parsing does not open the files).
ENGINE_ENTRY: Doc = {
    "path": "engines/target/model_ctx.onnx",
    "files": {"engines/target/model_ctx.onnx": "0" * 64,
              "engines/target/TensorrtExecutionProvider_TRTKernel_sm87.engine": "1" * 64},
    "key": {"gpu": "Orin", "compute_capability": "8.7", "tensorrt": "10.3.0",
            "onnxruntime": "1.20.0"},
    "precision": "fp16",
    "max_batch": 4,
    "profile": {"min": {"input_ids": [1, 1], "past_key_values.0.key": [1, 2, 0, 16]},
                "opt": {"input_ids": [4, 4], "past_key_values.0.key": [4, 2, 256, 16]},
                "max": {"input_ids": [4, 512], "past_key_values.0.key": [4, 2, 511, 16]}},
    "source": {"path": "target/model.onnx", "sha256": "0" * 64},
}


def test_engines_entry_round_trips(tiny_pair_dir: Path, valid_doc: Doc) -> None:
    doc = copy.deepcopy(valid_doc)
    doc["engines"] = {"target": copy.deepcopy(ENGINE_ENTRY)}
    m = parse_manifest(tiny_pair_dir, doc)
    assert m.engines["target"].profile.max["input_ids"] == (4, 512)
    assert m.to_json()["engines"] == doc["engines"]
    assert "engines" not in parse_manifest(tiny_pair_dir, valid_doc).to_json()


@FUZZ
@given(data=st.data())
def test_fuzz_mutated_engines_entry(tiny_pair_dir: Path, valid_doc: Doc,
                                    data: st.DataObject) -> None:
    """Any mutation of the engines entry parses or is one ManifestError naming the file."""
    doc = copy.deepcopy(valid_doc)
    doc["engines"] = {"target": copy.deepcopy(ENGINE_ENTRY)}
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        locations = _locations(doc["engines"])
        if not locations:
            break
        where = data.draw(st.sampled_from(locations), label="where")
        parent = doc["engines"]
        for part in where[:-1]:
            parent = parent[part]
        if data.draw(st.booleans(), label="delete"):
            del parent[where[-1]]
        else:
            parent[where[-1]] = data.draw(json_values, label="value")
    m = _parse_or_manifest_error(tiny_pair_dir, doc)
    if m is not None:
        assert parse_manifest(tiny_pair_dir, m.to_json()).to_json() == m.to_json()
        for engine in m.engines.values():  # accepted paths stay inside the pair
            for rel in engine.files:
                assert ".." not in Path(rel).parts and not Path(rel).is_absolute()
