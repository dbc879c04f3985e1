"""specedge against the systems users would pick instead, on the same files, in one run.

Usage: python benchmarks/run.py PAIR [--prompts benchmarks/prompts.jsonl] [--max-new-tokens 128]
                                [--hf-prompts 6] [--limit N] [--out docs/results/benchmarks.md]
                                [--llama-cpp [--llama-cpp-ggufs f32,q8_0,q4_0,q4_1]]

1. Greedy, every prompt of the set, the configurations interleaved prompt by prompt (so drift
   hits all alike): specedge target-only / K=2 / K=3 / adaptive (default thread plan); ONNX
   Runtime GenAI 0.18 target-only and speculative (its `model.draft` block) on the SAME ONNX files
   (they are its own model builder's output), at its best thread settings (target 2 threads,
   draft 1) and at its defaults.
2. Sampled (temperature 0.7, top-p 0.9): specedge target-only and K=2.
3. Hugging Face transformers `generate`, target-only and `assistant_model` (an int8 dynamic copy
   of the target), on the first --hf-prompts prompts, with specedge on the same prompts. torch is
   imported only in this phase, after everything else.
4. With --llama-cpp (off by default; needs .venv-bench from
   benchmarks/anchors/setup_llama_cpp.sh and the GGUFs of benchmarks/anchors/make_ggufs.py):
   llama.cpp through llama-cpp-python in a worker process (benchmarks/anchors/llama_cpp.py), on
   the SAME prompt token ids, for each GGUF precision (f32 = the weights specedge exports, and
   llama.cpp's own f16/Q8_0/Q4_0/Q4_1 of them): target-only at its best thread count and its
   prompt-lookup decoding at its best (threads, K), both picked by a short pre-measurement on the
   first prompts; interleaved prompt by prompt with the configurations of phase 1.
Every figure is end to end per generation (prefill + decode, new tokens / seconds); decode-only
figures are given for specedge and ORT GenAI too. Writes a markdown report and a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from anchors import llama_cpp as llama_anchor  # noqa: E402  (client side: no llama_cpp import)
from anchors import ort_genai  # noqa: E402

from specedge.runtime import hugepages  # noqa: E402
from specedge.runtime.pair import GenerationConfig, Pair  # noqa: E402
from specedge.runtime.sampling import SamplingParams  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load_prompts(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Tally:
    """Per-configuration sums."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.tokens: dict[str, list[list[int]]] = defaultdict(list)

    def add(self, name: str, new: int, prefill: float, decode: float, accepted: float = 0,
            proposed: float = 0, tokens: list[int] | None = None) -> None:
        d = self.data[name]
        d["new"] += new
        d["prefill"] += prefill
        d["decode"] += decode
        d["accepted"] += accepted
        d["proposed"] += proposed
        d["runs"] += 1
        if tokens is not None:
            self.tokens[name].append(tokens)

    def row(self, name: str) -> dict[str, float]:
        d = self.data[name]
        return {"e2e": d["new"] / (d["prefill"] + d["decode"]),
                "decode": d["new"] / d["decode"],
                "acceptance": d["accepted"] / d["proposed"] if d["proposed"] else float("nan"),
                "new_tokens": d["new"], "runs": d["runs"]}


PAUSE_S = 0.1  # lets the previous configuration's spinning threads go to sleep first


def ours_run(pair: Pair, tally: Tally, name: str, ids: list[int], cfg: GenerationConfig) -> None:
    time.sleep(PAUSE_S)
    out, _, st = pair.generate_ids(ids, cfg)
    tally.add(name, st.new_tokens, st.prefill_s, st.decode_s, st.accepted, st.proposed, out)


def genai_run(model: Any, config: dict[str, Any], tally: Tally, name: str, ids: list[int],
              max_new: int, k: int | None) -> None:
    time.sleep(PAUSE_S)
    r = ort_genai.run_one(model, config, ids, max_new, num_draft_tokens=k)
    tally.add(name, r.new_tokens, r.prefill_seconds, r.seconds, r.accepted or 0,
              r.proposed or 0, r.tokens)


def llama_run(worker: llama_anchor.LlamaCppWorker, tally: Tally, name: str, gguf: str,
              ids: list[int], max_new: int, **kw: Any) -> llama_anchor.LlamaRun:
    time.sleep(PAUSE_S)
    r = worker.generate(gguf, ids, max_new, **kw)
    tally.add(name, r.new_tokens, r.prefill_seconds, r.seconds, r.accepted or 0, r.proposed or 0,
              r.tokens)
    return r


