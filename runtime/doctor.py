"""`specedge doctor`: what this machine can run, found before any model is loaded (no torch).

It reports the onnxruntime build and the execution providers it has, the NVIDIA GPUs (from
`nvidia-smi`, else the driver library `libcuda` through ctypes), the CUDA, cuBLAS, cuDNN and
TensorRT libraries the providers load (found on the loader path, only inside an `nvidia-*` pip
package, or missing, each with the line that installs it), Jetson boards (`/etc/nv_tegra_release`,
the JetPack version, the onnxruntime-gpu wheel that matches it; all found by `runtime/machine`),
and a self-test of each provider: a tiny built-in graph (`data/selftest.onnx`, made by
`scripts/make_selftest_onnx.py`) run on the provider in a child process and compared with numpy.
This is tooling: the decoding core never imports it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import numpy as np

from . import hugepages
from .errors import InputError
from .machine import (
    GpuInfo,
    JetsonInfo,
    LibraryStatus,
    cuda_major,
    detect_jetson,
    gpus_from_libcuda,
    gpus_from_nvidia_smi,
    library_statuses,
    locate_library,
    nvidia_pip_lib_dirs,
    provider_fix,
)
from .providers import PROVIDERS, onnxruntime_too_old

SELFTEST_FILE = "data/selftest.onnx"
SELFTEST_TIMEOUT_S = {"cpu": 30.0, "cuda": 90.0, "tensorrt": 180.0}
SELFTEST_TOLERANCE = 1e-2  # fp32 graph; TF32 matmuls on a GPU stay well inside this


# ----------------------------------------------------------------------------- the report


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
    major = cuda_major(ort_cuda, jetson)
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
    too_old = onnxruntime_too_old(ort.__version__)
    if too_old:
        warnings.append(too_old)
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
