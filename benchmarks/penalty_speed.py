"""Does speculation still pay with presence / frequency penalties? The same prompts decoded
target-only and with the pair's drafting, without and with penalties, interleaved prompt by
prompt in one process, greedy.

    python benchmarks/penalty_speed.py pairs/smollm2-135m-fast --max-new-tokens 64

A penalized greedy row takes its logits to the host (the argmax of penalized logits), and the
draft proposes from penalized logits too. Prints end-to-end tokens/s (medians over prompts),
acceptance, speculative over target-only for each, and whether speculative and target-only
decoded the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts
from specedge.runtime.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--presence", type=float, default=0.5)
    ap.add_argument("--frequency", type=float, default=0.5)
    args = ap.parse_args()
    pair = Pair.load(args.pair)
    prompts = default_prompts()[:args.limit]
    base = GenerationConfig(max_new_tokens=args.max_new_tokens, chat=True)
    penalized = replace(base, sampling=SamplingParams(presence_penalty=args.presence,
                                                      frequency_penalty=args.frequency))
    settings = {"plain": base, "penalized": penalized}
    for config in settings.values():  # warm-up
        pair.generate(prompts[0], config)
        pair.generate(prompts[0], replace(config, drafter="none"))
    rates: dict[tuple[str, str], list[float]] = {}
    accepted: dict[str, list[float]] = {name: [] for name in settings}
    same = {name: 0 for name in settings}
    for prompt in prompts:
        for name, config in settings.items():
            alone = pair.generate(prompt, replace(config, drafter="none"))
            spec = pair.generate(prompt, config)
            rates.setdefault((name, "target-only"), []).append(
                alone.stats.end_to_end_tokens_per_s)
            rates.setdefault((name, "speculative"), []).append(
                spec.stats.end_to_end_tokens_per_s)
            accepted[name].append(spec.stats.acceptance_rate)
            same[name] += spec.tokens == alone.tokens
    print(f"{args.pair}: {len(prompts)} chat prompts, {args.max_new_tokens} new tokens, greedy, "
          f"penalties presence {args.presence} / frequency {args.frequency}, interleaved")
    print("| decoding | target-only tok/s | speculative tok/s | speed-up | acceptance "
          "| identical |")
    print("|---|---|---|---|---|---|")
    for name in settings:
        t = statistics.median(rates[(name, "target-only")])
        s = statistics.median(rates[(name, "speculative")])
        print(f"| {name} | {t:.1f} | {s:.1f} | {s / t:.2f}x | "
              f"{statistics.mean(accepted[name]):.2f} | {same[name]}/{len(prompts)} |")


if __name__ == "__main__":
    main()