def llama_measure(worker: llama_anchor.LlamaCppWorker, gguf: str, ids: list[list[int]],
                  max_new: int, grid: list[tuple[str, int, int | None]]
                  ) -> dict[tuple[str, int, int | None], float]:
    """End-to-end tok/s of each (mode, threads, K) of ``grid``, interleaved prompt by prompt."""
    sums = {g: [0.0, 0.0] for g in grid}
    for prompt_ids in ids:
        for mode, t, k in grid:
            time.sleep(PAUSE_S)
            r = worker.generate(gguf, prompt_ids, max_new, threads=t, mode=mode, k=k or 4)
            sums[(mode, t, k)][0] += r.new_tokens
            sums[(mode, t, k)][1] += r.e2e_seconds
    return {g: v[0] / v[1] for g, v in sums.items()}


def llama_setup(args: argparse.Namespace, ids: list[list[int]], max_new: int,
                log_path: Path) -> tuple[llama_anchor.LlamaCppWorker, list[tuple[str, str, dict]],
                                         dict[str, Any]]:
    """Start the llama.cpp worker, load the GGUFs, pick each GGUF's best settings.

    Pre-measurement (greedy, the first --llama-cpp-tune-prompts prompts, up to 32 new tokens,
    configurations interleaved prompt by prompt): target-only at each thread count of
    --llama-cpp-threads, then prompt lookup at the best of those thread counts for each K of
    --llama-cpp-ks; the best end-to-end tok/s of each is what phase 1 runs. Returns the worker,
    the phase-1 configurations (row name, GGUF name, generate kwargs) and the facts for the report.
    """
    ggufs = llama_anchor.parse_ggufs(args.llama_cpp_ggufs)
    threads = [int(t) for t in args.llama_cpp_threads.split(",")]
    ks = [int(k) for k in args.llama_cpp_ks.split(",")]
    n_ctx = max(len(p) for p in ids) + max_new + max(ks + [args.llama_cpp_draft_k]) + 64
    env = ({"GLIBC_TUNABLES": f"{hugepages.TUNABLE}=1", "SPECEDGE_LLAMA_NO_MMAP": "1"}
           if args.llama_cpp_pages == "huge" else {})
    worker = llama_anchor.LlamaCppWorker(log=log_path.open("w"), env=env)
    facts: dict[str, Any] = {"info": worker.info, "ggufs": {}, "tuning": {}, "chosen": {},
                             "pages": args.llama_cpp_pages}
    for name, path in ggufs.items():
        facts["ggufs"][name] = worker.load(name, path, n_ctx=n_ctx)
    if args.llama_cpp_draft:
        facts["ggufs"][args.llama_cpp_draft] = worker.load(
            args.llama_cpp_draft, llama_anchor.parse_ggufs(args.llama_cpp_draft)[
                args.llama_cpp_draft], n_ctx=n_ctx)
    tune_ids = ids[: args.llama_cpp_tune_prompts]
    tune_new = min(max_new, 32)
    configs: list[tuple[str, str, dict]] = []
    for name in ggufs:
        worker.generate(name, tune_ids[0], 8, threads=threads[-1])  # warm-up
        worker.generate(name, tune_ids[0], 8, threads=threads[-1], mode="pld", k=ks[0])
        rates = llama_measure(worker, name, tune_ids, tune_new,
                              [("target", t, None) for t in threads])
        best_t = max(rates, key=lambda g: rates[g])
        rates.update(llama_measure(worker, name, tune_ids, tune_new,
                                   [("pld", best_t[1], k) for k in ks]))
        best_p = max((g for g in rates if g[0] == "pld"), key=lambda g: rates[g])
        facts["tuning"][name] = {f"{m} threads={t}" + (f" K={k}" if k else ""): round(rate, 1)
                                 for (m, t, k), rate in rates.items()}
        facts["chosen"][name] = {"target_threads": best_t[1], "pld_threads": best_p[1],
                                 "pld_k": best_p[2]}
        print(f"llama.cpp {name}: target-only best at {best_t[1]} threads "
              f"({rates[best_t]:.1f} tok/s), prompt lookup best at K={best_p[2]}, "
              f"{best_p[1]} threads ({rates[best_p]:.1f} tok/s)", flush=True)
        configs.append((f"llama.cpp {name} target-only, {best_t[1]} thr", name,
                        {"threads": best_t[1], "mode": "target"}))
        configs.append((f"llama.cpp {name} prompt lookup K={best_p[2]}, {best_p[1]} thr", name,
                        {"threads": best_p[1], "mode": "pld", "k": best_p[2]}))
        if args.llama_cpp_draft and name != args.llama_cpp_draft:
            configs.append((f"llama.cpp {name} draft {args.llama_cpp_draft} "
                            f"K={args.llama_cpp_draft_k} (hook), {best_t[1]} thr", name,
                            {"threads": best_t[1], "mode": "draft", "k": args.llama_cpp_draft_k,
                             "draft": args.llama_cpp_draft}))
    return worker, configs, facts


