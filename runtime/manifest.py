"""The pair manifest (`specedge.json`): schema, frozen dataclasses, loading and validation.

The manifest is the whole contract between the exporter and the runtime: the runtime never guesses
from file names or architecture names. It is untrusted input: every field is type-checked, every
path must stay inside the pair folder (no absolute paths, no `..`, no symlinks that leave it), and
the sha256 of every model file is checked on load unless the caller opts out.

The exporter imports this module to write the file, so the schema lives in one place.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .engines import EngineSpec
from .errors import ManifestError
from .files import confine, json_dumps, read_bounded, sha256_file, write_atomic
from .manifest_engines import parse_engines
from .manifest_json import Reader, file_map, free_form, json_loads_bounded, short_string

FORMAT = "specedge.pair"
FORMAT_VERSION = 1
MANIFEST_NAME = "specedge.json"

GRAPH_FORMS = ("gqa-shared", "concat")
PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
KV_DTYPES = ("float32", "float16")
DRAFTERS = ("model", "ngram", "hybrid")

MAX_MANIFEST_BYTES = 16 << 20  # a real manifest is a few KiB; refuse to read a huge one
MAX_TOKENIZER_FILE_BYTES = 256 << 20  # tokenizer.json of a 256k vocabulary is ~20 MiB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSpec:
    """Names, layout and dtype of one model's KV cache tensors.

    Name patterns contain `{i}` for the layer index. Layout is always
    `[batch, kv_heads, seq, head_dim]` ("BHSD").
    """

    past_key: str = "past_key_values.{i}.key"
    past_value: str = "past_key_values.{i}.value"
    present_key: str = "present.{i}.key"
    present_value: str = "present.{i}.value"
    layout: str = "BHSD"
    dtype: str = "float32"


@dataclass(frozen=True)
class HeadSpec:
    """A model's output head split off its body (written by `exporter/split_head.py`; used by
    `runtime/shortlist.py` for exact greedy argmaxes that read an int8 copy of the head).

    All paths are relative to the pair folder and listed, hashed, in the model's `files`.
    """

    body: str  # the graph without the head MatMul: outputs `hidden` instead of the logits
    hidden: str  # the body's hidden-state output `[batch, new, hidden_size]`
    logits: str  # the head MatMul alone: hidden -> logits, the whole graph's bit for bit
    shortlist: str  # int8 head, bound and exact candidates: hidden `[rows, hidden_size]` -> ids
    hidden_size: int


@dataclass(frozen=True)
class ModelSpec:
    """Everything the runtime needs to run one exported model."""

    path: str  # relative to the pair folder, e.g. "target/model.onnx"
    files: dict[str, str]  # relative path -> sha256 of every file the model needs
    precision: str
    graph: str  # "gqa-shared": one buffer bound as past and present; "concat": present = past + new
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    vocab_size: int
    kv: KVSpec = field(default_factory=KVSpec)
    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask"
    position_ids: str | None = None
    logits: str = "logits"
    logits_dtype: str = "float32"
    min_cache_len: int = 1  # e.g. the sliding window: KV buffers are never allocated shorter
    vocab_ids: str | None = None  # .npy of the token ids the logits cover (reduced-vocab draft)
    # A draft whose embedding table has fewer rows than the target's vocabulary (Qwen2.5-0.5B's
    # 151,936 beside Qwen2.5-7B's 152,064: the same tokenizer, padded differently): the ids at
    # or above it are fed to it as id 0. Its guesses change, never the output (drafts only).
    input_vocab_size: int | None = None
    # A draft with its own tokenizer (exporter/vocab_bridge.py): .npy of the draft's id for each
    # of the pair's token ids, fed in their place; its logits cover the tokens both vocabularies
    # hold (`vocab_ids`), and `input_vocab_size` is its own table's rows.
    input_id_map: str | None = None
    validation: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    head: HeadSpec | None = None  # the head split off the body, where the exporter split it


@dataclass(frozen=True)
class Defaults:
    """Run-time defaults for the pair (written by export and later by `specedge tune`)."""

    drafter: str = "model"
    num_draft_tokens: int = 3
    adaptive: bool = True
    target_threads: int = 0  # 0: decide at load time from the cores present
    draft_threads: int = 0


@dataclass(frozen=True)
class PairManifest:
    """The parsed, validated `specedge.json` of a pair folder."""

    root: Path
    target: ModelSpec
    draft: ModelSpec | None
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    tokenizer_files: dict[str, str]  # relative path -> sha256
    defaults: Defaults = field(default_factory=Defaults)
    provenance: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    engines: dict[str, EngineSpec] = field(default_factory=dict)  # model -> prebuilt engine

    def path(self, relative: str) -> Path:
        """Absolute path of a file named in the manifest (already confined at load)."""
        return self.root / relative

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON-ready dict (the inverse of `parse_manifest`)."""
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": self.version,
            "vocab_size": self.vocab_size,
            "special_tokens": {
                "bos": self.bos_token_id,
                "eos": list(self.eos_token_ids),
                "pad": self.pad_token_id,
            },
            "tokenizer": {"files": dict(self.tokenizer_files)},
            "models": {"target": asdict(self.target)},
            "defaults": asdict(self.defaults),
            "provenance": self.provenance,
        }
        if self.draft is not None:
            doc["models"]["draft"] = asdict(self.draft)
        if self.engines:
            doc["engines"] = {name: spec.to_json() for name, spec in self.engines.items()}
        return doc


