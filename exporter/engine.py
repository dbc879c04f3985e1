"""`specedge build-engine`: TensorRT engines for a pair, through ONNX Runtime's TensorRT EP.

Each model of the pair is compiled by ONNX Runtime's TensorRT execution provider with one explicit
optimization profile derived from the manifest, and dumped as an EPContext model (ONNX Runtime's
"EP context" cache format: `trt_dump_ep_context_model`, `trt_ep_context_embed_mode` 0) whose
single `com.microsoft.EPContext` node names the serialized engine beside it. The manifest then
lists both files with their sha256, the profile and the key of the machine that built them
(`runtime.engines.EngineKey`); the runtime loads them only on a machine with the same key.

What is built (graph forms, profiles, provider options) is decided by `engine_plan`.

Graph form: TensorRT takes standard ONNX ops only. The `gqa-shared` form is built around ONNX
Runtime contrib ops (`com.microsoft` GroupQueryAttention, SkipSimplifiedLayerNormalization,
MatMulNBits for int4) that TensorRT's ONNX parser does not implement, so ONNX Runtime would cut
the graph into TensorRT islands between CUDA-EP nodes, and the TensorRT EP dumps an EPContext
model only for a graph it runs whole. Only `concat` pairs with no contrib op are accepted; the
check reads the ONNX protobuf directly (no `onnx` package needed on the device).

Profile (one; ONNX Runtime's TensorRT EP runs every input on profile 0): batch 1..B (opt B), new
tokens 1..max_seq_len (opt K+1: the prefill feeds the whole prompt in one call, verification
feeds K+1), past 0..max_seq_len-1 (opt max_seq_len/2), attention mask 1..max_seq_len+K+1 (ragged
rows pad the past to the longest row). Unmeasured on any TensorRT machine here.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specedge.runtime.engines import (
    ENGINE_MODELS,
    ENGINE_PRECISIONS,
    TENSORRT_EP,
    EngineKey,
    EngineProfile,
    EngineSpec,
    key_mismatch,
)
from specedge.runtime.errors import ExportError, InputError, ManifestError
from specedge.runtime.files import copy_pair, sha256_file
from specedge.runtime.manifest import (
    ModelSpec,
    PairManifest,
    engine_files_ready,
    load_manifest,
    write_manifest,
)
from specedge.runtime.onnx_file import read_graph

from .engine_plan import check_graph_form, profile_shapes, provider_options, require_tensorrt

ENGINES_DIR = "engines"


@dataclass(frozen=True)
class EngineOptions:
    """What `specedge build-engine` was asked to do.

    Attributes:
        pair: the pair folder.
        output: write a copy of the pair with engines there (None: add them to `pair`).
        batch: the largest batch the engines take (the profile's batch range is 1..batch).
        precision: TensorRT build flags: "fp32", "fp16" (trt_fp16_enable) or "int8"
            (trt_int8_enable + fp16; INT8 only applies to Q/DQ nodes, see docs/jetson.md).
        force: rebuild engines the manifest already lists, and replace a non-empty --output.
        device_id: the CUDA device to build on.
    """

    pair: Path
    output: Path | None = None
    batch: int = 1
    precision: str = "fp16"
    force: bool = False
    device_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or \
                not 1 <= self.batch <= 4096:
            raise InputError(f"--batch must be an integer in [1, 4096], got {self.batch!r}")
        if self.precision not in ENGINE_PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(ENGINE_PRECISIONS)}, got "
                             f"{self.precision!r}")


@dataclass(frozen=True)
class BuildReport:
    """What `build_engines` did: the pair folder written, and per model its engine (or why
    nothing was built: "up to date")."""

    folder: Path
    engines: dict[str, EngineSpec] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: str | None = None


# ----------------------------------------------------------------------------- building


def read_context_model(folder: Path, root: Path) -> tuple[str, dict[str, str]]:
    """The EPContext model the TensorRT EP dumped in `folder` and the files it needs.

    Returns:
        (its path relative to `root`, {relative path: sha256} of it and its engine file).

    Raises:
        ExportError: no single context model, a node that is not an EPContext node (the graph
            was split between TensorRT and another provider), an embedded engine, or an engine
            path outside the folder.
    """
    found = sorted(p for p in folder.glob("*.onnx") if p.is_file())
    if len(found) != 1:
        raise ExportError(f"{folder}: the TensorRT EP wrote {len(found)} EPContext models, "
                          "expected 1; run with `specedge -vv build-engine` to see its log")
    ctx = found[0]
    graph = read_graph(ctx)
    others = Counter(f"{d}.{op}".lstrip(".") for d, op, _ in graph.nodes if op != "EPContext")
    if others or not graph.nodes:
        raise ExportError(f"{ctx}: TensorRT did not take the whole graph (left for other "
                          f"providers: {dict(others.most_common(4))}); this graph cannot be "
                          "one engine")
    files = {ctx.relative_to(root).as_posix(): sha256_file(ctx)}
    for _, _, attrs in graph.nodes:
        cache = attrs.get("ep_cache_context")
        if attrs.get("embed_mode", 0) != 0 or not isinstance(cache, bytes):
            raise ExportError(f"{ctx}: the engine is embedded in the model, expected a file "
                              "(trt_ep_context_embed_mode 0)")
        rel = cache.decode(errors="replace")
        engine = (folder / rel).resolve()
        if Path(rel).is_absolute() or ".." in Path(rel).parts or \
                folder.resolve() not in engine.parents or not engine.is_file():
            raise ExportError(f"{ctx}: its engine {rel!r} is not a file inside {folder}")
        files[engine.relative_to(root.resolve()).as_posix()] = sha256_file(engine)
    return ctx.relative_to(root).as_posix(), files


def _warmup_feeds(session: Any, spec: ModelSpec) -> dict[str, np.ndarray]:
    """Feeds of one small step (batch 1, 2 new tokens after 1 cached one) inside the profile."""
    dtype = np.float16 if spec.kv.dtype == "float16" else np.float32
    feeds: dict[str, np.ndarray] = {}
    for inp in session.get_inputs():
        if inp.name in (spec.input_ids, spec.position_ids):
            feeds[inp.name] = np.array([[1, 2]], dtype=np.int64)
        elif inp.name == spec.attention_mask:
            feeds[inp.name] = np.ones((1, 3), dtype=np.int64)
        else:
            feeds[inp.name] = np.zeros((1, spec.num_kv_heads, 1, spec.head_dim), dtype=dtype)
    return feeds


def compile_model(root: Path, spec: ModelSpec, name: str, folder: Path, profile: EngineProfile,
                  opts: EngineOptions, key: EngineKey) -> EngineSpec:
    """Build one model's engine in `folder` (inside `root`) and describe it.

    Raises:
        ExportError: the TensorRT EP did not start or did not take the whole graph.
    """
    import onnxruntime as ort

    folder.mkdir(parents=True, exist_ok=True)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.log_severity_level = 3
    trt = provider_options(profile, opts.precision, folder, device_id=opts.device_id)
    try:
        session = ort.InferenceSession(str(root / spec.path), so,
                                       providers=[(TENSORRT_EP, trt)],
                                       enable_fallback=0)  # no retry banner on stdout
        if TENSORRT_EP not in session.get_providers():  # onnxruntime fell back silently
            raise ExportError(f"{spec.path}: the TensorRT EP did not start for the {name} "
                              "model; see `specedge doctor --providers tensorrt`")
        session.run(None, _warmup_feeds(session, spec))  # the engine exists once this ran
    except ExportError:
        raise
    except Exception as exc:  # onnxruntime raises its own exception types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ExportError(f"{spec.path}: TensorRT could not build the {name} model ({first})"
                          ) from None
    return describe_engine(root, spec, folder, profile, opts, key)


def describe_engine(root: Path, spec: ModelSpec, folder: Path, profile: EngineProfile,
                    opts: EngineOptions, key: EngineKey) -> EngineSpec:
    """The manifest entry of the engine the TensorRT EP dumped in `folder` for `spec`.

    Raises:
        ExportError: as `read_context_model`.
    """
    path, files = read_context_model(folder, root)
    return EngineSpec(path=path, files=files, key=key, precision=opts.precision,
                      max_batch=opts.batch, profile=profile,
                      source={"path": spec.path, "sha256": spec.files[spec.path]})


def up_to_date(manifest: PairManifest, key: EngineKey, opts: EngineOptions,
               profiles: dict[str, EngineProfile]) -> bool:
    """Whether the manifest already lists engines built here with these options and profiles,
    from the current model files, and whose files are all present and intact."""
    if set(manifest.engines) != set(profiles):
        return False
    for name, engine in manifest.engines.items():
        spec = manifest.target if name == "target" else manifest.draft
        assert spec is not None
        if key_mismatch(engine.key, key) or engine.precision != opts.precision or \
                engine.max_batch != opts.batch or engine.profile != profiles[name] or \
                engine.source.get("sha256") != spec.files[spec.path]:
            return False
        try:
            if engine_files_ready(manifest, name) is not None:
                return False
        except ManifestError:
            return False
    return True


def _models(manifest: PairManifest) -> list[tuple[str, ModelSpec]]:
    return [(n, s) for n, s in zip(ENGINE_MODELS, (manifest.target, manifest.draft),
                                   strict=True) if s is not None]


def plan_profiles(manifest: PairManifest, opts: EngineOptions) -> dict[str, EngineProfile]:
    """Check every model's graph form and derive its profile (no TensorRT needed).

    Raises:
        ExportError: a model TensorRT cannot take whole, or inputs the manifest does not name.
    """
    profiles = {}
    for name, spec in _models(manifest):
        graph = read_graph(manifest.root / spec.path)
        check_graph_form(spec, name, graph)
        profiles[name] = profile_shapes(spec, graph.inputs, batch=opts.batch,
                                        k=manifest.defaults.num_draft_tokens)
    return profiles


def build_engines(opts: EngineOptions, progress: Callable[[str], None] | None = None,
                  *, compile_fn: Callable[..., EngineSpec] = compile_model,
                  key_fn: Callable[[int], EngineKey] = require_tensorrt) -> BuildReport:
    """Compile every model of a pair into a TensorRT EPContext engine and list them in its
    manifest (in place, or in a copy at `opts.output`).

    The pair is checked first (hashes, graph form, profile, TensorRT present), engines are
    built in a temporary folder inside the output and moved into `engines/<model>/` only when
    all were built; the manifest is rewritten last, atomically. A failure leaves the pair as it
    was. `compile_fn` and `key_fn` are the TensorRT steps (tests on machines without TensorRT
    replace them).

    Raises:
        InputError: engines already listed (without `force`), or an unusable --output.
        ExportError: a graph TensorRT cannot take, TensorRT missing or failing.
        ManifestError: the pair folder is missing, malformed or tampered.
    """
    say = progress or (lambda _msg: None)
    manifest = load_manifest(opts.pair)
    profiles = plan_profiles(manifest, opts)
    key = key_fn(opts.device_id)
    out = _output_folder(opts)
    if out == manifest.root.resolve():
        if up_to_date(manifest, key, opts, profiles) and not opts.force:
            return BuildReport(folder=out, engines=dict(manifest.engines),
                               skipped=f"up to date (built on {key.describe()})")
        if manifest.engines and not opts.force:
            built = "; ".join(f"{n}: {e.key.describe()}" for n, e in manifest.engines.items())
            raise InputError(f"{out}: already lists TensorRT engines ({built}); pass --force "
                             "to rebuild them here")
        return _build_into(manifest, out, opts, profiles, key, say, compile_fn)
    from .output import staged_folder

    with staged_folder(out) as stage:
        copy_pair(manifest.root, stage)
        staged = dataclasses.replace(load_manifest(stage, verify_hashes=False), engines={})
        report = _build_into(staged, stage, opts, profiles, key, say, compile_fn)
    return dataclasses.replace(report, folder=out)


def _output_folder(opts: EngineOptions) -> Path:
    if opts.output is None or opts.output.expanduser().resolve() == opts.pair.resolve():
        return opts.pair.resolve()
    from .output import check_output

    return check_output(opts.output, force=opts.force, inputs=[opts.pair])


def _build_into(manifest: PairManifest, root: Path, opts: EngineOptions,
                profiles: dict[str, EngineProfile], key: EngineKey,
                say: Callable[[str], None], compile_fn: Callable[..., EngineSpec]
                ) -> BuildReport:
    """Build every engine under `root/engines/.build-*`, move them into place, then write the
    manifest."""
    base = root / ENGINES_DIR
    created = not base.exists()
    base.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=base))
    engines: dict[str, EngineSpec] = {}
    seconds: dict[str, float] = {}
    try:
        for name, spec in _models(manifest):
            say(f"building the {name} engine ({spec.path}, {opts.precision}, batch "
                f"1..{opts.batch}) on {key.describe()}")
            start = time.perf_counter()
            engines[name] = compile_fn(root, spec, name, work / name, profiles[name], opts, key)
            seconds[name] = time.perf_counter() - start
        final: dict[str, EngineSpec] = {}
        for name, engine in engines.items():
            dest = base / name
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(work / name, dest)
            old = f"{ENGINES_DIR}/{work.name}/{name}/"
            new = f"{ENGINES_DIR}/{name}/"
            final[name] = dataclasses.replace(
                engine, path=engine.path.replace(old, new, 1),
                files={rel.replace(old, new, 1): h for rel, h in engine.files.items()})
        write_manifest(dataclasses.replace(manifest, engines=final), root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and not any(base.iterdir()):
            base.rmdir()  # a failed first build leaves the pair as it was
    return BuildReport(folder=root, engines=final, seconds=seconds)