def runtime_process_facts(pair_dir: Path) -> dict[str, Any]:
    """Import time, peak RSS and torch's absence for the runtime alone, in a fresh process."""
    code = (
        "import time,sys,resource; t=time.perf_counter();"
        "from specedge.runtime.pair import Pair, GenerationConfig; imp=time.perf_counter()-t;"
        f"p=Pair.load({str(pair_dir)!r});"
        "r=p.generate('Explain how a hash table works.', GenerationConfig(max_new_tokens=64,"
        " chat=True));"
        "print(imp, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024,"
        " 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    return {"import_s": float(out[0]), "peak_rss_mb": float(out[1]),
            "torch_loaded": out[2] == "True", "transformers_loaded": out[3] == "True"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pair", type=Path)
    ap.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--hf-prompts", type=int, default=6)
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "benchmarks.md")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="add llama.cpp (llama-cpp-python in .venv-bench, GGUFs in .cache/gguf)")
    ap.add_argument("--llama-cpp-ggufs", default="f32,q8_0,q4_0,q4_1",
                    help="GGUF names from make_ggufs.py, or name=path, comma-separated")
    ap.add_argument("--llama-cpp-pages", choices=("huge", "mmap"), default="huge",
                    help="huge: llama.cpp reads its weights into memory on huge pages (--no-mmap "
                         "with glibc's hugetlb tunable; faster here); mmap: its default")
    ap.add_argument("--llama-cpp-threads", default="1,2", help="thread counts to pre-measure")
    ap.add_argument("--llama-cpp-ks", default="2,3,4,5,6", help="prompt-lookup K to pre-measure")
    ap.add_argument("--llama-cpp-tune-prompts", type=int, default=3)
    ap.add_argument("--llama-cpp-draft", default="",
                    help="GGUF name to draft for the others through the binding's draft_model "
                         "hook (Python-side draft-model drafting; off by default)")
    ap.add_argument("--llama-cpp-draft-k", type=int, default=3)
    ap.add_argument("--genai-first", action="store_true",
                    help="load ORT GenAI's models before specedge's (load order matters on VMs)")
    ap.add_argument("--genai-ks", type=lambda v: [int(k) for k in v.split(",")], default=None,
                    help="ORT GenAI's speculative K values at its best threads (default 2,3; "
                         "--lean: 3); the huge-pages row uses the last")
    ap.add_argument("--lean", action="store_true",
                    help="only the configurations the bars compare: specedge target-only and "
                         "adaptive, ORT GenAI target-only and K=3 at its best threads; no sampled "
                         "phase and no transformers (about a third of the time)")
    args = ap.parse_args()
    if args.llama_cpp and (reason := llama_anchor.unavailable()):
        raise SystemExit(f"--llama-cpp: {reason}")
    started = time.time()
    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = prompts[: args.limit]
    facts = runtime_process_facts(args.pair)
    # This process did not start with glibc's huge-page tunable, so Pair.load moves the memory
    # of its own load onto huge pages (its default) and every other system keeps 4 KiB pages
    # unless loaded under HugePageLoad too: each appears both ways below.
    tmp = Path(tempfile.mkdtemp(prefix="specedge-bench-"))
    manifest = json.loads((Path(args.pair) / "specedge.json").read_text())
    has_draft = bool(manifest["models"].get("draft"))
    facts["pair"] = {name: m["precision"] for name, m in manifest["models"].items() if m}
    folders = {
        "genai_target_best": ort_genai.make_genai_folder(args.pair, tmp / "t2", draft=False,
                                                         target_threads=2, draft_threads=None),
    }
    if has_draft:  # ORT GenAI speculates only with a draft model
        folders["genai_spec_best"] = ort_genai.make_genai_folder(
            args.pair, tmp / "s21", draft=True, target_threads=2, draft_threads=1)
    if not args.lean:
        folders["genai_target_default"] = ort_genai.make_genai_folder(
            args.pair, tmp / "td", draft=False, target_threads=None, draft_threads=None)
        folders["genai_spec_default"] = ort_genai.make_genai_folder(
            args.pair, tmp / "sd", draft=True, target_threads=None, draft_threads=None)
    genai: dict[str, Any] = {}

    def load_genai() -> None:
        genai.update({k: ort_genai.load(v) for k, v in folders.items()})
        for key in [k for k in ("genai_target_best", "genai_spec_best") if k in folders]:
            with hugepages.HugePageLoad(True):
                genai[key + "_huge"] = ort_genai.load(folders[key])

    # Which system loads first matters on this VM (the first ~GB a process touches decodes
    # slower, docs/results/hugepages.md); specedge loads first unless --genai-first.
    if args.genai_first:
        load_genai()
    pair = Pair.load(args.pair)
    facts["huge_pages"] = pair.huge_pages.describe()
    facts["load_order"] = "ORT GenAI first" if args.genai_first else "specedge first"
    small_pages = Pair.load(args.pair, huge_pages=False, load_draft=False)
    facts["target_steps"] = pair.target.steps_note()
    # A target whose one-row calls compute differently decodes with two-row steps (exact);
    # its one-row target-only (faster, not what speculation reproduces) is measured beside it.
    one_row = (Pair.load(args.pair, two_row_steps=False, load_draft=False)
               if pair.target.two_row_steps else None)
    # A target whose head is split off takes greedy argmaxes from the int8 shortlist
    # (runtime/shortlist.py); the whole graph's target-only is measured beside it.
    whole = (Pair.load(args.pair, split_head=False, load_draft=False)
             if pair.target.split is not None else None)
    facts["split_head"] = pair.target.split is not None
    ids = [pair.encode_prompt(p["prompt"], chat=True) for p in prompts]
    max_new = args.max_new_tokens
    rss: dict[str, float] = {"before": rss_mb()}
    if not args.genai_first:
        load_genai()
    rss["after_load"] = rss_mb()
    llama_worker = None
    llama_cfgs: list[tuple[str, str, dict]] = []
    llama_facts: dict[str, Any] = {}
    if args.llama_cpp:
        llama_worker, llama_cfgs, llama_facts = llama_setup(args, ids, max_new,
                                                            tmp / "llama_cpp_worker.log")
    greedy = SamplingParams()
    ours_cfgs = {
        "specedge target-only": GenerationConfig(max_new_tokens=max_new, drafter="none"),
        "specedge K=2": GenerationConfig(max_new_tokens=max_new, num_draft_tokens=2,
                                         adaptive=False),
        "specedge K=3": GenerationConfig(max_new_tokens=max_new, num_draft_tokens=3,
                                         adaptive=False),
        "specedge adaptive (K≤6)": GenerationConfig(max_new_tokens=max_new, num_draft_tokens=6,
                                                   adaptive=True),
    }
    genai_ks = args.genai_ks or ([3] if args.lean else [2, 3])
    genai_cfgs = [("ORT GenAI target-only, 2 threads", "genai_target_best", None)]
    genai_cfgs += [(f"ORT GenAI K={k}, target 2 / draft 1 threads", "genai_spec_best", k)
                   for k in genai_ks]
    if not args.lean:
        genai_cfgs += [("ORT GenAI target-only, default threads", "genai_target_default", None),
                       ("ORT GenAI K=2, default threads", "genai_spec_default", 2)]
    genai_cfgs += [("ORT GenAI target-only, 2 threads, huge pages", "genai_target_best_huge", None),
                   (f"ORT GenAI K={genai_ks[-1]}, target 2 / draft 1 threads, huge pages",
                    "genai_spec_best_huge", genai_ks[-1])]
    if args.lean:
        for name in ("specedge K=2", "specedge K=3"):
            del ours_cfgs[name]
    genai_cfgs = [c for c in genai_cfgs if c[1].removesuffix("_huge") in folders]
    tally = Tally()
    # Warm-up: one generation per configuration.
    for cfg in ours_cfgs.values():
        pair.generate_ids(ids[0], cfg)
    small_pages.generate_ids(ids[0], ours_cfgs["specedge target-only"])
    if one_row is not None:
        one_row.generate_ids(ids[0], ours_cfgs["specedge target-only"])
    if whole is not None:
        whole.generate_ids(ids[0], ours_cfgs["specedge target-only"])
    for _, key, k in genai_cfgs:
        ort_genai.run_one(*genai[key], ids[0], 16, num_draft_tokens=k)
    # Phase 1: greedy, interleaved prompt by prompt.
    for n, prompt_ids in enumerate(ids):
        for name, cfg in ours_cfgs.items():
            ours_run(pair, tally, name, prompt_ids, cfg)
        ours_run(small_pages, tally, "specedge target-only, 4 KiB pages", prompt_ids,
                 ours_cfgs["specedge target-only"])
        if one_row is not None:
            ours_run(one_row, tally, ONE_ROW, prompt_ids, ours_cfgs["specedge target-only"])
        if whole is not None:
            ours_run(whole, tally, WHOLE, prompt_ids, ours_cfgs["specedge target-only"])
        for name, key, k in genai_cfgs:
            genai_run(*genai[key], tally, name, prompt_ids, max_new, k)
        if llama_worker is not None:
            for name, gguf, kw in llama_cfgs:
                llama_run(llama_worker, tally, name, gguf, prompt_ids, max_new, **kw)
        print(f"greedy {n + 1}/{len(ids)} done ({time.time() - started:.0f} s)", flush=True)
    # Phase 2: sampled, specedge only.
    sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    for prompt_ids in ([] if args.lean else ids):
        ours_run(pair, tally, "specedge sampled target-only", prompt_ids,
                 GenerationConfig(max_new_tokens=max_new, drafter="none", sampling=sampled))
        ours_run(pair, tally, "specedge sampled K=2", prompt_ids,
                 GenerationConfig(max_new_tokens=max_new, num_draft_tokens=2, adaptive=False,
                                  sampling=sampled))
    print(f"sampled done ({time.time() - started:.0f} s)", flush=True)
    # Exactness across systems (greedy): identical token streams?
    base = tally.tokens["specedge target-only"]
    agree = {name: sum(a == b for a, b in zip(tally.tokens[name], base, strict=True))
             for name in [*ours_cfgs, "specedge target-only, 4 KiB pages"]
             + ([ONE_ROW] if one_row is not None else [])
             + ([WHOLE] if whole is not None else [])
             + [c[0] for c in genai_cfgs] + [c[0] for c in llama_cfgs]}
    if llama_worker is not None:
        llama_worker.close()
        llama_facts["configs"] = {name: {"gguf": gguf, **kw} for name, gguf, kw in llama_cfgs}
    genai.clear()
    # Phase 3: transformers (imports torch), on a subset, with specedge on the same prompts.
    hf_rows: dict[str, dict[str, float]] = {}
    hf_note = ""
    if args.hf_prompts and not args.lean:
        from anchors import hf_transformers as hf

        sub = ids[: args.hf_prompts]
        runner = hf.HFRunner(hf.reference_hf_folder(tmp / "hf"), threads=2)
        hf_note = runner.assistant_note or f"assistant: {runner.assistant_kind}"
        runner.warmup()
        hf_tally = Tally()
        for prompt_ids in sub:
            ours_run(pair, hf_tally, "specedge target-only", prompt_ids,
                     ours_cfgs["specedge target-only"])
            ours_run(pair, hf_tally, "specedge K=2", prompt_ids, ours_cfgs["specedge K=2"])
            for assisted in (False, True):
                (r,) = runner.run([prompt_ids], max_new, assisted=assisted,
                                  num_assistant_tokens=None)
                name = "transformers assisted (int8 assistant)" if assisted else \
                    "transformers target-only"
                hf_tally.add(name, r.new_tokens, 0.0, r.seconds)
        hf_rows = {name: hf_tally.row(name) for name in hf_tally.data}
        rss["after_transformers"] = rss_mb()
    write_report(args, prompts, tally, agree, hf_rows, hf_note, facts, rss,
                 time.time() - started, greedy, llama_facts)


