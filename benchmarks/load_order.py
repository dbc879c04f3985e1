"""The same model loaded twice in one process, decoding interleaved: does where its weights
landed change its speed? (docs/results/hugepages.md)

Usage: python benchmarks/load_order.py PAIR [--prompts 6] [--max-new-tokens 96]

For each of "4 KiB pages" and "huge pages" a fresh process loads PAIR's target twice (A, then B)
and runs target-only greedy generations A, B, A, B, ... on the benchmark prompts; it prints
decode tok/s of each copy and B / A. Same file, same sessions options, same thread pool: any
difference is where the weights sit in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import json, sys, time
from specedge.runtime.pair import GenerationConfig, Pair
pair_dir, huge, n, max_new = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
prompts = [json.loads(l)["prompt"] for l in open(sys.argv[5]) if l.strip()][:n]
a = Pair.load(pair_dir, huge_pages=huge, load_draft=False)
b = Pair.load(pair_dir, huge_pages=huge, load_draft=False)
cfg = GenerationConfig(max_new_tokens=max_new, drafter="none")
ids = [a.encode_prompt(p, chat=True) for p in prompts]
for p in (a, b):
    p.generate_ids(ids[0], cfg)
tot = {"A": [0, 0.0], "B": [0, 0.0]}
for prompt in ids:
    for name, p in (("A", a), ("B", b)):
        time.sleep(0.1)
        _, _, s = p.generate_ids(prompt, cfg)
        tot[name][0] += s.new_tokens
        tot[name][1] += s.decode_s
print(json.dumps({"pages": [a.huge_pages.describe(), b.huge_pages.describe()],
                  "A": tot["A"][0] / tot["A"][1], "B": tot["B"][0] / tot["B"][1]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    print(f"# load order, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
          f"{args.pair}, {args.prompts} prompts x {args.max_new_tokens} tokens, target-only")
    print("| weights | A (loaded first) tok/s | B (loaded second) tok/s | B / A |")
    print("|---|---|---|---|")
    for huge in (False, True):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(Path(args.pair).resolve()), "1" if huge else "0",
             str(args.prompts), str(args.max_new_tokens), str(HERE / "prompts.jsonl")],
            env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {r['pages'][0]} | {r['A']:.1f} | {r['B']:.1f} | "
              f"{r['B'] / r['A']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
