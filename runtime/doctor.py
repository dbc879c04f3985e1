"""`specedge doctor`: what this machine can run, found before any model is loaded (no torch).

It reports the onnxruntime build and the execution providers it has, the NVIDIA GPUs (from
`nvidia-smi`, else the driver library `libcuda` through ctypes), the CUDA, cuBLAS, cuDNN and
TensorRT libraries the providers load (found on the loader path, only inside an `nvidia-*` pip
package, or missing, each with the line that installs it), Jetson boards (`/etc/nv_tegra_release`,
the JetPack version, the onnxruntime-gpu wheel that matches it), and a self-test of each provider:
a tiny built-in graph (`data/selftest.onnx`, made by `scripts/make_selftest_onnx.py`) run on the
provider in a child process and compared with numpy. The parsers are pure functions over text, so
tests feed them fake `nvidia-smi` output, release files and library lists.
This is tooling: the decoding core never imports it.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import numpy as np

from . import hugepages
from .errors import InputError
from .providers import PROVIDERS

SELFTEST_FILE = "data/selftest.onnx"
SELFTEST_TIMEOUT_S = {"cpu": 30.0, "cuda": 90.0, "tensorrt": 180.0}
SELFTEST_TOLERANCE = 1e-2  # fp32 graph; TF32 matmuls on a GPU stay well inside this
GPU_WHEEL = 'pip uninstall -y onnxruntime && pip install "onnxruntime-gpu[cuda,cudnn]"'
JETSON_INDEX = {6: "https://pypi.jetson-ai-lab.io/jp6/cu126",
                7: "https://pypi.jetson-ai-lab.io/sbsa/cu130"}
# Jetson Linux (L4T) release -> JetPack release, for the versions NVIDIA has published.
L4T_TO_JETPACK = {"35.4.1": "5.1.2", "35.5.0": "5.1.3", "35.6.0": "5.1.4", "36.2.0": "6.0 DP",
                  "36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2", "36.4.4": "6.2.1",
                  "38.2.0": "7.0"}


# ----------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the driver reports it."""

    index: int
    name: str
    compute_capability: str | None  # "9.0"
    memory_mib: int | None
    driver: str | None  # driver version ("580.159.03") or, from libcuda, its CUDA API ("13.0")
    source: str  # "nvidia-smi" | "libcuda"


@dataclass(frozen=True)
class LibraryStatus:
    """One shared library an execution provider loads."""

    component: str  # "cuDNN"
    soname: str  # "libcudnn.so.9"
    needed_by: str  # "cuda" | "tensorrt" | "info"
    status: str  # "loadable" | "pip only" | "missing"
    path: str | None
    fix: str | None


@dataclass(frozen=True)
class JetsonInfo:
    """A Jetson board: its Jetson Linux (L4T) and JetPack releases and the wheel to use."""

    model: str | None
    l4t: str | None  # "36.4.3"
    jetpack: str | None  # "6.2"
    advice: str


@dataclass(frozen=True)
class SelfTest:
    """The built-in graph on one provider."""

    provider: str  # "cpu" | "cuda" | "tensorrt"
    in_build: bool
    status: str  # "passed" | "failed" | "not in build" | "not tested"
    ran_on: tuple[str, ...] = ()  # the providers the session really used
    seconds: float | None = None
    max_abs_diff: float | None = None
    message: str = ""
    fix: str | None = None


@dataclass(frozen=True)
class DoctorReport:
    """Everything `specedge doctor` found."""

    python: str
    platform: str
    onnxruntime: str  # version
    onnxruntime_packages: tuple[str, ...]  # "onnxruntime-gpu 1.31.1"
    onnxruntime_cuda: str | None  # the CUDA version the build links against ("13.0")
    device: str  # ort.get_device()
    available_providers: tuple[str, ...]
    gpus: tuple[GpuInfo, ...]
    gpu_note: str
    libraries: tuple[LibraryStatus, ...]
    jetson: JetsonInfo | None
    self_tests: tuple[SelfTest, ...]
    requested: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    huge_pages: dict[str, Any] = field(default_factory=dict)  # `hugepages.status()`

    @property
    def failed(self) -> tuple[SelfTest, ...]:
        """The requested providers whose self-test did not pass."""
        by_name = {t.provider: t for t in self.self_tests}
        return tuple(by_name[p] for p in self.requested if by_name[p].status != "passed")

    @property
    def ok(self) -> bool:
        return not self.failed

    def failure_line(self) -> str:
        """One line naming each requested provider that cannot run, why, and the fix."""
        parts = []
        for t in self.failed:
            part = f"{t.provider} cannot run here: {t.message}"
            parts.append(part + (f"; fix: {t.fix}" if t.fix else ""))
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["failed"] = [t.provider for t in self.failed]
        return out


