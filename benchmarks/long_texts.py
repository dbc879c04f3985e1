"""Adaptive K on long texts: fixed-length generations, sampled with a seed per prompt (so
target-only and speculative decoding give the same text), run target-only then adaptive K per
prompt in one process. Prints each text's speed, whether the outputs are identical, and the share
of rounds that drafted in the whole text and in its second half: a tuner that stopped drafting
in a text and never resumed shows 0.00 there (docs/results/adaptive_long_texts.md). With
`--batch B` the prompts are decoded B at a time (`Pair.generate_batch_ids`, a concat-form pair)
and each line is a batch's.

    python benchmarks/long_texts.py pairs/smollm2-135m --prompts benchmarks/long_prompts.jsonl \
        --max-new-tokens 512 --temperature 0.8
    python benchmarks/long_texts.py pairs/smollm2-135m-concat --batch 2
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
    parser.add_argument("--batch", type=int, default=1,
                        help="texts decoded together (a concat-form pair): the share of rounds "
                             "that drafted is the batch's")
    args = parser.parse_args()
    pair = Pair.load(args.pair)
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines()
               if line.strip()]
    warm = pair.encode_prompt("Write a haiku about the sea.")
    b = args.batch
    for _ in range(2):
        if b > 1:
            pair.generate_batch_ids([warm] * b, GenerationConfig(max_new_tokens=64))
        else:
            pair.generate_ids(warm, GenerationConfig(max_new_tokens=64))
    base_s = spec_s = 0.0
    tokens = same = 0
    for start in range(0, len(prompts), b):
        group = list(range(start, min(start + b, len(prompts))))
        ids = [pair.encode_prompt(prompts[i]) for i in group]
        t0 = time.perf_counter()
        base = run(pair, ids, [config(args, i, "none") for i in group])[0]
        t1 = time.perf_counter()
        spec, ks, draft_share = run(pair, ids, [config(args, i, None) for i in group])
        t2 = time.perf_counter()
        half = ks[len(ks) // 2:]
        drafting = sum(k > 0 for k in ks) / max(1, len(ks))
        late = sum(k > 0 for k in half) / max(1, len(half))
        n = sum(map(len, base))
        base_s, spec_s, tokens = base_s + t1 - t0, spec_s + t2 - t1, tokens + n
        same += sum(x == y for x, y in zip(spec, base, strict=True))
        print(f"{n:5d} tok  identical={spec == base}  target {n / (t1 - t0):.1f}"
              f"  adaptive {n / (t2 - t1):.1f} tok/s ({(t1 - t0) / (t2 - t1):.2f}x)"
              f"  rounds {len(ks)}  drafting {drafting:.2f} (2nd half {late:.2f})"
              f"  draft calls {draft_share:.3f} of the time", flush=True)
    print(f"TOTAL {tokens} tok: target {tokens / base_s:.1f}  adaptive {tokens / spec_s:.1f} tok/s"
          f" = {base_s / spec_s:.3f}x; identical {same}/{len(prompts)}")


def run(pair: Pair, ids: list[list[int]], configs: list[GenerationConfig]
        ) -> tuple[list[list[int]], list[int], float]:
    """The texts for `ids` (alone, or as one batch), the draft length of each round and the
    share of decoding time spent in draft calls (catch-ups included)."""
    if len(ids) == 1:
        tokens, _, stats = pair.generate_ids(ids[0], configs[0])
        return [tokens], stats.draft_lengths, stats.draft_s / max(stats.decode_s, 1e-9)
    result = pair.generate_batch_ids(ids, configs)
    totals = result.stats
    return ([r.tokens for r in result.results], totals.draft_lengths,
            totals.draft_s / max(totals.decode_s, 1e-9))

if __name__ == "__main__":
    main()
