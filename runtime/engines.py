"""Prebuilt TensorRT engines at load time: this machine's cache key, and whether to use one.

`specedge build-engine` compiles each model of a pair with ONNX Runtime's TensorRT execution
provider into an EPContext model (ONNX Runtime's "EP context" format: one `com.microsoft`
`EPContext` node whose `ep_cache_context` names an engine file beside it) and lists it in the
manifest under `engines`, with the key of the machine that built it. A TensorRT engine is only
valid for the GPU (compute capability), TensorRT version and onnxruntime version it was built
with, and ONNX Runtime itself only *warns* on a compute-capability mismatch, so the runtime
compares the key itself and otherwise loads the plain ONNX model with one line saying why.

Everything here is pure except `machine_key`, which asks the CUDA driver (`libcuda`) and the
TensorRT library (`libnvinfer`) through ctypes: no torch, no tensorrt Python package.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from typing import Any

from .providers import PROVIDERS

ENGINE_MODELS = ("target", "draft")
ENGINE_PRECISIONS = ("fp32", "fp16", "int8")
TENSORRT_EP = PROVIDERS["tensorrt"]
# TensorRT's runtime library, newest first (TensorRT 10, then 8 as on JetPack 5).
NVINFER_SONAMES = ("libnvinfer.so.10", "libnvinfer.so.8", "libnvinfer.so")


@dataclass(frozen=True)
class EngineKey:
    """What a TensorRT engine is valid for: the GPU and the two library versions."""

    gpu: str  # the CUDA device name, e.g. "Orin" or "NVIDIA H200"
    compute_capability: str  # "8.7"
    tensorrt: str  # "10.3.0"
    onnxruntime: str  # "1.20.0"

    def describe(self) -> str:
        return (f"{self.gpu} (compute {self.compute_capability}), TensorRT {self.tensorrt}, "
                f"onnxruntime {self.onnxruntime}")


@dataclass(frozen=True)
class EngineProfile:
    """One TensorRT optimization profile: min / opt / max shape of each dynamic input."""

    min: dict[str, tuple[int, ...]]
    opt: dict[str, tuple[int, ...]]
    max: dict[str, tuple[int, ...]]

    def to_json(self) -> dict[str, dict[str, list[int]]]:
        return {kind: {name: list(dims) for name, dims in getattr(self, kind).items()}
                for kind in ("min", "opt", "max")}


@dataclass(frozen=True)
class EngineSpec:
    """One model's prebuilt engine as the manifest lists it (`engines.<model>`)."""

    path: str  # the EPContext model, relative to the pair folder
    files: dict[str, str]  # relative path -> sha256: the EPContext model and its engine file
    key: EngineKey
    precision: str  # "fp32" | "fp16" | "int8" (TensorRT's build flags)
    max_batch: int
    profile: EngineProfile
    source: dict[str, Any] = field(default_factory=dict)  # the ONNX file it was built from

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "files": dict(self.files),
                "key": {"gpu": self.key.gpu, "compute_capability": self.key.compute_capability,
                        "tensorrt": self.key.tensorrt, "onnxruntime": self.key.onnxruntime},
                "precision": self.precision, "max_batch": self.max_batch,
                "profile": self.profile.to_json(), "source": dict(self.source)}


@dataclass(frozen=True)
class EngineChoice:
    """The load-time decision for one model: the engine to use (or None) and, when an engine
    was listed or asked for but is not used, the one-line reason."""

    engine: EngineSpec | None
    message: str | None = None


# ----------------------------------------------------------------------------- the machine


def tensorrt_version_string(value: int) -> str:
    """`getInferLibVersion()` as "major.minor.patch".

    TensorRT 10+ encodes major * 10000 + minor * 100 + patch (10.3.0 -> 100300); TensorRT 8
    encoded major * 1000 + minor * 100 + patch (8.6.1 -> 8601).
    """
    if value >= 100_000:
        return f"{value // 10_000}.{value // 100 % 100}.{value % 100}"
    return f"{value // 1000}.{value // 100 % 10}.{value % 100}"


def tensorrt_version() -> str | None:
    """The version of the TensorRT library the loader finds (None: none found)."""
    for soname in NVINFER_SONAMES:
        try:
            lib = ctypes.CDLL(soname)
        except OSError:
            continue
        try:
            fn = lib.getInferLibVersion
        except AttributeError:
            continue
        fn.restype = ctypes.c_int32
        return tensorrt_version_string(int(fn()))
    return None


