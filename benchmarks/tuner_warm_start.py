"""The first batch at a new batch size: adaptive K from a cold tuner against one warm-started
from the nearest size's tuner (what `Pair` does), both against batched target-only on the same
prompts, interleaved in one process.

    python benchmarks/tuner_warm_start.py pairs/smollm2-135m-concat --max-new-tokens 32

A cold tuner drafts before it has measured anything, then spends a round at k = 0 to measure
plain decoding; over a short generation that is a large share of the rounds. Every batch here
is the first of its size for its tuner: the cold pair forgets all it learned before each, the
warm pair only what it learned at that size (so it starts from the nearest other size's).
Decode tokens/s, as `specedge bench --batch`.
"""

from __future__ import annotations

import argparse

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--batch", default="1,2,4,8", help="batch sizes, in the order run")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4, help="adaptive K's largest draft length")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    base = Pair.load(args.pair)
    if base.draft is None:
        raise SystemExit(f"{args.pair} has no draft model")
    # Two views of the same loaded models, each with its own tuners.
    cold = Pair(base.manifest, base.tokenizer, base.target, base.draft)
    warm = Pair(base.manifest, base.tokenizer, base.target, base.draft)
    prompts = default_prompts()
    plain = GenerationConfig(max_new_tokens=args.max_new_tokens, drafter="none", chat=True)
    adaptive = GenerationConfig(max_new_tokens=args.max_new_tokens, drafter="model",
                                num_draft_tokens=args.k, adaptive=True, chat=True)
    for pair in (base, cold, warm):  # warm-up (the tuners learn at B=2)
        pair.generate_batch(prompts[:2], adaptive)
    totals = {b: {"target-only": 0.0, "cold": 0.0, "warm": 0.0} for b in batches}
    for rep in range(args.repeats):
        for b in batches:
            rows = (prompts[rep * 3:] + prompts)[:b]
            totals[b]["target-only"] += base.generate_batch(rows, plain).stats.tokens_per_s
            cold.tuners.learned.clear()
            totals[b]["cold"] += cold.generate_batch(rows, adaptive).stats.tokens_per_s
            warm.tuners.learned.pop((b, "model", args.k), None)
            totals[b]["warm"] += warm.generate_batch(rows, adaptive).stats.tokens_per_s
    print(f"{args.pair}, {args.max_new_tokens} new tokens per row, {args.repeats} repeats, "
          f"adaptive K <= {args.k}, greedy, decode tok/s (mean of repeats)")
    print("| B | target-only tok/s | adaptive, cold tuner | adaptive, warm-started |")
    print("|---|---|---|---|")
    for b, t in totals.items():
        base_rate = t["target-only"]
        print(f"| {b} | {base_rate / args.repeats:.1f} | {t['cold'] / base_rate:.3f}x "
              f"| {t['warm'] / base_rate:.3f}x |")


if __name__ == "__main__":
    main()
