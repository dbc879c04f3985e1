"""What every phase of the GPU check shares (`benchmarks/gpu_check.py`): the plan built from the
command line, the parts it writes, the pairs it measures and waits for, their prompts, and the
session variants (CUDA graphs, or fixed buffers on the CPU smoke) it loads them with."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))



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


def all_logits(pair: Any, seq: list[int]) -> Any:
    """The target's logits at every position of `seq` (one prefill), float32 `[len, vocab]`."""
    import numpy as np

    cache = pair.target.new_cache(1, len(seq) + 1)
    return np.asarray(pair.target.forward(cache, np.asarray([seq], dtype=np.int64))[0],
                      dtype=np.float32)


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