# ----------------------------------------------------------------------------- parsing


def _listed_file(r: Reader, root: Path, files: dict[str, str], key: str) -> str | None:
    """The optional file at `key`: confined to the pair and listed (so hashed) in `files`."""
    rel = r.get(key, (str, type(None)), required=False)
    if rel is not None:
        confine(root, rel, file=r.file, key=r.key(key))
        if rel not in files:
            r.fail(r.key("files"), f"an object that lists {rel!r}", list(files))
    return rel


def _parse_model(r: Reader, root: Path) -> ModelSpec:
    kv_r = r.sub("kv")
    assert kv_r is not None
    kv = KVSpec(
        past_key=kv_r.get("past_key", str),
        past_value=kv_r.get("past_value", str),
        present_key=kv_r.get("present_key", str),
        present_value=kv_r.get("present_value", str),
        layout=kv_r.choice("layout", ("BHSD",)),
        dtype=kv_r.choice("dtype", KV_DTYPES),
    )
    for key in ("past_key", "past_value", "present_key", "present_value"):
        pattern = getattr(kv, key)
        try:
            ok = "{i}" in pattern and pattern.format(i=0) != pattern.format(i=1)
        except (KeyError, IndexError, ValueError):
            ok = False
        if not ok:
            kv_r.fail(kv_r.key(key), "a name pattern with one '{i}' field", pattern)
    path = r.get("path", str)
    confine(root, path, file=r.file, key=r.key("path"))
    files = file_map(r, "files", root)
    if path not in files:
        r.fail(r.key("files"), f"an object that lists the model file {path!r}", list(files))
    return ModelSpec(
        path=path,
        files=files,
        precision=r.choice("precision", PRECISIONS),
        graph=r.choice("graph", GRAPH_FORMS),
        num_layers=r.int_in("num_layers", 1, 1024),
        num_kv_heads=r.int_in("num_kv_heads", 1, 1024),
        head_dim=r.int_in("head_dim", 1, 4096),
        max_seq_len=r.int_in("max_seq_len", 2, 1 << 22),
        vocab_size=r.int_in("vocab_size", 2, 1 << 24),
        kv=kv,
        input_ids=r.get("input_ids", str),
        attention_mask=r.get("attention_mask", str),
        position_ids=r.get("position_ids", (str, type(None)), required=False),
        logits=r.get("logits", str),
        logits_dtype=r.choice("logits_dtype", KV_DTYPES),
        min_cache_len=r.int_in("min_cache_len", 1, 1 << 22, required=False, default=1),
        vocab_ids=_listed_file(r, root, files, "vocab_ids"),
        input_vocab_size=_input_vocab_size(r),
        input_id_map=_listed_file(r, root, files, "input_id_map"),
        validation=free_form(r, "validation"),
        source=free_form(r, "source"),
        head=_head(r, root, files),
    )


def _input_vocab_size(r: Reader) -> int | None:
    value = r.get("input_vocab_size", (int, type(None)), required=False)
    # read and checked before this; a draft with its own tokenizer may have the larger table
    vocab = 1 << 24 if r.data.get("input_id_map") is not None else r.data["vocab_size"]
    if value is not None and not 2 <= value <= vocab:
        r.fail(r.key("input_vocab_size"), f"null or an integer in [2, {vocab}]", value)
    return value  # type: ignore[no-any-return]


def _head(r: Reader, root: Path, files: dict[str, str]) -> HeadSpec | None:
    if r.data.get("head") is None:  # absent, or null: the head is part of the graph
        return None
    hr = r.sub("head")
    assert hr is not None
    paths = {}
    for key in ("body", "logits", "shortlist"):
        rel = short_string(hr, key, 1024)
        confine(root, rel, file=r.file, key=hr.key(key))
        if rel not in files:
            r.fail(r.key("files"), f"an object that lists {rel!r}", list(files))
        paths[key] = rel
    return HeadSpec(hidden=short_string(hr, "hidden", 1024),
                    hidden_size=hr.int_in("hidden_size", 1, 1 << 20), **paths)


