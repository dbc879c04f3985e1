"""The GPU check's `bench` phase (`benchmarks/gpu_check.py`): per pair, interleaved prompt by
prompt within each repetition, specedge target-only, the fixed K sweep, adaptive K and CUDA
graphs against ORT GenAI on the same ONNX files (target-only and speculative); host time per
round, per-call costs and the roofline."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import gpu_models
from gpu_plan import PairInfo, Plan, load_variant, pairs, prompt_ids, variants, wait_for, write_part

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; env measures the copy bandwidth too


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