PRECISION = {"f32": "fp32", "f16": "fp16", "q8_0": "int8", "q4_0": "int4", "q4_1": "int4",
             "q4_1-orig": "int4"}


def llama_report(llama: dict[str, Any], rows: dict[str, dict[str, float]], ours_t: float,
                 ours_best: float, best_ours: str, ours_precision: str) -> list[str]:
    """Bullets for the bar section: llama.cpp per GGUF precision against specedge's pair."""
    info = llama["info"]
    out = [
        f"- llama.cpp: llama-cpp-python {info['llama_cpp_python']} built from source "
        f"(.venv-bench), system info `{info['system_info'].strip()}`. Same prompt token ids; "
        "thread count and prompt-lookup K picked per GGUF by a pre-measurement on the first "
        "prompts (table at the end). Weights: "
        + ("read into memory on huge pages (`use_mmap=False` with glibc's hugetlb tunable: "
           "faster than its default mmap here, docs/results/hugepages.md)"
           if llama.get("pages") == "huge" else "llama.cpp's default mmap of the file") + ".",
    ]
    for gguf, chosen in llama["chosen"].items():
        target = next(n for n in rows if n.startswith(f"llama.cpp {gguf} target-only"))
        pld = next(n for n in rows if n.startswith(f"llama.cpp {gguf} prompt lookup"))
        best = max((n for n in rows if n.startswith(f"llama.cpp {gguf} ")),
                   key=lambda n: rows[n]["e2e"])
        desc = llama["ggufs"][gguf]["desc"]
        mem = llama["ggufs"][gguf].get("memory", {})
        prec = PRECISION.get(gguf, gguf)
        line = (f"- llama.cpp {gguf} ({desc}, weights {prec}): target-only "
                f"{rows[target]['e2e']:.1f} tok/s ({chosen['target_threads']} thr), prompt lookup "
                f"{rows[pld]['e2e']:.1f} (K={chosen['pld_k']}, {chosen['pld_threads']} thr, "
                f"acceptance {rows[pld]['acceptance']:.2f}); best {rows[best]['e2e']:.1f}; "
                f"process memory on huge pages after loading it: "
                f"{mem.get('AnonHugePages', 0) // 1024} MiB anonymous + "
                f"{mem.get('FilePmdMapped', 0) // 1024} MiB file of "
                f"{mem.get('Rss', 0) // 1024} MiB. ")
        if prec == ours_precision:
            line += (f"Equal precision (specedge {prec} target): target-only "
                     f"**{ours_t / rows[target]['e2e']:.2f}×**, specedge best ({best_ours}) ÷ "
                     f"llama.cpp best **{ours_best / rows[best]['e2e']:.2f}×**.")
        else:
            line += (f"specedge's {ours_precision}-target best ÷ this: "
                     f"{ours_best / rows[best]['e2e']:.2f}× "
                     f"(not equal precision: this run has no specedge {prec} target).")
        out.append(line)
    return out