def engine_files_ready(manifest: PairManifest, model: str, *, verify_hashes: bool = True
                       ) -> str | None:
    """Check the files of `model`'s engine before it is loaded: None when they are all there
    (and match their sha256), else why not (a missing file: the engines folder was not copied).

    Engine files are optional artifacts, so they are not among the files every load requires.

    Raises:
        ManifestError: a file is there but its sha256 differs (tampered or corrupt).
    """
    engine = manifest.engines[model]
    file = manifest.root / MANIFEST_NAME
    for rel, digest in engine.files.items():
        path = confine(manifest.root, rel, file=file, key=f"engines.{model}.files.{rel}")
        if not path.is_file():
            return f"{rel} is missing (copy the pair's engines folder, or rebuild)"
        if verify_hashes and sha256_file(path) != digest:
            raise ManifestError(f"{path}: sha256 does not match {file}; the engine is corrupt "
                                "or was modified; rebuild it with `specedge build-engine`")
    return None


def parse_manifest(root: Path, doc: Any, *, file: Path | None = None) -> PairManifest:
    """Validate an untrusted manifest document and build a `PairManifest`.

    Raises:
        ManifestError: naming the file and the key for anything missing, mistyped or unsafe.
    """
    file = file or root / MANIFEST_NAME
    r = Reader(file, doc)
    fmt = r.get("format", str)
    if fmt != FORMAT:
        r.fail("format", repr(FORMAT), fmt)
    version = r.get("version", int)
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{file}: format version {version} is newer than this specedge understands "
            f"(up to {FORMAT_VERSION}); upgrade specedge (`pip install -U specedge`)"
        )
    if version < 1:
        r.fail("version", f"an integer in [1, {FORMAT_VERSION}]", version)
    models = r.sub("models")
    assert models is not None
    target_r = models.sub("target")
    assert target_r is not None
    target = _parse_model(target_r, root)
    draft_r = models.sub("draft", required=False)
    draft = _parse_model(draft_r, root) if draft_r is not None else None
    vocab = r.int_in("vocab_size", 2, 1 << 24)
    for name, spec in (("target", target), ("draft", draft)):
        if spec is not None and spec.vocab_size != vocab:
            raise ManifestError(
                f"{file}: models.{name}.vocab_size is {spec.vocab_size} but the pair's vocab_size "
                f"is {vocab}; draft and target must share one vocabulary"
            )
    for key in ("input_vocab_size", "input_id_map"):  # the target sees every token as it is
        if getattr(target, key) is not None:
            raise ManifestError(f"{file}: models.target.{key} is set; only a draft may read "
                                "other ids than the pair's: re-export the pair")
    special = r.sub("special_tokens")
    assert special is not None
    eos_raw = special.get("eos", list)
    if not eos_raw or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                              for t in eos_raw):
        special.fail("special_tokens.eos", f"a non-empty list of token ids < {vocab}", eos_raw)
    bos = special.get("bos", (int, type(None)), required=False)
    pad = special.get("pad", (int, type(None)), required=False)
    for key, value in (("bos", bos), ("pad", pad)):
        if value is not None and not 0 <= value < vocab:
            special.fail(f"special_tokens.{key}", f"a token id < {vocab}", value)
    tok = r.sub("tokenizer")
    assert tok is not None
    tokenizer_files = file_map(tok, "files", root)
    d = r.sub("defaults", required=False)
    defaults = Defaults()
    if d is not None:
        defaults = Defaults(
            drafter=d.choice("drafter", DRAFTERS, required=False, default=defaults.drafter),
            num_draft_tokens=d.int_in("num_draft_tokens", 1, 64, required=False,
                                      default=defaults.num_draft_tokens),
            adaptive=d.get("adaptive", bool, required=False, default=defaults.adaptive),
            target_threads=d.int_in("target_threads", 0, 1024, required=False, default=0),
            draft_threads=d.int_in("draft_threads", 0, 1024, required=False, default=0),
        )
    return PairManifest(
        root=root,
        target=target,
        draft=draft,
        vocab_size=vocab,
        bos_token_id=bos,
        eos_token_ids=tuple(eos_raw),
        pad_token_id=pad,
        tokenizer_files=tokenizer_files,
        defaults=defaults,
        provenance=free_form(r, "provenance"),
        version=version,
        engines=parse_engines(r, root, {"target": target, "draft": draft}),
    )


