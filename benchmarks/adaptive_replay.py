"""Replay greedy decoding policies on recorded traces: adaptive K against every fixed K, per
prompt category, with no timing noise.

Greedy speculative output equals target-only output, so a policy's rounds are determined by
two recorded sequences per prompt: the target's greedy continuation, and the draft's
teacher-forced greedy guess at every position (where the draft's drafts agree with the target,
its inputs are the target's tokens, so its next guess is the teacher-forced one). A round at
position t with k model drafts accepts the run of agreement from t (capped at k); a hybrid
round takes the n-gram lookup first (`drafters.NgramDrafter`, `take_ngram`), exactly as
`HybridDrafter` does. Each round is charged a cost from a model of measured costs:
k * draft_step + verify(k + 1), with verify(s) / verify(1) and draft_step / verify(1) measured on
this device by `bench.measure_costs` (or given), each charge drawn with ±`--noise` so the tuner
sees noisy measurements as it would live. Adaptive K runs the real `adaptive.AdaptiveK`, one
tuner carried across the prompts as `Pair` does (with `new_text` at each prompt).

This is a design tool: it shows what a policy does with the costs it is given. Speed claims
come from `specedge bench`, which runs the real loop.

Usage: python benchmarks/adaptive_replay.py PAIR [--prompts benchmarks/prompts.jsonl]
           [--drafter hybrid] [--ks 1,2,3,4,5,6,8] [--k-max 8] [--max-new-tokens 128]
           [--noise 0.2] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specedge.runtime.adaptive import AdaptiveK, new_tuner  # noqa: E402
from specedge.runtime.bench import measure_costs  # noqa: E402
from specedge.runtime.drafters import NgramDrafter, ngram_for, take_ngram  # noqa: E402
from specedge.runtime.pair import GenerationConfig, Pair  # noqa: E402
from specedge.runtime.prompts import read_categories, read_prompts  # noqa: E402


def record(pair: Pair, prompts: tuple[str, ...], max_new: int) -> list[dict[str, list[int]]]:
    """Per prompt: the full greedy sequence (prompt + target-only continuation) and the draft's
    teacher-forced greedy guess for each next position."""
    traces = []
    for prompt in prompts:
        ids = pair.encode_prompt(prompt, chat=True)
        out, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=max_new,
                                                            drafter="none"))
        seq = ids + out
        guess: list[int] = []
        if pair.draft is not None:
            cache = pair.draft.new_cache(1, len(seq) + 1)
            am = pair.draft.forward_argmax(cache, np.asarray([seq], np.int64))[0]
            vocab = pair.draft.vocab_ids
            guess = [int(vocab[t]) if vocab is not None else int(t) for t in am]
        traces.append({"seq": seq, "prompt_len": [len(ids)], "guess": guess})
    return traces


class CostModel:
    def __init__(self, verify_ratio: dict[int, float], draft: float, noise: float, seed: int):
        self.verify_ratio, self.draft, self.noise = verify_ratio, draft, noise
        self.rng = random.Random(seed)

    def verify(self, s: int) -> float:
        known = sorted(self.verify_ratio)
        if s in self.verify_ratio:
            return self.verify_ratio[s]
        lo, hi = known[-2], known[-1]  # beyond the measured sizes: the last slope
        slope = (self.verify_ratio[hi] - self.verify_ratio[lo]) / (hi - lo)
        return self.verify_ratio[hi] + slope * (s - hi)

    def draw(self, x: float) -> float:
        return x * (1 + self.noise * (2 * self.rng.random() - 1))


def replay(trace: dict[str, list[int]], drafter: str, k: int, k_free: int,
           tuner: AdaptiveK | None, costs: CostModel, ngram: NgramDrafter | None
           ) -> tuple[int, float]:
    seq, guess = trace["seq"], trace["guess"]
    start = trace["prompt_len"][0] + 1  # the first token comes from the prefill
    t, spent = start, 0.0
    while t < len(seq):
        left = len(seq) - t
        k_model = max(0, min(tuner.k if tuner else k, left - 1))
        k_hit = max(0, min(k_free, left - 1))
        hit = ngram.lookup(seq[:t], k_hit) if ngram is not None and k_hit else []
        free = drafter != "model" and take_ngram(hit, k_hit)
        step_s, steps = 0.0, 0
        if free:
            drafts = hit
        elif drafter != "ngram" and k_model:
            drafts, agree = [], True
            for i in range(k_model):
                agree = agree and (i == 0 or drafts[-1] == seq[t + i - 1])
                drafts.append(guess[t - 1 + i] if agree else -1)
                c = costs.draw(costs.draft)
                step_s, steps, spent = step_s + c, steps + 1, spent + c
        else:
            drafts = []
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == seq[t + accepted]:
            accepted += 1
        v = costs.draw(costs.verify(len(drafts) + 1))
        spent += v
        if tuner is not None:
            if free:
                tuner.free_round(len(drafts) + 1, v, min(accepted + 1, left), v)
            else:
                tuner.update(len(drafts), accepted, step_s, steps, v)
        t += min(accepted + 1, left)
    return len(seq) - start, spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", type=Path)
    ap.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts.jsonl")
    ap.add_argument("--drafter", default="hybrid", choices=("model", "ngram", "hybrid"))
    ap.add_argument("--ks", default="1,2,3,4,5,6,8")
    ap.add_argument("--k-max", type=int, default=8, help="adaptive K's largest k")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--noise", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--costs", type=Path, default=None,
                    help="take the costs from a `specedge bench --json` report instead of "
                         "measuring them now")
    args = ap.parse_args()
    pair = Pair.load(args.pair)
    prompts = read_prompts(args.prompts)
    categories = read_categories(args.prompts) or ("all",) * len(prompts)
    if args.costs is not None:
        measured = json.loads(args.costs.read_text())["costs"]
        target = {int(s): float(t) for s, t in measured["target"].items()}
        draft_step = measured["draft_step"]
    else:
        c = measure_costs(pair)
        target, draft_step = c.target, c.draft_step
    v1 = target[1]
    costs = CostModel({s: t / v1 for s, t in target.items()},
                      (draft_step or 0.0) / v1 if args.drafter != "ngram" else 0.0,
                      args.noise, args.seed)
    traces = record(pair, prompts, args.max_new_tokens)
    ks = [int(k) for k in args.ks.split(",")]
    ngram = ngram_for(args.drafter)
    settings: list[tuple[str, int, AdaptiveK | None]] = [("target only", 0, None)]
    settings += [(f"K={k}", k, None) for k in ks]
    settings.append((f"adaptive K<={args.k_max}", args.k_max,
                     new_tuner(args.drafter, args.k_max)))
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for trace, category in zip(traces, categories, strict=True):
        for name, k, tuner in settings:
            if tuner is not None:
                tuner.new_text()  # as `Pair` does at each generation
            drafter = "none" if name == "target only" else args.drafter
            n, s = replay(trace, drafter, k, k if drafter != "none" else 0, tuner, costs,
                          ngram if drafter != "none" else None)
            for key in (category, "all"):
                sums[name][key][0] += n
                sums[name][key][1] += s
    cats = list(dict.fromkeys(categories)) + (["all"] if len(set(categories)) > 1 else [])
    lines = [f"`python benchmarks/adaptive_replay.py {args.pair} --drafter {args.drafter} "
             f"--ks {args.ks} --k-max {args.k_max} --noise {args.noise}"
             + (f" --costs {args.costs}" if args.costs else "") + f"` ({len(prompts)} prompts "
             f"x {args.max_new_tokens} tokens). Costs measured here in units of verify(1): "
             + ", ".join(f"verify({s}) {r:.2f}" for s, r in sorted(costs.verify_ratio.items()))
             + f"; draft step {costs.draft:.2f}.", "",
             "| setting | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    rate = {name: {cat: v[0] / v[1] for cat, v in per.items()} for name, per in sums.items()}
    for name, _, _ in settings:
        lines.append(f"| {name} | " + " | ".join(
            f"{rate[name][cat] / rate['target only'][cat]:.3f}x" for cat in cats) + " |")
    fixed = [f"K={k}" for k in ks]
    adaptive = settings[-1][0]
    lines.append(f"| {adaptive} / best fixed | " + " | ".join(
        f"{rate[adaptive][cat] / max(rate[f][cat] for f in fixed):.3f} "
        f"({max(fixed, key=lambda f: rate[f][cat])})" for cat in cats) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
