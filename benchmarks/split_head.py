"""The split head (runtime/shortlist.py) on a real pair: speed, candidates and bound tightness.

Usage: python benchmarks/split_head.py PAIR [--prompts N] [--max-new-tokens M] [--out FILE.md]

Loads the pair's target twice (split head, and `split_head=False`: the whole graph), decodes
greedy target-only on the first N prompts of benchmarks/prompts.jsonl (chat template),
interleaved prompt by prompt, and reports: tokens/s of each and their ratio, whether every
output is identical, and over every decode step's hidden state: how many candidates the int8
shortlist kept, and the largest |exact - approx| / bound (how much room the bound leaves).
Time nothing else on the machine while it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specedge.runtime.pair import GenerationConfig, Pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pair", type=Path)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in
               (ROOT / "benchmarks" / "prompts.jsonl").read_text().splitlines()][:args.prompts]
    split = Pair.load(args.pair, load_draft=False)
    head = split.target.split
    if head is None:
        sys.exit(f"{args.pair}: the target's head is not split (run `specedge split-head`)")
    whole = Pair.load(args.pair, load_draft=False, split_head=False)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, drafter="none")
    ids = [split.encode_prompt(p, chat=True) for p in prompts]
    split.generate_ids(ids[0], config)
    whole.generate_ids(ids[0], config)
    hidden: list[np.ndarray] = []
    argmax = head.argmax
    seconds = {"split": 0.0, "whole": 0.0}
    tokens = {"split": 0, "whole": 0}
    same = 0
    for prompt in ids:
        outs = {}
        for name, pair in (("whole", whole), ("split", split)):
            time.sleep(0.1)  # the other session's spinning threads go to sleep
            start = time.perf_counter()
            outs[name] = pair.generate_ids(prompt, config)[0]
            seconds[name] += time.perf_counter() - start
            tokens[name] += len(outs[name])
        same += outs["split"] == outs["whole"]
    # The hidden states of every step, collected in a separate untimed pass.
    head.argmax = lambda h: (hidden.append(np.array(h)), argmax(h))[1]  # type: ignore[method-assign]
    for prompt in ids:
        split.generate_ids(prompt, config)
    head.argmax = argmax  # type: ignore[method-assign]
    states = np.concatenate(hidden)
    counts, worst = [], 0.0
    for chunk in np.array_split(states, max(1, len(states) // 64)):
        cand, approx, b_hidden, b_input = head.shortlist.run(
            ["candidates", "approx", "b_hidden", "b_input"], {"hidden": chunk})
        counts.append(np.bincount(cand[0], minlength=len(chunk)))
        exact = head.logits(chunk[:, None, :])[:, 0].astype(np.float64)
        worst = max(worst, float((np.abs(exact - approx) / (b_hidden + b_input)).max()))
    count = np.concatenate(counts)
    rate = {k: tokens[k] / seconds[k] for k in seconds}
    lines = [
        "# The split head: int8 shortlist + exact candidates vs the whole graph",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `python "
        f"benchmarks/split_head.py {args.pair} --prompts {args.prompts} --max-new-tokens "
        f"{args.max_new_tokens}`, greedy target-only, chat template, interleaved prompt by "
        "prompt, one process.",
        "",
        "| configuration | tok/s e2e | tokens |",
        "|---|---|---|",
        f"| whole graph (`split_head=False`) | {rate['whole']:.1f} | {tokens['whole']} |",
        f"| split head (default) | {rate['split']:.1f} | {tokens['split']} |",
        "",
        f"- Split head ÷ whole graph: **{rate['split'] / rate['whole']:.2f}×**; identical "
        f"outputs: {same}/{len(ids)}.",
        f"- Candidates per step ({len(count)} steps): median {np.median(count):.0f}, mean "
        f"{count.mean():.1f}, p90 {np.percentile(count, 90):.0f}, max {count.max()} (of "
        f"{head.spec.hidden_size}-wide rows, vocabulary {split.manifest.vocab_size}).",
        f"- Largest |exact - approx| / bound over those steps and the whole vocabulary: "
        f"{worst:.3f} (the bound holds with this much to spare); load-time check: "
        f"{head.check():.3f}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