def read_manifest(root: Path | str) -> PairManifest:
    """Read and validate `root/specedge.json` and check that every listed file exists; no
    hashing (what `load_manifest` adds), so it suits a re-read of a pair just loaded.

    Raises:
        ManifestError: as `load_manifest`, except for hash mismatches.
    """
    root = Path(root)
    if root.is_file():
        raise ManifestError(f"{root}: is a file, not a pair folder; give the folder "
                            "`specedge export` wrote")
    if not root.is_dir():
        raise ManifestError(f"{root}: no such pair folder; create one with `specedge export`")
    file = root / MANIFEST_NAME
    missing = ManifestError(f"{file}: missing; {root} is not a specedge pair folder (create "
                            "one with `specedge export`)")
    if not os.path.lexists(file):
        raise missing
    if not confine(root, MANIFEST_NAME, file=file, key=MANIFEST_NAME).is_file():
        raise missing
    doc = json_loads_bounded(read_bounded(file, MAX_MANIFEST_BYTES, ManifestError), file)
    manifest = parse_manifest(root, doc, file=file)
    for rel in _listed(manifest):
        if not (root / rel).is_file():
            raise ManifestError(f"{file}: listed file {rel!r} is missing from {root}; "
                                "re-export or copy the whole pair folder")
    return manifest


def load_manifest(root: Path | str, *, verify_hashes: bool = True) -> PairManifest:
    """Read and validate `root/specedge.json`, and check the files it lists.

    Args:
        root: the pair folder.
        verify_hashes: check the sha256 of every listed file (the default). Skipping is logged.
            The tokenizer files are hashed as they are read either way (`read_listed`).

    Raises:
        ManifestError: missing folder or manifest, malformed JSON, schema violation, a listed
            file that is missing or whose hash differs.
    """
    manifest = read_manifest(root)
    root = manifest.root
    if verify_hashes:
        for rel, digest in _listed(manifest).items():
            if sha256_file(root / rel) != digest:
                raise ManifestError(
                    f"{root / rel}: sha256 does not match {root / MANIFEST_NAME}; the file is "
                    "corrupt or was modified; re-export the pair"
                )
    else:
        log.warning("sha256 check of %s skipped on request", root)
    return manifest


def _listed(manifest: PairManifest) -> dict[str, str]:
    listed: dict[str, str] = dict(manifest.tokenizer_files)
    for spec in (manifest.target, manifest.draft):
        if spec is not None:
            listed.update(spec.files)
    return listed


def read_listed(manifest: PairManifest, rel: str, *, limit: int = MAX_TOKENIZER_FILE_BYTES
                ) -> bytes:
    """Read a tokenizer file listed in the manifest: confined to the pair folder, bounded in
    size, and checked against its sha256 *as read* (the bytes returned are the bytes hashed).

    Raises:
        ManifestError: not listed, outside the folder, too large, or a different sha256.
    """
    file = manifest.root / MANIFEST_NAME
    digest = manifest.tokenizer_files.get(rel)
    if digest is None:
        raise ManifestError(f"{file}: tokenizer.files does not list {rel!r}")
    path = confine(manifest.root, rel, file=file, key=f"tokenizer.files.{rel}")
    data = read_bounded(path, limit)
    if hashlib.sha256(data).hexdigest() != digest:
        raise ManifestError(f"{manifest.root / rel}: sha256 does not match {file}; the file is "
                            "corrupt or was modified; re-export the pair")
    return data


def write_manifest(manifest: PairManifest, folder: Path) -> Path:
    """Write `manifest` as `folder/specedge.json` (used by the exporter and `tune`), atomically.

    Raises:
        OutputError: the file cannot be written; the previous manifest is left as it was.
    """
    text = json_dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n"
    return write_atomic(Path(folder) / MANIFEST_NAME, text)


def describe(manifest: PairManifest) -> Mapping[str, Any]:
    """A short summary for `specedge inspect`."""
    out: dict[str, Any] = {"folder": str(manifest.root), "vocab_size": manifest.vocab_size}
    for name, spec in (("target", manifest.target), ("draft", manifest.draft)):
        if spec is not None:
            out[name] = {"precision": spec.precision, "graph": spec.graph,
                         "layers": spec.num_layers, "max_seq_len": spec.max_seq_len,
                         "validation": spec.validation}
            if spec.input_id_map is not None:  # a draft with its own tokenizer
                out[name]["vocab_bridge"] = spec.source.get("vocab_bridge", True)
    out["defaults"] = asdict(manifest.defaults)
    if manifest.engines:
        out["engines"] = {name: {"path": e.path, "precision": e.precision,
                                 "max_batch": e.max_batch, "built_on": e.key.describe()}
                          for name, e in manifest.engines.items()}
    return out