# ----------------------------------------------------------------------------- pure parsers


def parse_providers(text: str | None) -> tuple[str, ...]:
    """`"cuda,cpu"` -> `("cuda", "cpu")`; None or "" -> `("cpu",)`.

    Raises:
        InputError: an unknown provider name.
    """
    names = [p.strip().lower() for p in (text or "cpu").split(",") if p.strip()]
    unknown = [p for p in names if p not in PROVIDERS]
    if unknown or not names:
        raise InputError(f"--providers {text!r}: use names from {', '.join(PROVIDERS)}, "
                         "comma-separated")
    return tuple(dict.fromkeys(names))


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """Rows of `nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version
    --format=csv,noheader,nounits` (compute_cap may be absent on old drivers: 4 columns)."""
    gpus = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 4:
            cells.insert(2, "")
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        index, name, cap, mem, driver = cells
        gpus.append(GpuInfo(int(index), name, cap if re.fullmatch(r"\d+\.\d+", cap) else None,
                            int(float(mem)) if re.fullmatch(r"[\d.]+", mem) else None,
                            driver or None, "nvidia-smi"))
    return gpus


def parse_nv_tegra_release(text: str) -> str | None:
    """`# R36 (release), REVISION: 4.3, ...` -> the Jetson Linux version "36.4.3"."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return f"{m.group(1)}.{m.group(2)}.{m.group(3) or 0}"


def parse_dpkg_jetpack(text: str) -> str | None:
    """`dpkg-query -W nvidia-jetpack` output (`nvidia-jetpack\\t6.2+b77`) -> "6.2"."""
    m = re.search(r"nvidia-jetpack\s+(\d+(?:\.\d+)*)", text)
    return m.group(1) if m else None


def jetpack_for_l4t(l4t: str | None) -> str | None:
    """The JetPack release of a Jetson Linux version ("36.4.3" -> "6.2"; "36.9.0" -> "6.x")."""
    if l4t is None:
        return None
    if l4t in L4T_TO_JETPACK:
        return L4T_TO_JETPACK[l4t]
    major = {"35": "5", "36": "6", "38": "7"}.get(l4t.split(".")[0])
    return f"{major}.x" if major else None


def jetson_advice(jetpack: str | None) -> str:
    """Which onnxruntime-gpu wheel fits a JetPack release (PyPI has no Jetson GPU wheel)."""
    major = int(jetpack.split(".")[0]) if jetpack and jetpack[0].isdigit() else None
    if major == 6:
        return (f"JetPack 6 (CUDA 12.6): pip uninstall -y onnxruntime && pip install "
                f"onnxruntime-gpu --index-url {JETSON_INDEX[6]}")
    if major == 7:
        return (f"JetPack 7 (CUDA 13, Jetson Thor is an SBSA device): pip uninstall -y "
                f"onnxruntime && pip install onnxruntime-gpu --index-url {JETSON_INDEX[7]} "
                "(or the jp7/cu13x folder of https://pypi.jetson-ai-lab.io/ that matches "
                "`nvcc --version`)")
    if major == 5:
        return ("JetPack 5 (CUDA 11.4, Python 3.8) has onnxruntime-gpu wheels only up to 1.18 "
                "for Python 3.8 (Jetson Zoo), older than specedge needs: upgrade to JetPack 6")
    return (f"unknown JetPack release: pick the folder of https://pypi.jetson-ai-lab.io/ that "
            f"matches `nvcc --version` (JetPack 6: {JETSON_INDEX[6]})")


def required_libraries(cuda_major: int) -> list[tuple[str, str, str]]:
    """(component, soname, needed_by) of what onnxruntime-gpu's CUDA and TensorRT providers
    load, for a build against CUDA `cuda_major` (cuFFT's soname is one behind: 12 -> 11)."""
    m = cuda_major
    return [
        ("CUDA driver", "libcuda.so.1", "cuda"),
        ("CUDA runtime", f"libcudart.so.{m}", "cuda"),
        ("cuBLAS", f"libcublas.so.{m}", "cuda"),
        ("cuBLASLt", f"libcublasLt.so.{m}", "cuda"),
        ("cuFFT", f"libcufft.so.{m - 1}", "cuda"),
        ("cuRAND", "libcurand.so.10", "cuda"),
        ("cuDNN", "libcudnn.so.9", "cuda"),
        ("TensorRT", "libnvinfer.so.10", "tensorrt"),
        ("TensorRT plugins", "libnvinfer_plugin.so.10", "tensorrt"),
        ("TensorRT ONNX parser", "libnvonnxparser.so.10", "tensorrt"),
        ("NVML", "libnvidia-ml.so.1", "info"),
    ]


def library_fix(component: str, cuda_major: int, jetson: bool) -> str:
    """The line that installs a missing library."""
    if component == "CUDA driver":
        return ("the driver comes with JetPack (sudo apt install nvidia-jetpack)" if jetson
                else "install the NVIDIA driver (>= 580 for CUDA 13) from your distribution")
    if component == "NVML":
        return "comes with the NVIDIA driver (only used to describe the GPU)"
    if jetson:  # CUDA, cuDNN and TensorRT are JetPack's, not pip's
        extra = ("libcudnn9-cuda-12" if component == "cuDNN" else "tensorrt"
                 if component.startswith("TensorRT") else "cuda-toolkit")
        return f"sudo apt install nvidia-jetpack (or {extra})"
    if component.startswith("TensorRT"):
        return f"pip install tensorrt-cu{cuda_major}-libs"
    if component == "cuDNN":
        return f'pip install "onnxruntime-gpu[cudnn]" (or nvidia-cudnn-cu{cuda_major})'
    return 'pip install "onnxruntime-gpu[cuda]"'


def library_statuses(cuda_major: int, locate: Callable[[str], tuple[str, str | None]],
                     jetson: bool = False) -> tuple[LibraryStatus, ...]:
    """Each required library with where `locate(soname)` found it: ("loadable", path), ("pip
    only", folder) when it sits in an nvidia pip package the loader does not search, or
    ("missing", None)."""
    out = []
    for component, soname, needed_by in required_libraries(cuda_major):
        status, path = locate(soname)
        fix = None
        if status == "missing":
            fix = library_fix(component, cuda_major, jetson)
        elif status == "pip only":
            fix = (f"export LD_LIBRARY_PATH={path}:$LD_LIBRARY_PATH (or call "
                   "onnxruntime.preload_dlls() before loading a pair)")
        out.append(LibraryStatus(component, soname, needed_by, status, path, fix))
    return tuple(out)


def provider_fix(provider: str, in_build: bool, libraries: Sequence[LibraryStatus],
                 jetson: JetsonInfo | None, cuda_major: int) -> str | None:
    """What makes `provider` run: the wheel when the build lacks it, else the first library
    it needs that is not loadable."""
    if provider == "cpu":
        return None if in_build else "pip install --force-reinstall onnxruntime"
    if not in_build:
        wheel = jetson.advice if jetson else GPU_WHEEL
        return wheel + (f" && pip install tensorrt-cu{cuda_major}-libs"
                        if provider == "tensorrt" and not jetson else "")
    needs = ("cuda",) if provider == "cuda" else ("cuda", "tensorrt")
    for lib in libraries:
        if lib.needed_by in needs and lib.status != "loadable" and lib.fix:
            return f"{lib.component} ({lib.soname}): {lib.fix}"
    return None


# ----------------------------------------------------------------------------- probes


def nvidia_pip_lib_dirs(paths: Iterable[str] | None = None) -> list[Path]:
    """`lib` folders of the nvidia-* pip packages (`nvidia/cu13/lib`, `nvidia/cudnn/lib`, ...)."""
    dirs: list[Path] = []
    for entry in paths if paths is not None else sys.path:
        root = Path(entry) / "nvidia"
        if root.is_dir():
            dirs += sorted(d for d in root.glob("*/lib") if d.is_dir())
    return list(dict.fromkeys(dirs))


def locate_library(soname: str, extra_dirs: Sequence[Path] = ()) -> tuple[str, str | None]:
    """("loadable", path) when the dynamic loader opens `soname`; ("pip only", folder) when only
    a folder in `extra_dirs` holds it; else ("missing", None)."""
    try:
        ctypes.CDLL(soname)
    except OSError:
        for folder in extra_dirs:
            if (folder / soname).exists():
                return "pip only", str(folder)
        return "missing", None
    return "loadable", _loaded_path(soname)


def _loaded_path(soname: str) -> str | None:
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if os.path.basename(path).startswith(soname):
                return path
    except OSError:
        pass
    return None


def gpus_from_nvidia_smi(timeout: float = 15.0) -> tuple[list[GpuInfo], str]:
    """GPUs from `nvidia-smi` (and a note saying why none were found)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "nvidia-smi not on PATH"
    query = "index,name,compute_cap,memory.total,driver_version"
    for fields in (query, query.replace("compute_cap,", "")):
        try:
            proc = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [], f"nvidia-smi failed ({type(exc).__name__})"
        if proc.returncode == 0:
            return parse_nvidia_smi(proc.stdout), "nvidia-smi"
    last = (proc.stderr or proc.stdout).strip().splitlines()
    return [], f"nvidia-smi failed ({last[-1][:120] if last else proc.returncode})"


def gpus_from_libcuda() -> tuple[list[GpuInfo], str | None]:
    """GPUs and the driver's CUDA API version ("13.0") through the driver library, no torch."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return [], None
    if cuda.cuInit(0) != 0:
        return [], None
    version, count = ctypes.c_int(), ctypes.c_int()
    cuda.cuDriverGetVersion(ctypes.byref(version))
    api = f"{version.value // 1000}.{version.value % 1000 // 10}"
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return [], api
    gpus = []
    for i in range(count.value):
        dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        mem, name = ctypes.c_size_t(), ctypes.create_string_buffer(256)
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        cuda.cuDeviceGetName(name, 256, dev)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # COMPUTE_CAPABILITY_MINOR
        cuda.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)
        gpus.append(GpuInfo(i, name.value.decode(errors="replace"),
                            f"{major.value}.{minor.value}", mem.value // 2**20, api, "libcuda"))
    return gpus, api


def detect_jetson(root: Path = Path("/")) -> JetsonInfo | None:
    """A Jetson board from `/etc/nv_tegra_release` (None elsewhere); the JetPack release from
    `dpkg-query -W nvidia-jetpack` when it answers, else from the Jetson Linux version."""
    release = root / "etc" / "nv_tegra_release"
    if not release.is_file():
        return None
    l4t = parse_nv_tegra_release(release.read_text(errors="replace"))
    jetpack = None
    if shutil.which("dpkg-query"):
        try:
            proc = subprocess.run(["dpkg-query", "-W", "nvidia-jetpack"], capture_output=True,
                                  text=True, timeout=10, check=False)
            jetpack = parse_dpkg_jetpack(proc.stdout)
        except (OSError, subprocess.TimeoutExpired):
            pass
    jetpack = jetpack or jetpack_for_l4t(l4t)
    model_file = root / "proc" / "device-tree" / "model"
    model = (model_file.read_text(errors="replace").strip("\x00\n ")
             if model_file.is_file() else None)
    return JetsonInfo(model, l4t, jetpack, jetson_advice(jetpack))


# ----------------------------------------------------------------------------- self-test


def selftest_arrays() -> dict[str, np.ndarray]:
    """Input and weights of the built-in graph (formulas, so numpy and the .onnx agree).

    Graph: `probs = Softmax(Tanh(x @ w1 + b1) @ w2)`, `top1 = ArgMax(probs, axis=-1)`;
    x `[2, 16]`, w1 `[16, 32]`, b1 `[32]`, w2 `[32, 8]`.
    """
    def wave(shape: tuple[int, ...], freq: float, scale: float) -> np.ndarray:
        return (np.sin(np.arange(int(np.prod(shape))) * freq + 0.5) * scale).reshape(
            shape).astype(np.float32)

    return {"x": wave((2, 16), 0.7, 1.0), "w1": wave((16, 32), 0.37, 0.5),
            "b1": wave((32,), 1.3, 0.1), "w2": wave((32, 8), 0.83, 1.5)}


def selftest_reference(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """numpy's answer: (probs `[2, 8]`, top1 `[2]`)."""
    h = np.tanh(arrays["x"].astype(np.float64) @ arrays["w1"] + arrays["b1"])
    z = h @ arrays["w2"]
    e = np.exp(z - z.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    return probs, probs.argmax(-1)


def selftest_model() -> Path:
    """The shipped graph file (package data)."""
    return Path(str(resources.files(__package__).joinpath(SELFTEST_FILE)))


def run_self_test(provider: str, model: Path | None = None) -> dict[str, Any]:
    """Run the built-in graph on `provider` in this process and compare with numpy.

    Returns a dict: passed, ran_on (the session's providers), seconds (session creation and
    one run), max_abs_diff, message.
    """
    import onnxruntime as ort

    t0 = time.perf_counter()
    arrays = selftest_arrays()
    from . import sessions

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if sessions.global_pool_active():
        # This process already runs sessions on ONNX Runtime's process-wide pool, after which
        # it refuses sessions with their own pools: join it.
        options.use_per_session_threads = False
    name = PROVIDERS[provider]
    chosen: list[Any] = [name] if provider == "cpu" else [name, PROVIDERS["cpu"]]
    try:
        session = ort.InferenceSession(str(model or selftest_model()), options, providers=chosen)
        ran_on = tuple(session.get_providers())
        probs, top1 = session.run(["probs", "top1"], {"x": arrays["x"]})
    except Exception as exc:  # onnxruntime raises its own exception types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {"passed": False, "ran_on": [], "seconds": time.perf_counter() - t0,
                "max_abs_diff": None, "message": f"session failed: {first[:300]}"}
    seconds = time.perf_counter() - t0
    ref_probs, ref_top1 = selftest_reference(arrays)
    diff = float(np.abs(np.asarray(probs, np.float64) - ref_probs).max())
    message = ""
    if not ran_on or ran_on[0] != name:
        message = f"onnxruntime fell back to {', '.join(ran_on) or 'nothing'} instead of {name}"
    elif diff > SELFTEST_TOLERANCE or not np.array_equal(np.asarray(top1), ref_top1):
        message = (f"wrong answer: max |Δ| {diff:.3g} vs numpy, top-1 {list(top1)} vs "
                   f"{list(ref_top1)}")
    return {"passed": not message, "ran_on": list(ran_on), "seconds": seconds,
            "max_abs_diff": diff, "message": message}


def run_self_test_isolated(provider: str, timeout: float | None = None) -> dict[str, Any]:
    """`run_self_test` in a child process: a provider that crashes, hangs or prints to stderr
    cannot take the doctor down with it. The child's stderr (where onnxruntime says which
    library it could not load) becomes the message when the test fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    limit = timeout or SELFTEST_TIMEOUT_S[provider]
    cmd = [sys.executable, "-m", __name__, "--self-test", provider]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"passed": False, "ran_on": [], "seconds": limit, "max_abs_diff": None,
                "message": f"self-test did not finish in {limit:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        result = {"passed": False, "ran_on": [], "seconds": None, "max_abs_diff": None,
                  "message": f"self-test process exited with {proc.returncode}"}
    if not result["passed"]:
        cause = loader_error(proc.stderr)
        if cause:
            result["message"] += f" ({cause})"
    return result


def loader_error(stderr: str) -> str | None:
    """The library onnxruntime could not load, from its log (`libcublasLt.so.13: cannot open
    shared object file`), or the last error line."""
    m = re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file", stderr)
    if m:
        return f"{m.group(1)} cannot be loaded"
    errors = [ln.strip() for ln in stderr.splitlines() if "error" in ln.lower() and ln.strip()]
    return errors[-1][-240:] if errors else None


# ----------------------------------------------------------------------------- diagnosis


def _ort_packages() -> tuple[str, ...]:
    found = []
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name == "onnxruntime" or (name.startswith("onnxruntime-") and "genai" not in name):
            found.append(f"{name} {dist.version}")
    return tuple(sorted(set(found)))


def _cuda_major(ort_cuda: str | None, jetson: JetsonInfo | None = None) -> int:
    """The CUDA major the providers need: the build's, else JetPack's, else PyPI's (13)."""
    try:
        return int(str(ort_cuda).split(".")[0])
    except ValueError:
        pass
    if jetson and jetson.jetpack and jetson.jetpack[0] in "56":
        return {"5": 11, "6": 12}[jetson.jetpack[0]]
    return 13  # onnxruntime-gpu on PyPI is built for CUDA 13


def diagnose(requested: Sequence[str] = ("cpu",), *, self_test: bool = True,
             jetson_root: Path = Path("/"), timeout_s: float | None = None) -> DoctorReport:
    """Look at this machine and self-test every provider the onnxruntime build has.

    Args:
        requested: providers that must work (they decide `report.ok`); "cpu" is always tested.
        self_test: run the built-in graph on each provider (else each is "not tested").
        jetson_root: where `/etc/nv_tegra_release` is looked for (tests pass a fake tree).
        timeout_s: limit of each provider's self-test (default: `SELFTEST_TIMEOUT_S`).
    """
    import onnxruntime as ort

    available = tuple(ort.get_available_providers())
    ort_cuda = getattr(ort, "cuda_version", "") or None
    jetson = detect_jetson(jetson_root)
    major = _cuda_major(ort_cuda, jetson)
    gpus, note = gpus_from_nvidia_smi()
    lib_gpus, driver_api = gpus_from_libcuda()
    if not gpus and lib_gpus:
        gpus, note = lib_gpus, "libcuda (driver API)"
    elif gpus and lib_gpus:  # old drivers do not report compute_cap through nvidia-smi
        gpus = [g if g.compute_capability or i >= len(lib_gpus) else
                GpuInfo(**{**asdict(g), "compute_capability": lib_gpus[i].compute_capability})
                for i, g in enumerate(gpus)]
    elif not gpus:
        note += "; libcuda.so.1 not loadable: no NVIDIA driver" if driver_api is None else ""
    pip_dirs = nvidia_pip_lib_dirs()
    libraries = library_statuses(major, lambda s: locate_library(s, pip_dirs), jetson is not None)
    packages = _ort_packages()
    warnings = []
    if sum(p.split()[0] in ("onnxruntime", "onnxruntime-gpu") for p in packages) > 1:
        warnings.append(f"several onnxruntime packages share one module ({', '.join(packages)}); "
                        "the last installed wins: pip uninstall -y onnxruntime onnxruntime-gpu, "
                        "then install only the one you need")
    if ort_cuda and driver_api and float(driver_api) < float(f"{major}.0"):
        warnings.append(f"the driver supports CUDA {driver_api} but onnxruntime is built for "
                        f"CUDA {ort_cuda}: update the NVIDIA driver")
    if jetson and jetson.jetpack and jetson.jetpack.startswith("5"):
        warnings.append(jetson.advice)
    tests = []
    for provider, name in PROVIDERS.items():
        in_build = name in available
        if not in_build:
            why = f"{name} is not in this onnxruntime build ({ort.__version__}, " \
                  f"providers: {', '.join(available)})"
            tests.append(SelfTest(provider, False, "not in build", message=why,
                                  fix=provider_fix(provider, False, libraries, jetson, major)))
            continue
        if not self_test:
            tests.append(SelfTest(provider, True, "not tested"))
            continue
        r = run_self_test_isolated(provider, timeout_s)
        tests.append(SelfTest(provider, True, "passed" if r["passed"] else "failed",
                              tuple(r["ran_on"]), r["seconds"], r["max_abs_diff"], r["message"],
                              None if r["passed"] else
                              provider_fix(provider, True, libraries, jetson, major)))
    return DoctorReport(
        python=platform.python_version(), platform=f"{platform.system()} {platform.machine()}",
        onnxruntime=ort.__version__, onnxruntime_packages=packages, onnxruntime_cuda=ort_cuda,
        device=ort.get_device(), available_providers=available, gpus=tuple(gpus),
        gpu_note=note, libraries=libraries, jetson=jetson, self_tests=tuple(tests),
        requested=tuple(dict.fromkeys(requested)), warnings=tuple(warnings),
        huge_pages=hugepages.status())


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--self-test" and argv[1] in PROVIDERS:
        print(json.dumps(run_self_test(argv[1])))
        return 0
    print(json.dumps(diagnose(parse_providers(argv[0] if argv else None)).to_json(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
