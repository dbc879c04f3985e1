"""What this machine has for ONNX Runtime's GPU providers, found without torch: NVIDIA GPUs
(`nvidia-smi`, else the driver library `libcuda` through ctypes), the CUDA, cuBLAS, cuDNN and
TensorRT libraries the providers load (loadable, only inside an `nvidia-*` pip package, or
missing, each with the line that installs it), and Jetson boards (`/etc/nv_tegra_release`, the
JetPack release, the onnxruntime-gpu wheel that matches it). The parsers are pure functions over
text, so tests feed them fake `nvidia-smi` output, release files and library lists.
`runtime/doctor` reports what they find. Tooling: the decoding core never imports it.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

GPU_WHEEL = 'pip uninstall -y onnxruntime && pip install "onnxruntime-gpu[cuda,cudnn]"'


JETSON_INDEX = {6: "https://pypi.jetson-ai-lab.io/jp6/cu126",
                7: "https://pypi.jetson-ai-lab.io/sbsa/cu130"}


# Jetson Linux (L4T) release -> JetPack release, for the versions NVIDIA has published.
L4T_TO_JETPACK = {"35.4.1": "5.1.2", "35.5.0": "5.1.3", "35.6.0": "5.1.4", "36.2.0": "6.0 DP",
                  "36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2", "36.4.4": "6.2.1",
                  "38.2.0": "7.0"}


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


def cuda_major(ort_cuda: str | None, jetson: JetsonInfo | None = None) -> int:
    """The CUDA major the providers need: the build's, else JetPack's, else PyPI's (13)."""
    try:
        return int(str(ort_cuda).split(".")[0])
    except ValueError:
        pass
    if jetson and jetson.jetpack and jetson.jetpack[0] in "56":
        return {"5": 11, "6": 12}[jetson.jetpack[0]]
    return 13  # onnxruntime-gpu on PyPI is built for CUDA 13
