"""Top-p (nucleus) sampling's host cost: the threshold search against the sorting search it now
falls back to, on a real pair's logits and in sampled generation, in one run.

    python benchmarks/nucleus.py PAIR [--prompts 6] [--max-new-tokens 64] [--top-p 0.9]
                                      [--temperature 0.7] [--ks 2]

1. `warp_probs` per call on the target's logits of a chat prompt's positions, 1 and K+1 rows
   (a decode step, a verification block), each path timed alone.
2. Seeded sampled generation (chat prompts, greedy off), target-only and fixed K, each with
   both paths, interleaved prompt by prompt: decode tok/s and whether both paths gave the same
   tokens (they must: the two searches keep the same nucleus).
The sorting path is forced by setting `sampling._THRESHOLD_CANDIDATES` to 0.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from specedge.runtime import sampling
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts
from specedge.runtime.sampling import SamplingParams, warp_probs

PATHS = ("sorting (former)", "threshold")


@contextmanager
def path(name: str) -> Iterator[None]:
    saved = sampling._THRESHOLD_CANDIDATES
    if name == PATHS[0]:
        sampling._THRESHOLD_CANDIDATES = 0
    try:
        yield
    finally:
        sampling._THRESHOLD_CANDIDATES = saved


def per_call(pair: Pair, params: SamplingParams, widths: tuple[int, ...]) -> None:
    prompt = default_prompts()[0]
    ids = np.array(pair.tokenizer.encode_chat([{"role": "user", "content": prompt}]),
                   np.int64)[None]
    logits = pair.target.forward(pair.target.new_cache(1, ids.shape[1] + 1), ids)[0]
    print(f"warp_probs on the target's logits ({logits.shape[1]} ids), temperature "
          f"{params.temperature}, top-p {params.top_p}; best of 5 x 50 calls, ms per call:")
    for width in widths:
        rows = logits[-width:]
        cells = []
        for name in PATHS:
            with path(name):
                best = min(timed(warp_probs, rows, params, reps=50) for _ in range(5))
            cells.append(best)
        print(f"  {width} row(s): {PATHS[0]} {cells[0]:.3f}, {PATHS[1]} {cells[1]:.3f} "
              f"({cells[0] / cells[1]:.2f}x)")


def timed(fn: Callable[..., object], *args: object, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return 1000 * (time.perf_counter() - start) / reps


def generation(pair: Pair, params: SamplingParams, ks: tuple[int, ...], prompts: list[str],
               max_new_tokens: int) -> None:
    settings = [("target-only", GenerationConfig(max_new_tokens=max_new_tokens, sampling=params,
                                                 drafter="none", chat=True))]
    settings += [(f"K={k}", GenerationConfig(max_new_tokens=max_new_tokens, sampling=params,
                                             drafter="model", num_draft_tokens=k,
                                             adaptive=False, chat=True)) for k in ks]
    rates: dict[tuple[str, str], list[float]] = defaultdict(list)
    same = defaultdict(int)
    for config in (c for _, c in settings):  # warm-up
        pair.generate(prompts[0], config)
    for prompt in prompts:
        for label, config in settings:
            tokens = {}
            for name in PATHS:
                with path(name):
                    result = pair.generate(prompt, config)
                rates[label, name].append(result.stats.tokens_per_s)
                tokens[name] = result.tokens
            same[label] += tokens[PATHS[0]] == tokens[PATHS[1]]
    print(f"\nsampled generation, {len(prompts)} chat prompts x {max_new_tokens} tokens, "
          f"seeded, decode tok/s (median over prompts):")
    base = {name: statistics.median(rates["target-only", name]) for name in PATHS}
    for label, _ in settings:
        cells = [statistics.median(rates[label, name]) for name in PATHS]
        print(f"  {label:>11}: {PATHS[0]} {cells[0]:6.1f} ({cells[0] / base[PATHS[0]]:.2f}x "
              f"its target-only), {PATHS[1]} {cells[1]:6.1f} ({cells[1] / base[PATHS[1]]:.2f}x); "
              f"threshold / sorting {cells[1] / cells[0]:.3f}; same tokens "
              f"{same[label]}/{len(prompts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--ks", default="2")
    args = ap.parse_args()
    ks = tuple(int(k) for k in args.ks.split(","))
    pair = Pair.load(args.pair)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0)
    per_call(pair, params, (1, *(k + 1 for k in ks)))
    generation(pair, params, ks, default_prompts()[:args.prompts], args.max_new_tokens)


if __name__ == "__main__":
    main()
