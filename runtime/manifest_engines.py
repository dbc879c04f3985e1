"""The manifest's optional `engines` object: each model's prebuilt TensorRT engine (an EPContext
model and its engine files), with the cache key it was built for and its optimization profile,
validated as untrusted input like the rest of the manifest (`runtime/manifest.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .engines import ENGINE_MODELS, ENGINE_PRECISIONS, EngineKey, EngineProfile, EngineSpec
from .files import confine
from .manifest_json import Reader, file_map, free_form, short_string

if TYPE_CHECKING:
    from .manifest import ModelSpec

MAX_ENGINE_FILES = 64  # an EPContext model and its engine file(s)
MAX_PROFILE_INPUTS = 4096  # inputs of one optimization profile (2 x layers + a few)
MAX_PROFILE_RANK = 8


def _profile(r: Reader) -> EngineProfile:
    """min / opt / max shapes: the same inputs and ranks in each, min <= opt <= max."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for kind in ("min", "opt", "max"):
        kr = r.sub(kind)
        assert kr is not None
        if not 0 < len(kr.data) <= MAX_PROFILE_INPUTS:
            kr.fail(kr.where, f"an object of 1 to {MAX_PROFILE_INPUTS} input shapes",
                    f"<{len(kr.data)} entries>")
        out: dict[str, tuple[int, ...]] = {}
        for name, dims in kr.data.items():
            key = kr.key(name)
            if len(name) > 512 or not isinstance(dims, list) or \
                    not 0 < len(dims) <= MAX_PROFILE_RANK or \
                    not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 1 << 24
                            for d in dims):
                kr.fail(key, f"a list of 1 to {MAX_PROFILE_RANK} dimensions in [0, {1 << 24}]",
                        dims)
            out[name] = tuple(dims)
        shapes[kind] = out
    for name, low in shapes["min"].items():
        opt, high = shapes["opt"].get(name), shapes["max"].get(name)
        if opt is None or high is None or not len(low) == len(opt) == len(high) or \
                not all(a <= b <= c for a, b, c in zip(low, opt, high, strict=True)):
            r.fail(r.key(f"*.{name}"), "the same rank in min, opt and max with min <= opt <= max",
                   [low, opt, high])
    if set(shapes["min"]) != set(shapes["opt"]) or set(shapes["min"]) != set(shapes["max"]):
        r.fail(r.where, "min, opt and max over the same inputs", sorted(shapes["max"]))
    return EngineProfile(shapes["min"], shapes["opt"], shapes["max"])


def _parse_engine(r: Reader, root: Path) -> EngineSpec:
    path = r.get("path", str)
    confine(root, path, file=r.file, key=r.key("path"))
    files = file_map(r, "files", root)
    if len(files) > MAX_ENGINE_FILES:
        r.fail(r.key("files"), f"at most {MAX_ENGINE_FILES} files", f"<{len(files)} files>")
    if path not in files:
        r.fail(r.key("files"), f"an object that lists the EPContext model {path!r}", list(files))
    kr = r.sub("key")
    assert kr is not None
    key = EngineKey(gpu=short_string(kr, "gpu"),
                    compute_capability=short_string(kr, "compute_capability", 16),
                    tensorrt=short_string(kr, "tensorrt", 32),
                    onnxruntime=short_string(kr, "onnxruntime", 64))
    pr = r.sub("profile")
    assert pr is not None
    return EngineSpec(path=path, files=files, key=key,
                      precision=r.choice("precision", ENGINE_PRECISIONS),
                      max_batch=r.int_in("max_batch", 1, 4096), profile=_profile(pr),
                      source=free_form(r, "source"))


def parse_engines(r: Reader, root: Path, models: dict[str, ModelSpec | None]
                   ) -> dict[str, EngineSpec]:
    """The optional `engines` object: model name -> prebuilt TensorRT engine."""
    er = r.sub("engines", required=False)
    if er is None:
        return {}
    out: dict[str, EngineSpec] = {}
    for name in er.data:
        if name not in ENGINE_MODELS or models.get(name) is None:
            er.fail(er.key(name), "an engine of a model of the pair ("
                    + ", ".join(n for n in ENGINE_MODELS if models.get(n)) + ")", name)
        sub = er.sub(name)
        assert sub is not None
        out[name] = _parse_engine(sub, root)
    return out
