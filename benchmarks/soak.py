"""Soak: thousands of generations through one loaded pair; RSS and per-token time over time.

Usage: python benchmarks/soak.py PAIR [--generations 3000] [--out docs/results/soak.md]
Mixed greedy/sampled requests with varying K and lengths, as an unattended device would see.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams

PROMPTS = ["Write a haiku about the sea.", "Explain how a hash table works.",
           "List three uses of a paperclip.", "What is the capital of France?"]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pair", type=Path)
    ap.add_argument("--generations", type=int, default=3000)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    pair = Pair.load(args.pair)
    rows = []
    tokens = seconds = 0.0
    start = time.time()
    for i in range(1, args.generations + 1):
        cfg = GenerationConfig(
            max_new_tokens=args.max_new_tokens - (i % 3) * 8, num_draft_tokens=1 + i % 4,
            adaptive=i % 5 == 0, chat=True,
            sampling=SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.95, seed=i))
        r = pair.generate(PROMPTS[i % len(PROMPTS)], cfg)
        tokens += r.stats.new_tokens
        seconds += r.stats.total_s
        if i % args.every == 0:
            rows.append((i, rss_mb(), 1000 * seconds / tokens))
            print(f"{i} generations: RSS {rows[-1][1]:.1f} MiB, {rows[-1][2]:.3f} ms/token",
                  flush=True)
            tokens = seconds = 0.0
    lines = [f"# Soak: {args.generations} generations through one loaded pair ({args.pair})",
             "", f"`python benchmarks/soak.py {args.pair} --generations {args.generations}`, "
             f"{(time.time() - start) / 60:.1f} min, mixed greedy/sampled, K 1-4, adaptive "
             "every 5th.", "", "| generations | RSS (MiB) | ms per token (last window) |",
             "|---|---|---|"]
    lines += [f"| {i} | {rss:.1f} | {ms:.3f} |" for i, rss, ms in rows]
    first, last = rows[0], rows[-1]
    lines += ["", f"RSS change from the first to the last window: {last[1] - first[1]:+.1f} MiB; "
              f"time per token: {first[2]:.3f} → {last[2]:.3f} ms."]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