def cuda_device(device_id: int = 0) -> tuple[str, str] | None:
    """(name, compute capability) of CUDA device `device_id` from the driver (None: no driver
    or no such device)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, dev = ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or \
            not 0 <= device_id < count.value or cuda.cuDeviceGet(ctypes.byref(dev), device_id):
        return None
    name, major, minor = ctypes.create_string_buffer(256), ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGetName(name, 256, dev)
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # COMPUTE_CAPABILITY_MINOR
    return name.value.decode(errors="replace").strip(), f"{major.value}.{minor.value}"


@functools.lru_cache(maxsize=8)
def machine_key(device_id: int = 0) -> tuple[EngineKey | None, str | None]:
    """This machine's engine key, or (None, why there is none).

    The reason says what is missing: no CUDA GPU, or no TensorRT library.
    """
    import onnxruntime as ort

    device = cuda_device(device_id)
    if device is None:
        return None, f"no CUDA GPU {device_id} found (no NVIDIA driver or no such device)"
    trt = tensorrt_version()
    if trt is None:
        return None, f"the TensorRT library ({NVINFER_SONAMES[0]}) is not installed"
    return EngineKey(gpu=device[0], compute_capability=device[1], tensorrt=trt,
                     onnxruntime=ort.__version__), None


# ----------------------------------------------------------------------------- decisions


def key_mismatch(built: EngineKey, here: EngineKey) -> str | None:
    """Why an engine built for `built` cannot run here (None: it can).

    A different GPU model or compute capability comes first ("GPU differs"); otherwise the
    versions that differ are named ("versions differ").
    """
    if (built.gpu, built.compute_capability) != (here.gpu, here.compute_capability):
        return (f"GPU differs: built for {built.gpu} (compute {built.compute_capability}), "
                f"this is {here.gpu} (compute {here.compute_capability})")
    versions = [f"{name} {a} vs {b} here" for name, a, b in
                (("TensorRT", built.tensorrt, here.tensorrt),
                 ("onnxruntime", built.onnxruntime, here.onnxruntime)) if a != b]
    if versions:
        return "versions differ: built with " + "; ".join(versions)
    return None


def choose_engine(model: str, engine: EngineSpec | None, provider: str,
                  available: tuple[str, ...] | list[str],
                  here: EngineKey | None, why_no_key: str | None = None,
                  model_sha: str | None = None) -> EngineChoice:
    """Whether `model` loads its prebuilt engine, and if not, the one line that says why.

    Args:
        model: "target" or "draft" (for the message).
        engine: the manifest's entry for this model (None: none was built).
        provider: the provider this model runs on ("cpu", "cuda", "tensorrt").
        available: `onnxruntime.get_available_providers()`.
        here: this machine's key (`machine_key`), None when it has none.
        why_no_key: `machine_key`'s reason when `here` is None.
        model_sha: the sha256 of the model's ONNX file now: an engine built from another file
            (the model was re-exported or re-quantized since) is stale.

    Engines are ignored silently on other providers; on TensorRT a model without an engine gets
    a hint (TensorRT then compiles the ONNX model itself, for minutes, at every load).
    """
    if provider != "tensorrt":
        return EngineChoice(None)
    if engine is None:
        return EngineChoice(None, f"{model} model: no prebuilt TensorRT engine in the pair; "
                                  "TensorRT compiles the ONNX model at load (prebuild it with "
                                  "`specedge build-engine PAIR`)")
    fallback = f"running {engine.source.get('path', 'the ONNX model')} instead"
    if TENSORRT_EP not in available:
        return EngineChoice(None, f"{model} model: TensorRT engine not used (TensorRT EP not "
                                  f"available in this onnxruntime: {', '.join(available)}); "
                                  f"{fallback}")
    if here is None:
        return EngineChoice(None, f"{model} model: TensorRT engine not used (TensorRT EP not "
                                  f"available: {why_no_key or 'no GPU or TensorRT'}); "
                                  f"{fallback}")
    reason = key_mismatch(engine.key, here)
    built_from = engine.source.get("sha256")
    if reason is None and model_sha is not None and built_from != model_sha:
        reason = "built from a different model file: the model changed since"
    if reason is not None:
        return EngineChoice(None, f"{model} model: TensorRT engine not used ({reason}); "
                                  f"{fallback}; rebuild it here with `specedge build-engine`")
    return EngineChoice(engine)


def profile_option(shapes: dict[str, tuple[int, ...]]) -> str:
    """A profile in the TensorRT EP's option syntax: "name:1x2x3,name2:4x5"."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in dims)}" for name, dims in shapes.items())