def llama_tuning_table(llama: dict[str, Any], tune_prompts: int) -> list[str]:
    ggufs = list(llama["tuning"])
    grid = list(dict.fromkeys(g for n in ggufs for g in llama["tuning"][n]))
    lines = ["", f"## llama.cpp pre-measurement (tok/s e2e, first {tune_prompts} prompts, "
             "up to 32 new tokens, configurations interleaved)", "",
             "| configuration | " + " | ".join(ggufs) + " |", "|---|" + "---|" * len(ggufs)]
    for g in grid:
        cells = [f"{llama['tuning'][n][g]:.1f}" if g in llama["tuning"][n] else "–"
                 for n in ggufs]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return lines


ONE_ROW = "specedge target-only, one-row steps (inexact)"
WHOLE = "specedge target-only, whole graph (head not split)"


def write_report(args: argparse.Namespace, prompts: list[dict[str, str]], tally: Tally,
                 agree: dict[str, int], hf_rows: dict[str, dict[str, float]], hf_note: str,
                 facts: dict[str, Any], rss: dict[str, float], seconds: float,
                 _greedy: SamplingParams, llama: dict[str, Any] | None = None) -> None:
    rows = {name: tally.row(name) for name in tally.data}
    genai_t = rows["ORT GenAI target-only, 2 threads"]["e2e"]
    genai_huge = rows["ORT GenAI target-only, 2 threads, huge pages"]["e2e"]
    ours_small = rows["specedge target-only, 4 KiB pages"]["e2e"]
    ours_t = rows["specedge target-only"]["e2e"]
    cats: dict[str, int] = defaultdict(int)
    for p in prompts:
        cats[p.get("category", "?")] += 1
    command = (f"python benchmarks/run.py {args.pair} --max-new-tokens {args.max_new_tokens} "
               f"--hf-prompts {args.hf_prompts}" + (f" --limit {args.limit}" if args.limit else "")
               + (" --lean" if args.lean else "") + (" --genai-first" if args.genai_first else "")
               + (f" --genai-ks {','.join(map(str, args.genai_ks))}" if args.genai_ks else ""))
    if llama:
        command += (f" --llama-cpp --llama-cpp-ggufs {args.llama_cpp_ggufs}"
                    f" --llama-cpp-pages {args.llama_cpp_pages}")
        if args.llama_cpp_draft:
            command += (f" --llama-cpp-draft {args.llama_cpp_draft} --llama-cpp-draft-k "
                        f"{args.llama_cpp_draft_k}")
    lines = [
        "# specedge vs ONNX Runtime GenAI vs transformers" + (" vs llama.cpp" if llama else ""),
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {seconds / 60:.1f} min, "
        f"`{command}`.",
        f"Machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"Python {platform.python_version()}, Linux {platform.release()}.",
        f"Pair: {args.pair} (SmolLM2-135M-Instruct, "
        + ", ".join(f"{name} {prec}" for name, prec in facts["pair"].items())
        + "; ONNX files from ORT GenAI's own model builder, a quantized model being the "
        "builder's graph through onnxruntime's quantizer, so ORT GenAI runs exactly these "
        "files).",
        f"Prompts: {len(prompts)} from {args.prompts.name} ("
        + ", ".join(f"{c} {n}" for c, n in cats.items())
        + f"), chat template, up to {args.max_new_tokens} new tokens, batch 1.",
        "Tokens/s are end to end per generation (prefill + decode); decode-only next to them. "
        "Configurations are interleaved prompt by prompt, with a 0.1 s pause before each "
        "generation so that the previous configuration's spinning ONNX Runtime threads are "
        "asleep (all systems share one process and two cores).",
        "",
        "## Greedy",
        "",
        "| configuration | tok/s e2e | tok/s decode | × own target-only | × ORT GenAI target-only "
        "(2 thr) | acceptance | identical to specedge target-only |",
        "|---|---|---|---|---|---|---|",
    ]
    own = {"specedge": ours_t, "ORT GenAI": genai_t,
           "ORT GenAI default": rows.get("ORT GenAI target-only, default threads",
                                         {"e2e": float("nan")})["e2e"]}
    for name in list(agree):
        r = rows[name]
        base = own["specedge"] if name.startswith("specedge") else (
            own["ORT GenAI default"] if "default" in name else
            genai_huge if "huge pages" in name else own["ORT GenAI"])
        if name.startswith("llama.cpp "):  # own base: target-only of the same GGUF
            gguf = name.split()[1]
            base = next(rows[n]["e2e"] for n in rows
                        if n.startswith(f"llama.cpp {gguf} target-only"))
        acc = "–" if r["acceptance"] != r["acceptance"] else f"{r['acceptance']:.2f}"
        lines.append(f"| {name} | {r['e2e']:.1f} | {r['decode']:.1f} | {r['e2e'] / base:.2f} | "
                     f"{r['e2e'] / genai_t:.2f} | {acc} | {agree[name]}/{len(prompts)} |")
    best_ours = max((n for n in rows if n.startswith("specedge K") or "adaptive" in n),
                    key=lambda n: rows[n]["e2e"])
    # specedge's best exact greedy configuration, target-only included (what llama.cpp meets).
    best_exact = max((n for n in agree if n.startswith("specedge") and "4 KiB" not in n
                      and n not in (ONE_ROW, WHOLE)), key=lambda n: rows[n]["e2e"])
    genai_k = [n for n in rows if n.startswith("ORT GenAI K") and "default" not in n]
    best_genai = max((n for n in genai_k if "huge pages" not in n),
                     key=lambda n: rows[n]["e2e"], default=None)
    best_genai_huge = max((n for n in genai_k if "huge pages" in n),
                          key=lambda n: rows[n]["e2e"], default=None)
    lines += [
        "",
        "## The bar",
        "",
        f"- Load order: {facts['load_order']}. Weights: specedge ({facts['huge_pages']}); "
        "ORT GenAI and the '4 KiB pages' row as they load by themselves; the 'huge pages' "
        "rows of ORT GenAI had their load's memory "
        "moved onto huge pages by specedge's helper (runtime/hugepages.py), which ORT GenAI "
        "does not do.",
        f"- specedge target: {facts['target_steps']}."
        + (f" One-row target-only (faster, but not the computation speculation reproduces): "
           f"{rows[ONE_ROW]['e2e']:.1f} tok/s; the exact rows' "
           f"{ours_t:.1f} is {ours_t / rows[ONE_ROW]['e2e']:.2f}× it." if ONE_ROW in rows
           else "")
        + (f" Greedy argmaxes from the split head's int8 shortlist (runtime/shortlist.py); the "
           f"whole graph's target-only: {rows[WHOLE]['e2e']:.1f} tok/s, so the split head "
           f"gives {ours_t / rows[WHOLE]['e2e']:.2f}×." if WHOLE in rows else ""),
        f"- Target-only: specedge {ours_t:.1f} vs ORT GenAI {genai_t:.1f} tok/s: "
        f"**{ours_t / genai_t:.2f}×** (bar ≥ 1.03×); against ORT GenAI given the same huge "
        f"pages ({genai_huge:.1f}): **{ours_t / genai_huge:.2f}×**; specedge on 4 KiB pages "
        f"{ours_small:.1f}: {ours_small / genai_t:.2f}× ORT GenAI, and huge pages give specedge "
        f"{ours_t / ours_small:.2f}×.",
    ]
    if best_genai and best_genai_huge:
        lines.append(
            f"- Speculative, best of each: {best_ours} {rows[best_ours]['e2e']:.1f} vs "
            f"{best_genai} {rows[best_genai]['e2e']:.1f} tok/s: "
            f"**{rows[best_ours]['e2e'] / rows[best_genai]['e2e']:.2f}×** (bar ≥ 1.05×); vs "
            f"{best_genai_huge} {rows[best_genai_huge]['e2e']:.1f}: "
            f"**{rows[best_ours]['e2e'] / rows[best_genai_huge]['e2e']:.2f}×**.")
    else:
        lines.append(f"- Speculative: {best_ours} {rows[best_ours]['e2e']:.1f} tok/s; "
                     "ORT GenAI cannot speculate without a draft model (this pair has none).")
    if hf_rows:
        hf_a = hf_rows["transformers assisted (int8 assistant)"]["e2e"]
        lines += [
            f"- transformers, on the first {args.hf_prompts} prompts ({hf_note}): target-only "
            f"{hf_rows['transformers target-only']['e2e']:.1f}, assisted {hf_a:.1f} tok/s; "
            f"specedge K=2 on the same prompts {hf_rows['specedge K=2']['e2e']:.1f} "
            f"(**{hf_rows['specedge K=2']['e2e'] / hf_a:.1f}×** assisted; bar ≥ 3×), "
            f"specedge target-only {hf_rows['specedge target-only']['e2e']:.1f}.",
        ]
    if llama:
        lines += llama_report(llama, rows, ours_t, rows[best_exact]["e2e"], best_exact,
                              facts["pair"]["target"])
    lines += [
        f"- Runtime process alone (fresh process: import, load, one 64-token generation): import "
        f"{facts['import_s']:.2f} s, peak RSS {facts['peak_rss_mb']:.0f} MiB, torch loaded: "
        f"{facts['torch_loaded']}, transformers loaded: {facts['transformers_loaded']}.",
        f"- RSS of this benchmark process: {rss['before']:.0f} MiB with the specedge pair loaded, "
        f"{rss['after_load']:.0f} MiB after loading the ORT GenAI configurations"
        + (f", {rss['after_transformers']:.0f} MiB after transformers"
           if "after_transformers" in rss else "") + ".",
        "",
        "## Sampled (temperature 0.7, top-p 0.9, seeded)",
        "",
    ]
    sampled = [name for name in ("specedge sampled target-only", "specedge sampled K=2")
               if name in rows]
    if not sampled:
        lines.append("Not run (`--lean`); `docs/results/bench_sampled.txt` has sampled figures.")
    else:
        lines += ["| configuration | tok/s e2e | tok/s decode | acceptance |", "|---|---|---|---|"]
    for name in sampled:
        r = rows[name]
        acc = "–" if r["acceptance"] != r["acceptance"] else f"{r['acceptance']:.2f}"
        lines.append(f"| {name} | {r['e2e']:.1f} | {r['decode']:.1f} | {acc} |")
    if llama:
        lines += llama_tuning_table(llama, args.llama_cpp_tune_prompts)
    speedups = [rows[n]["e2e"] for n in rows]
    del speedups
    args.out.parent.mkdir(parents=True, exist_ok=True)
    notes = Path(str(args.out) + ".notes")
    if notes.is_file():  # analysis written by hand, kept next to the generated tables
        lines += ["", notes.read_text().strip()]
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(
        {"rows": rows, "agree": agree, "hf": hf_rows, "facts": facts, "rss": rss,
         "llama_cpp": llama or None,
         "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
         "median_prompt_tokens": statistics.median(len(p["prompt"]) for p in prompts)},
        indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
