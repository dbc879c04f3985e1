"""What asking for logprobs costs: the same prompts decoded without them, with each token's
logprob (`logprobs=0`) and with the top 5 alternatives, interleaved prompt by prompt in one
process, greedy, with the pair's own drafting (and target-only, for the speed-up).

    python benchmarks/logprobs_cost.py pairs/smollm2-135m-fast --max-new-tokens 64

A greedy row that keeps logprobs takes its logits to the host (the whole head, where a split
head would read only its int8 shortlist) and computes a log-softmax over the vocabulary per
token. Prints end-to-end tokens/s per setting (medians over prompts), each one's ratio to the
run without logprobs, and whether every setting decoded the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts, read_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--prompts", default=None, help="a prompt file (default: the shipped 20)")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    pair = Pair.load(args.pair)
    prompts = (read_prompts(args.prompts) if args.prompts else default_prompts())[:args.limit]
    base = GenerationConfig(max_new_tokens=args.max_new_tokens, chat=True)
    settings = {"target-only": replace(base, drafter="none"),
                "speculative": base,
                "speculative, logprobs": replace(base, logprobs=0),
                "speculative, logprobs + top 5": replace(base, logprobs=5),
                "target-only, logprobs + top 5": replace(base, drafter="none", logprobs=5)}
    for config in settings.values():  # warm-up: sessions, buffers, the tuner
        pair.generate(prompts[0], config)
    rates: dict[str, list[float]] = {name: [] for name in settings}
    same = 0
    for prompt in prompts:
        tokens = []
        for name, config in settings.items():
            result = pair.generate(prompt, config)
            rates[name].append(result.stats.end_to_end_tokens_per_s)
            tokens.append(result.tokens)
        same += all(t == tokens[0] for t in tokens)
    print(f"{args.pair}: {len(prompts)} chat prompts, {args.max_new_tokens} new tokens, "
          "greedy, the pair's default drafting, interleaved prompt by prompt")
    print("| setting | tok/s (median) | vs the same decoding without logprobs |")
    print("|---|---|---|")
    medians = {name: statistics.median(r) for name, r in rates.items()}
    for name, rate in medians.items():
        plain = medians["target-only" if name.startswith("target-only") else "speculative"]
        print(f"| {name} | {rate:.1f} | {rate / plain:.3f}x |")
    print(f"speculative / target-only: {medians['speculative'] / medians['target-only']:.3f}x "
          f"without logprobs, {medians['speculative, logprobs + top 5'] / medians['target-only, logprobs + top 5']:.3f}x "  # noqa: E501
          "with top 5")
    print(f"identical tokens in every setting: {same}/{len(prompts)} prompts")


if __name__ == "__main__":
    main()
