"""Adaptive K with hybrid drafting from a fresh process: target-only, a fixed K and adaptive K
(up to the same K) on `specedge tune`'s calibration prompts, greedy, decode tokens/s.

    python benchmarks/hybrid_adaptive.py pairs/smollm2-135m-fast --first 9 --k 8 [--alone]

Adaptive K's tuner lives on the `Pair` as in any application: it starts cold (after `specedge
tune`'s warm-up, 8 tokens of the first calibration prompt) and learns across the prompts.
Prints each prompt's rates, the rounds adaptive K drafted in, and the totals; every output is
checked against target-only. The three settings run interleaved prompt by prompt; with
`--alone`, adaptive K runs through every prompt first, in a fresh process with nothing before
or between its generations but its warm-up (as an application that only decodes this way: its
first costs are read cold), then the other two, interleaved. The timings then come from two
passes, not one: a cold tuner's choices depend on the costs it reads, and the other settings'
runs between its generations change them.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from specedge.calibration.data import CALIBRATION_PROMPTS
from specedge.runtime.pair import GenerationConfig, Pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--first", type=int, default=0, help="the first calibration prompt")
    ap.add_argument("--limit", type=int, default=len(CALIBRATION_PROMPTS))
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--alone", action="store_true", help="adaptive K first, in a pass of its own")
    args = ap.parse_args()
    pair = Pair.load(args.pair)
    base = GenerationConfig(max_new_tokens=args.max_new_tokens, chat=True, drafter="hybrid",
                            num_draft_tokens=args.k)
    settings = {"target-only": replace(base, drafter="none"),
                f"K={args.k}": replace(base, adaptive=False),
                f"adaptive K<={args.k}": replace(base, adaptive=True)}
    prompts = CALIBRATION_PROMPTS[args.first:args.first + args.limit]
    ids = [pair.encode_prompt(p, chat=True) for p in prompts]
    warm = pair.encode_prompt(CALIBRATION_PROMPTS[0], chat=True)
    passes = ([[list(settings)[-1]], list(settings)[:-1]] if args.alone else [list(settings)])
    totals = {name: [0, 0.0] for name in settings}
    outputs: dict[str, list[list[int]]] = {name: [] for name in settings}
    for names in passes:
        for name in names:  # warm-up: `specedge tune`'s (8 tokens of the first prompt)
            pair.generate_ids(warm, replace(settings[name], max_new_tokens=8))
        for n, prompt_ids in enumerate(ids):
            cells = []
            for name in names:
                out, _, st = pair.generate_ids(prompt_ids, settings[name])
                outputs[name].append(out)
                totals[name][0] += st.new_tokens
                totals[name][1] += st.decode_s
                cell = f"{name} {st.new_tokens / st.decode_s:5.1f}"
                if name.startswith("adaptive"):
                    with_drafts = sum(1 for k in st.draft_lengths if k)
                    cell += f" ({with_drafts}/{st.rounds} rounds with drafts)"
                cells.append(cell)
            print(f"prompt {args.first + n:2d}: " + " | ".join(cells), flush=True)
    same = sum(len({tuple(o[n]) for o in outputs.values()}) == 1 for n in range(len(ids)))
    plain = totals["target-only"][0] / totals["target-only"][1]
    for name, (tokens, seconds) in totals.items():
        print(f"{name:>16}: {tokens / seconds:5.1f} tok/s, {tokens / seconds / plain:.2f}x")
    print(f"identical to target-only: {same}/{len(ids)}")


if __name__ == "__main__":
    main()
