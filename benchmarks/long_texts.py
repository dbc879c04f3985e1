"""Adaptive K on long texts: fixed-length generations, sampled with a seed per prompt (so
target-only and speculative decoding give the same text), run target-only then adaptive K per
prompt in one process. Prints each text's speed, whether the outputs are identical, and the share
of rounds that drafted in the whole text and in its second half: a tuner that stopped drafting
in a text and never resumed shows 0.00 there (docs/results/adaptive_long_texts.md).

    python benchmarks/long_texts.py pairs/smollm2-135m --prompts benchmarks/long_prompts.jsonl \
        --max-new-tokens 512 --temperature 0.8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams


def config(args: argparse.Namespace, index: int, drafter: str | None) -> GenerationConfig:
    sampling = (SamplingParams(temperature=args.temperature, seed=100 + index)
                if args.temperature else SamplingParams())
    extra = {"drafter": drafter} if drafter else {}
    return GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True,
                            sampling=sampling, **extra)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pair", type=Path)
    parser.add_argument("--prompts", type=Path, default=Path("benchmarks/long_prompts.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()
    pair = Pair.load(args.pair)
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines()
               if line.strip()]
    warm = pair.encode_prompt("Write a haiku about the sea.")
    for _ in range(2):
        pair.generate_ids(warm, GenerationConfig(max_new_tokens=64))
    base_s = spec_s = 0.0
    tokens = same = 0
    for i, prompt in enumerate(prompts):
        ids = pair.encode_prompt(prompt)
        t0 = time.perf_counter()
        base, _, _ = pair.generate_ids(ids, config(args, i, "none"))
        t1 = time.perf_counter()
        spec, _, stats = pair.generate_ids(ids, config(args, i, None))
        t2 = time.perf_counter()
        ks = stats.draft_lengths
        half = ks[len(ks) // 2:]
        drafting = sum(k > 0 for k in ks) / max(1, len(ks))
        late = sum(k > 0 for k in half) / max(1, len(half))
        base_s, spec_s, tokens = base_s + t1 - t0, spec_s + t2 - t1, tokens + len(base)
        same += spec == base
        print(f"{len(base):5d} tok  identical={spec == base}  target {len(base) / (t1 - t0):.1f}"
              f"  adaptive {len(spec) / (t2 - t1):.1f} tok/s ({(t1 - t0) / (t2 - t1):.2f}x)"
              f"  rounds {len(ks)}  drafting {drafting:.2f} (2nd half {late:.2f})", flush=True)
    print(f"TOTAL {tokens} tok: target {tokens / base_s:.1f}  adaptive {tokens / spec_s:.1f} tok/s"
          f" = {base_s / spec_s:.3f}x; identical {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
