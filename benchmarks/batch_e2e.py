"""End-to-end batched decoding (prefills included): target-only against adaptive K, over
many generations of one batch size, interleaved generation by generation in one process.

    python benchmarks/batch_e2e.py pairs/smollm2-135m-concat --batch 8 --prompts 128

`specedge bench --batch` reports decode tokens/s, which leaves out the prefills. A server
waits for them too, and with adaptive K the draft's prefill is work that pays only when the
tuner drafts. Here every setting's tokens/s is new tokens over prefill + decode seconds, with
the draft model's calls counted. For a self-draft, adaptive K runs twice: reading the target's
prompt (the default) and prefilling its own (`Pair.shares_prompt_kv = False`).
"""

from __future__ import annotations

import argparse
import time

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=128, help="prompts in all (generations x B)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="adaptive K's largest draft length")
    ap.add_argument("--chat", action="store_true",
                    help="render each prompt through the chat template (longer prompts)")
    args = ap.parse_args()
    pair = Pair.load(args.pair)
    if pair.draft is None:
        raise SystemExit(f"{args.pair} has no draft model")
    prompts = (default_prompts() * (1 + args.prompts // len(default_prompts())))[:args.prompts]
    adaptive = GenerationConfig(max_new_tokens=args.max_new_tokens, drafter="model",
                                num_draft_tokens=args.k, adaptive=True, chat=args.chat)
    settings = {
        "target-only": GenerationConfig(max_new_tokens=args.max_new_tokens, drafter="none",
                                        chat=args.chat),
        "adaptive": adaptive}
    pairs = dict.fromkeys(settings, pair)
    if pair.shares_prompt_kv:  # the same, with the draft prefilling its own prompt (its own
        own = Pair.load(args.pair)  # Pair: adaptive K's tuner learns from its own costs)
        own.shares_prompt_kv = False
        settings["adaptive, own"], pairs["adaptive, own"] = adaptive, own
    for name, cfg in settings.items():  # warm-up; the adaptive tuner's first batch
        pairs[name].generate_batch(prompts[:args.batch], cfg)
    totals = {name: {"tokens": 0, "seconds": 0.0, "prefill_s": 0.0, "draft_calls": 0,
                     "drafting_rounds": 0, "rounds": 0} for name in settings}
    for start in range(0, len(prompts) // args.batch * args.batch, args.batch):
        for name, cfg in settings.items():
            calls = pairs[name].draft.calls  # type: ignore[union-attr]
            t0 = time.perf_counter()
            st = pairs[name].generate_batch(prompts[start:start + args.batch], cfg).stats
            t = totals[name]
            t["seconds"] += time.perf_counter() - t0
            t["tokens"] += st.new_tokens
            t["prefill_s"] += st.prefill_s
            t["draft_calls"] += pairs[name].draft.calls - calls  # type: ignore[union-attr]
            t["rounds"] += st.rounds
            t["drafting_rounds"] += sum(k > 0 for k in st.draft_lengths)
    gens = len(prompts) // args.batch
    print(f"{args.pair}, batch {args.batch}, {gens} generations of {args.max_new_tokens} "
          f"tokens, {'chat' if args.chat else 'plain'} prompts, end to end (prefills "
          "included), interleaved:")
    base = totals["target-only"]["tokens"] / totals["target-only"]["seconds"]
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        print(f"  {name:14s} {rate:7.1f} tok/s ({rate / base:.2f}x)  prefill {t['prefill_s']:.2f} "
              f"of {t['seconds']:.2f} s  draft calls {t['draft_calls']}  drafting rounds "
              f"{t['drafting_rounds']} of {t['rounds']}")


if __name__ == "__main__":
    main()
