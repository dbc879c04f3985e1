"""Sampled verification's host cost: warping every row of a verification block (the former
path) against warping a row only when the rejection rule reaches it, on a real pair, in one run.

    python benchmarks/lazy_rows.py PAIR [--prompts 12] [--max-new-tokens 96] [--top-p 0.9]
                                        [--temperature 0.7] [--ks 3,5]

1. The host cost itself: every verification call of a K=5 sampled generation recorded, then
   timed on both paths (ms per call, and rows warped per call).
2. Sampled generation (chat prompts), unseeded (the rejection rule) and seeded (the exponential
race checked greedily), target-only and fixed K, each with both paths, interleaved prompt by
prompt: decode tok/s, and whether both paths gave the same tokens. They must: for unseeded rows
both paths get the same generator (a fixed seed in place of fresh entropy), so the lazy rule
makes the same draws; seeded rows are deterministic. The former path is `RowSampler.verify` as
it was, kept here to be measured against.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from specedge.runtime import rounds, sampling
from specedge.runtime.acceptance import accept_greedy, accept_sample
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.penalties import penalize, suppress_stops
from specedge.runtime.prompts import default_prompts
from specedge.runtime.sampling import SamplingParams, warp_probs

PATHS = ("eager (former)", "lazy")


def eager_verify(self: rounds.RowSampler, drafts: np.ndarray, draft_probs: np.ndarray | None,
                 logits: np.ndarray, position: int, history: Sequence[int] = ()) -> np.ndarray:
    """`RowSampler.verify` before the lazy rows: every row warped first."""
    logits = penalize(logits, history, drafts, self.params, self.prompt)
    if self.grammar is not None:
        logits = self.grammar.constrain(logits, history, drafts)
    logits = suppress_stops(logits, position, self.params.min_tokens, self.stop_ids)
    if self.params.greedy:
        return accept_greedy(drafts, logits)
    target_probs = warp_probs(logits, self.params)  # [n + 1, vocab]
    if self.seeded:
        noise = np.stack([self.noise(position + j) for j in range(len(logits))])
        return accept_greedy(drafts, target_probs / noise)
    assert self.rng is not None
    n = len(drafts)
    if draft_probs is None:
        draft_probs = np.zeros((n, logits.shape[-1]))
        draft_probs[np.arange(n), drafts] = 1.0
    return accept_sample(drafts, draft_probs, target_probs, self.rng)


@contextmanager
def path(name: str) -> Iterator[None]:
    saved_verify, saved_rng = rounds.RowSampler.verify, sampling.SamplingParams.make_rng
    if name == PATHS[0]:
        rounds.RowSampler.verify = eager_verify  # type: ignore[method-assign]
    # the same draws on both paths (unseeded rows draw from fresh entropy otherwise)
    sampling.SamplingParams.make_rng = lambda self: np.random.default_rng(1234)  # type: ignore
    try:
        yield
    finally:
        rounds.RowSampler.verify = saved_verify  # type: ignore[method-assign]
        sampling.SamplingParams.make_rng = saved_rng  # type: ignore[method-assign]


def per_call(pair: Pair, params: SamplingParams, prompts: list[str], k: int,
             max_new_tokens: int) -> None:
    calls: list[tuple[rounds.RowSampler, tuple[object, ...]]] = []
    lazy = rounds.RowSampler.verify

    def recording(self: rounds.RowSampler, *args: object) -> np.ndarray:
        calls.append((self, args))
        return lazy(self, *args)  # type: ignore[arg-type]

    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=params, drafter="model",
                              num_draft_tokens=k, adaptive=False, chat=True)
    rounds.RowSampler.verify = recording  # type: ignore[method-assign]
    try:
        for prompt in prompts:
            pair.generate(prompt, config)
    finally:
        rounds.RowSampler.verify = lazy  # type: ignore[method-assign]
    blocks = [(s, a) for s, a in calls if len(a[0]) == k]  # type: ignore[arg-type]
    cells = []
    for fn in (eager_verify, lazy):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for sampler, args in blocks:
                sampler.rng = np.random.default_rng(0)
                fn(sampler, *args)  # type: ignore[operator]
            best = min(best, time.perf_counter() - start)
        cells.append(1000 * best / len(blocks))
    rows = [0]
    original = rounds.warp_probs

    def counting(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
        rows[0] += int(np.asarray(logits).reshape(-1, logits.shape[-1]).shape[0])
        return original(logits, p)

    rounds.warp_probs = counting  # type: ignore[assignment]
    try:
        for sampler, args in blocks:
            sampler.rng = np.random.default_rng(0)
            lazy(sampler, *args)  # type: ignore[arg-type]
    finally:
        rounds.warp_probs = original
    kind = "seeded" if params.seed is not None else "unseeded"
    print(f"{kind}: {len(blocks)} verification blocks of K={k} (vocabulary "
          f"{pair.manifest.vocab_size}): {PATHS[0]} {cells[0]:.3f} ms a block ({k + 1} rows "
          f"warped), {PATHS[1]} {cells[1]:.3f} ms ({rows[0] / len(blocks):.2f} rows warped); "
          f"{cells[0] / cells[1]:.2f}x less host time")


def generation(pair: Pair, params: SamplingParams, label: str, ks: tuple[int, ...],
               prompts: list[str], max_new_tokens: int) -> None:
    settings = [("target-only", GenerationConfig(max_new_tokens=max_new_tokens, sampling=params,
                                                 drafter="none", chat=True))]
    settings += [(f"K={k}", GenerationConfig(max_new_tokens=max_new_tokens, sampling=params,
                                             drafter="model", num_draft_tokens=k,
                                             adaptive=False, chat=True)) for k in ks]
    rates: dict[tuple[str, str], list[float]] = defaultdict(list)
    same: dict[str, int] = defaultdict(int)
    accepted: dict[str, list[float]] = defaultdict(list)
    for name in PATHS:  # warm-up
        with path(name):
            for _, config in settings:
                pair.generate(prompts[0], config)
    for i, prompt in enumerate(prompts):
        for setting, config in settings:
            tokens = {}
            order = PATHS if i % 2 == 0 else PATHS[::-1]
            for name in order:
                with path(name):
                    result = pair.generate(prompt, config)
                rates[setting, name].append(result.stats.tokens_per_s)
                tokens[name] = result.tokens
                if name == PATHS[1] and result.stats.proposed:
                    accepted[setting].append(result.stats.accepted / result.stats.proposed)
            same[setting] += tokens[PATHS[0]] == tokens[PATHS[1]]
    print(f"\n{label} sampling (temperature {params.temperature}, top-p {params.top_p}), "
          f"{len(prompts)} chat prompts x {max_new_tokens} tokens, decode tok/s (median over "
          "prompts):")
    base = {name: statistics.median(rates["target-only", name]) for name in PATHS}
    for setting, _ in settings:
        cells = [statistics.median(rates[setting, name]) for name in PATHS]
        rate = f", acceptance {statistics.mean(accepted[setting]):.2f}" \
            if accepted[setting] else ""
        print(f"  {setting:>11}: {PATHS[0]} {cells[0]:6.1f} ({cells[0] / base[PATHS[0]]:.2f}x "
              f"its target-only), {PATHS[1]} {cells[1]:6.1f} ({cells[1] / base[PATHS[1]]:.2f}x); "
              f"lazy / eager {cells[1] / cells[0]:.3f}; same tokens "
              f"{same[setting]}/{len(prompts)}{rate}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--ks", default="3,5")
    args = ap.parse_args()
    ks = tuple(int(k) for k in args.ks.split(","))
    pair = Pair.load(args.pair)
    prompts = default_prompts()[:args.prompts]
    print(f"sampled verification's host cost (temperature {args.temperature}, top-p "
          f"{args.top_p}), best of 3 passes:")
    for seed in (None, 0):
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=seed)
        per_call(pair, params, prompts[:4], max(ks), args.max_new_tokens)
    for label, seed in (("unseeded", None), ("seeded", 0)):
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=seed)
        generation(pair, params, label, ks, prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
