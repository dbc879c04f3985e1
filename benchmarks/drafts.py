"""Issue 5: which drafting makes the reference pair fastest, measured in one run.

Every setting (target-only and each drafter/K) runs on every benchmark prompt, interleaved
prompt by prompt, greedy, so machine drift hits all settings alike. Aggregate tok/s = all new
tokens / all decode seconds. Outputs are checked token for token against target-only (greedy
exactness). Writes a markdown table with per-category speed-ups and the measured costs.

    python benchmarks/drafts.py --out docs/results/drafts.md \\
        int4=pairs/smollm2-135m int8=pairs/smollm2-135m-int8draft
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import defaultdict
from pathlib import Path

from specedge.runtime.bench import measure_costs
from specedge.runtime.pair import GenerationConfig, Pair

SETTINGS = [  # (draft label, drafter, k, adaptive)
    ("int4", "model", 2, False), ("int4", "model", 3, False), ("int4", "model", 4, False),
    ("int4", "hybrid", 2, False), ("int4", "hybrid", 3, False),
    ("int8", "model", 3, False), ("int8", "model", 4, False), ("int8", "model", 5, False),
    ("int8", "hybrid", 3, False), ("int8", "hybrid", 4, False), ("int8", "hybrid", 5, False),
    ("int8", "model", 6, True), ("int8", "hybrid", 6, True),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pairs", nargs="+", help="LABEL=PAIR_FOLDER")
    ap.add_argument("--prompts", default="benchmarks/prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--out", default="docs/results/drafts.md")
    ap.add_argument("--only", default="", help="comma-separated setting names to keep "
                    "(target only is always run)")
    args = ap.parse_args()
    folders = dict(p.split("=", 1) for p in args.pairs)
    pairs = {label: Pair.load(folder, verify_hashes=False) for label, folder in folders.items()}
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line]
    if args.limit:
        rows = rows[:args.limit]
    base = next(iter(pairs.values()))
    settings = [("target only", label, "none", 0, False) for label in list(pairs)[:1]] + [
        (f"{label} {drafter} " + (f"adaptive (K<={k})" if adaptive else f"K={k}"), label,
         drafter, k, adaptive)
        for label, drafter, k, adaptive in SETTINGS if label in pairs]
    if args.only:
        keep = {name.strip() for name in args.only.split(",")}
        settings = [s for s in settings if s[0] == "target only" or s[0] in keep]
    sums: dict[str, dict[str, float]] = {s[0]: defaultdict(float) for s in settings}
    by_cat: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    mismatches: dict[str, int] = defaultdict(int)
    for _, label, drafter, k, _adaptive in settings:  # warm-up
        pairs[label].generate("Hello", GenerationConfig(max_new_tokens=8, chat=True,
                                                        drafter=drafter,
                                                        num_draft_tokens=k or None))
    start = time.time()
    for n, row in enumerate(rows):
        ids = base.encode_prompt(row["prompt"], chat=True)
        reference: list[int] | None = None
        for name, label, drafter, k, adaptive in settings:
            cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, drafter=drafter,
                                   num_draft_tokens=k or None, adaptive=adaptive)
            out, _, st = pairs[label].generate_ids(ids, cfg)
            if reference is None:
                reference = out
            elif out != reference:
                mismatches[name] += 1
            s = sums[name]
            s["tokens"] += st.new_tokens
            s["seconds"] += st.decode_s
            s["proposed"] += st.proposed
            s["accepted"] += st.accepted
            s["rounds"] += st.rounds
            cat = by_cat[(name, row.get("category", "all"))]
            cat[0] += st.new_tokens
            cat[1] += st.decode_s
        print(f"{n + 1}/{len(rows)} prompts, {time.time() - start:.0f} s", flush=True)
    costs = {label: measure_costs(p, reps=9) for label, p in pairs.items()}
    base_rate = sums["target only"]["tokens"] / sums["target only"]["seconds"]
    cats = sorted({c for _, c in by_cat})
    lines = [
        "# Drafting for the reference target (issue 5)", "",
        f"`python benchmarks/drafts.py {' '.join(args.pairs)} --max-new-tokens "
        f"{args.max_new_tokens}" + (f" --only '{args.only}'" if args.only else "") +
        f"` on {platform.processor() or platform.machine()}, "
        f"{len(rows)} prompts ({args.prompts}), greedy, chat template, every setting "
        "interleaved prompt by prompt in one process (shared ONNX Runtime thread pool, all "
        "cores, spinning: the tuned target-only setting). Speed-up = aggregate tok/s over "
        "target-only in the same run.", "",
        "| setting | tok/s | speed-up | " + " | ".join(cats) +
        " | acceptance | tokens/round | outputs differing from target-only |",
        "|---|---|---|" + "---|" * len(cats) + "---|---|---|"]
    for name, *_ in settings:
        s = sums[name]
        rate = s["tokens"] / s["seconds"]
        cat_cells = []
        for c in cats:
            t, sec = by_cat[(name, c)]
            bt, bsec = by_cat[("target only", c)]
            cat_cells.append(f"{(t / sec) / (bt / bsec):.2f}x" if sec and bsec else "–")
        acc = f"{s['accepted'] / s['proposed']:.2f}" if s["proposed"] else "–"
        tpr = f"{s['tokens'] / s['rounds']:.2f}" if s["rounds"] else "–"
        lines.append(f"| {name} | {rate:.1f} | {rate / base_rate:.2f}x | " +
                     " | ".join(cat_cells) + f" | {acc} | {tpr} | {mismatches[name]} |")
    lines += ["", "Measured costs after the run (`specedge.runtime.bench.measure_costs`, past of "
              "128 tokens):", ""]
    for label, c in costs.items():
        v1 = c.target[1]
        verify = ", ".join(f"verify({s})/verify(1) {c.target[s] / v1:.2f}" for s in (2, 4, 6))
        lines.append(f"- {label} pair ({folders[label]}): target step {1000 * v1:.2f} ms; "
                     f"draft step {1000 * (c.draft_step or 0):.2f} ms "
                     f"({(c.draft_step or 0) / v1:.2f} of the target); {verify}")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
