"""A continuously batched server's rounds, speculation on against off, in one process.

    python benchmarks/continuous_ab.py pairs/smollm2-135m-concat --capacity 4 --repeat 4

One `ContinuousBatch` per mode, kept for the whole run as a server keeps it (its adaptive-K
tuner learns across requests): "spec" with the pair's drafting, "plain" with drafter none.
Each takes one untimed pass over the prompts first (a server's warm-up), then `--repeat`
timed passes, the modes alternating which goes first. A pass submits every prompt at once
(`--capacity` decode together, the rest wait for a slot) and runs until all are done.

Printed per pass: tokens/s end to end (new tokens over the pass's seconds), the seconds in
prefills, target calls, draft calls (catch-ups included) and the rest (host), and the rounds by
live rows: how many ran plain (k = 0) and how many drafted, with their mean milliseconds. So a
gap between the modes is split into where it comes from, without hooks into the runtime. Every
pass's tokens are compared with the first plain pass's (greedy: equal token for token).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts
from specedge.runtime.serving import ContinuousBatch


def run_pass(server: ContinuousBatch, prompts: list[str], config: GenerationConfig
             ) -> tuple[dict[str, float], dict[tuple[int, bool], list[float]], list[list[int]]]:
    """One pass: every prompt submitted, stepped to the end. Returns the seconds by phase,
    the seconds of each round by (live rows, drafted) and the tokens in prompt order."""
    totals = server.decoder.totals
    before = (totals.prefill_s, totals.verify_s, totals.draft_s, totals.rounds, totals.new_tokens)
    ids = [server.submit(p, config) for p in prompts]
    rounds: dict[tuple[int, bool], list[float]] = defaultdict(list)
    results = {}
    start = time.perf_counter()
    while server.busy:
        t0, prefill0, n0 = time.perf_counter(), totals.prefill_s, totals.rounds
        results.update(server.step())
        if totals.rounds > n0:  # a round ran (its step's prefill left out)
            seconds = time.perf_counter() - t0 - (totals.prefill_s - prefill0)
            rounds[(totals.live_rows[-1], totals.draft_lengths[-1] > 0)].append(seconds)
    elapsed = time.perf_counter() - start
    prefill, verify, draft = (totals.prefill_s - before[0], totals.verify_s - before[1],
                              totals.draft_s - before[2])
    phases = {"seconds": elapsed, "prefill": prefill, "verify": verify, "draft": draft,
              "host": elapsed - prefill - verify - draft,
              "tokens": float(sum(len(results[i].tokens) for i in ids))}
    return phases, rounds, [results[i].tokens for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", help="a --graph concat pair folder")
    ap.add_argument("--capacity", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--providers", default="cpu")
    args = ap.parse_args()
    pair = Pair.load(args.pair, providers=args.providers)
    prompts = list(default_prompts()[:args.prompts])
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, chat=True)
    servers = {mode: ContinuousBatch(pair, capacity=args.capacity, drafter=drafter)
               for mode, drafter in (("spec", None), ("plain", "none"))}
    for server in servers.values():  # the warm-up: untimed
        run_pass(server, prompts, config)
    reference: list[list[int]] | None = None
    rates: dict[str, list[float]] = defaultdict(list)
    print(f"{args.pair}: capacity {args.capacity}, {len(prompts)} chat prompts, "
          f"{args.max_new_tokens} new tokens at most, {args.providers}")
    for rep in range(args.repeat):
        for mode in (("plain", "spec") if rep % 2 else ("spec", "plain")):
            phases, rounds, tokens = run_pass(servers[mode], prompts, config)
            reference = reference if reference is not None or mode != "plain" else tokens
            same = sum(a == b for a, b in zip(tokens, reference or tokens, strict=True))
            rate = phases["tokens"] / phases["seconds"]
            rates[mode].append(rate)
            split = " ".join(f"{k} {phases[k]:.2f}" for k in ("prefill", "verify", "draft",
                                                                 "host"))
            by_rows = " ".join(
                f"{rows}{'d' if drafted else 'p'}:{len(s)}x{1000 * statistics.mean(s):.1f}"
                for (rows, drafted), s in sorted(rounds.items()))
            print(f"{mode:5} pass {rep}: {rate:6.1f} tok/s, {int(phases['tokens'])} tokens in "
                  f"{phases['seconds']:.2f} s ({split}); rounds rows+p/d:count x ms {by_rows}; "
                  f"equal to plain {same}/{len(tokens)}", flush=True)
    spec, plain = statistics.median(rates["spec"]), statistics.median(rates["plain"])
    print(f"median tok/s: spec {spec:.1f}, plain {plain:.1f}, spec/plain {spec / plain:.3f}x")


if __name__ == "__main__":
    main()
