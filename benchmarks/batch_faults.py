"""Batched target-only decoding with and without a draft's KV cache allocated beside the
target's: decode tok/s, target ms per round and minor page faults per round, interleaved in one
process (the cause of adaptive K's loss at batch 8 on the CPU, `docs/results/batching.md`).

    python benchmarks/batch_faults.py pairs/smollm2-135m-concat --batch 8 --reps 2

The two settings decode the same prompts with the same target; the only difference is a draft
cache (allocated and prefilled, never used afterwards), as adaptive K at k = 0 has.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from specedge.runtime.batch import BatchDecoder, RowRequest
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts


def run(pair: Pair, prompts: list[str], batch: int, new: int, with_draft_cache: bool
        ) -> tuple[int, float, int, int]:
    """One batched target-only generation: (tokens, decode seconds, rounds, page faults)."""
    cfg = GenerationConfig(max_new_tokens=new, drafter="none", chat=True)
    plan = pair.plan(cfg)
    ids = [pair.encode_prompt(p, chat=True) for p in prompts]
    max_len = plan.cache_len(max(len(i) for i in ids) + new, 0)
    decoder = BatchDecoder(pair.target, None, plan, capacity=batch, max_len=max_len)
    extra = None
    if with_draft_cache and pair.draft is not None:
        extra = pair.draft.new_cache(batch, max_len)
        for slot, i in enumerate(ids):  # the draft's prefill, as `BatchDecoder.add` runs it
            pair.draft.forward_rows(extra, np.asarray([slot]), np.asarray([i], np.int64),
                                    np.asarray([len(i)]))
    for i in ids:
        decoder.add(RowRequest(i, pair.new_output(i, cfg)))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    while decoder.live:
        decoder.step()
    seconds = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    st = decoder.totals
    del extra
    return st.new_tokens - st.rows, seconds, st.rounds, faults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    pair = Pair.load(args.pair)
    prompts = (default_prompts() * 2)[:20]
    groups = [prompts[s:s + args.batch] for s in range(0, 20 // args.batch * args.batch,
                                                       args.batch)]
    run(pair, groups[0], args.batch, 8, True)  # warm-up
    totals = {False: [0, 0.0, 0, 0], True: [0, 0.0, 0, 0]}
    for _ in range(args.reps):
        for group in groups:
            for setting in (False, True):
                for j, v in enumerate(run(pair, group, args.batch, args.max_new_tokens,
                                          setting)):
                    totals[setting][j] += v
    print(f"{args.pair}, batch {args.batch}, {args.reps} x {len(groups)} batches of "
          f"{args.max_new_tokens} tokens, target-only, interleaved:")
    for setting, (tokens, seconds, rounds, faults) in totals.items():
        label = "with a draft cache" if setting else "target cache only"
        print(f"  {label:20s} {tokens / seconds:7.1f} tok/s  {1000 * seconds / rounds:6.2f} ms "
              f"per round  {faults / rounds:7.0f} page faults per round")
    ratio = (totals[True][0] / totals[True][1]) / (totals[False][0] / totals[False][1])
    print(f"  with / without: {ratio:.3f}x")


if __name__ == "__main__":
    main()
