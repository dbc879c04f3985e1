"""specedge's fast pair against llama.cpp's own draft-model speculative decoding, on the same
weights, interleaved prompt by prompt.

    python benchmarks/llama_cpp_native.py pairs/smollm2-135m-fast --limit 22 \\
        --out docs/results/llama_cpp_native.md

llama.cpp: `llama-speculative-simple` (its `common/speculative` loop, what `llama-server -md`
runs; built by `bash benchmarks/anchors/setup_llama_cpp.sh --tools`) with the F32 GGUF (the
weights specedge's fp32 target holds, `benchmarks/anchors/make_ggufs.py`) as target and
llama.cpp's own Q8_0 of them as draft (specedge's self-draft is int8 weight-only), greedy, its
weights read into memory on huge pages (`--load-mode none` with glibc's hugetlb tunable, as
`run.py` gives llama.cpp), at its best (threads, K) from a pre-measurement on the first
prompts; and its target-only decoding of the same F32 file through llama-cpp-python at its best
thread count.
specedge: target-only, and the pair's own drafting (the fast pair: hybrid, adaptive K).

The same chat prompts (rendered by the pair's template; llama.cpp's program tokenizes that text
with its special tokens, the others take specedge's token ids). Tokens/s are end to end per
generation: new tokens / (prompt + decode seconds), each system timing its own generation
(model loading excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from anchors import llama_cpp as llama  # noqa: E402
from report import emit  # noqa: E402

from specedge.runtime import hugepages  # noqa: E402
from specedge.runtime.pair import GenerationConfig, Pair  # noqa: E402

PAUSE_S = 0.1  # lets the previous system's spinning threads sleep
HUGE = {"GLIBC_TUNABLES": f"{hugepages.TUNABLE}=1"}


def native(text: str, max_new: int, threads: int, k: int) -> tuple[int, float, float]:
    """llama.cpp's speculative program on one prompt: new tokens, e2e seconds, acceptance."""
    out = llama.cli_speculative(text, llama.GGUF_DIR / "smollm2-135m-instruct.f32.gguf",
                                max_new, threads=threads, k=k, env=HUGE,
                                extra=["--load-mode", "none"],
                                draft=llama.GGUF_DIR / "smollm2-135m-instruct.q8_0.gguf")
    accepted = out.get("n_accept", 0) / max(out.get("n_drafted", 0), 1)
    return out["decoded_tokens"], out["encoded_s"] + out["decoded_s"], accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", type=Path)
    ap.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts.jsonl")
    ap.add_argument("--limit", type=int, default=22)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", default="1,2", help="llama.cpp thread counts to pre-measure")
    ap.add_argument("--ks", default="2,4,6,8", help="llama.cpp draft lengths to pre-measure")
    ap.add_argument("--tune-prompts", type=int, default=3)
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds of rest after each run of llama.cpp's program")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if reason := llama.unavailable():
        raise SystemExit(reason)
    if not (llama.BIN_DIR / "llama-speculative-simple").is_file():
        raise SystemExit("run `bash benchmarks/anchors/setup_llama_cpp.sh --tools` first")
    started = time.time()
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines()
            if line.strip()][:args.limit]
    pair = Pair.load(args.pair)
    messages = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    texts = [pair.tokenizer.render_chat(m) for m in messages]
    ids = [pair.encode_prompt(m) for m in messages]
    new = args.max_new_tokens
    threads = [int(t) for t in args.threads.split(",")]
    ks = [int(k) for k in args.ks.split(",")]

    # llama.cpp's best settings, pre-measured (64 new tokens on the first prompts).
    grid = [(t, k) for t in threads for k in ks]
    rates: dict[tuple[int, int], list[float]] = {g: [0.0, 0.0] for g in grid}
    for text in texts[:args.tune_prompts]:
        for t, k in grid:
            time.sleep(PAUSE_S)
            n, seconds, _ = native(text, 64, t, k)
            rates[(t, k)][0] += n
            rates[(t, k)][1] += seconds
    best_t, best_k = max(grid, key=lambda g: rates[g][0] / rates[g][1])
    env = {**HUGE, "SPECEDGE_LLAMA_NO_MMAP": "1"}
    worker = llama.LlamaCppWorker(log=open(os.devnull, "w"), env=env)  # noqa: SIM115
    worker.load("f32", llama.GGUF_DIR / "smollm2-135m-instruct.f32.gguf",
                n_ctx=max(map(len, ids)) + new + 64)
    plain = {t: [0.0, 0.0] for t in threads}
    for prompt in ids[:args.tune_prompts]:
        for t in threads:
            time.sleep(PAUSE_S)
            run = worker.generate("f32", prompt, 64, threads=t)
            plain[t][0] += run.new_tokens
            plain[t][1] += run.e2e_seconds
    plain_t = max(threads, key=lambda t: plain[t][0] / plain[t][1])

    names = ["specedge target-only", "specedge, the pair's drafting",
             "llama.cpp F32 target-only", f"llama.cpp F32 + Q8_0 draft, K={best_k}"]
    sums: dict[str, list[float]] = {n: [0.0, 0.0] for n in names}
    accepted: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[list[int] | None]] = {n: [] for n in names}
    for i, (prompt, text) in enumerate(zip(ids, texts, strict=True)):
        for name in names if i % 2 == 0 else names[::-1]:
            time.sleep(PAUSE_S)
            tokens: list[int] | None = None
            if name.startswith("specedge"):
                config = GenerationConfig(max_new_tokens=new,
                                          drafter="none" if "target" in name else None)
                tokens, _, st = pair.generate_ids(prompt, config)
                n, seconds, acc = st.new_tokens, st.prefill_s + st.decode_s, st.acceptance_rate
            elif "target-only" in name:
                run = worker.generate("f32", prompt, new, threads=plain_t)
                tokens, n, seconds, acc = run.tokens, run.new_tokens, run.e2e_seconds, 0.0
            else:  # the program prints text, not ids: its tokens are not compared
                n, seconds, acc = native(text, new, best_t, best_k)
                time.sleep(args.settle)  # the kernel frees its huge pages after it exits
            sums[name][0] += n
            sums[name][1] += seconds
            accepted[name].append(acc)
            outputs[name].append(tokens)
    worker.close()
    same = {n: sum(a == b for a, b in zip(outputs[n], outputs[names[0]], strict=True))
            for n in names}
    rate = {n: sums[n][0] / sums[n][1] for n in names}
    base = rate[names[2]]
    lines = [
        "# specedge against llama.cpp's own speculative decoding", "",
        f"`python benchmarks/llama_cpp_native.py {args.pair} --limit {args.limit} "
        f"--max-new-tokens {new} --threads {args.threads} --ks {args.ks} --settle "
        f"{args.settle}` ({time.strftime('%Y-%m-%d %H:%M')}, 2-core CPU, "
        f"{(time.time() - started) / 60:.1f} min), {len(ids)} prompts of "
        f"{args.prompts.name}, chat template, greedy, interleaved prompt by prompt (order "
        "alternating).", "",
        f"llama.cpp pre-measured on {args.tune_prompts} prompts: speculative best at "
        f"{best_t} threads (target and draft), K={best_k} ("
        + ", ".join(f"{t} thr K={k}: {v[0] / v[1]:.1f}" for (t, k), v in rates.items())
        + f" tok/s); target-only best at {plain_t} threads.", "",
        "| system | tok/s e2e | × llama.cpp target-only | × llama.cpp speculative | "
        "acceptance (median) | = specedge target-only |",
        "|---|---|---|---|---|---|"]
    for name in names:
        acc = statistics.median(accepted[name])
        lines.append(f"| {name} | {rate[name]:.1f} | {rate[name] / base:.2f} | "
                     f"{rate[name] / rate[names[3]]:.2f} | "
                     f"{'–' if 'target-only' in name else f'{acc:.2f}'} | "
                     f"{'not compared' if outputs[name][0] is None else same[name]}"
                     f"{'' if outputs[name][0] is None else f'/{len(ids)}'} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
