"""Structured output in batches: the 12 JSON extraction prompts of `structured_speed.py`
decoded as batches of B rows on a concat-form pair, each row under its own schema, target-only
and speculative, interleaved batch by batch in one process, greedy.

    python benchmarks/structured_batch.py pairs/smollm2-135m-concat --batch 4

Prints aggregate tokens/s end to end (new tokens of all rows / the batch's seconds, prefill
included) and of decoding alone, medians over batches, the speed-ups, and the rows identical
to their batch-1 constrained target-only runs (ORT GenAI cannot batch these: its speculative
decoding takes one sequence).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from structured_speed import STYLE, TASKS, fits  # noqa: E402

from specedge.runtime.grammar import Grammar  # noqa: E402
from specedge.runtime.pair import GenerationConfig, Pair  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", type=Path)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    started = time.time()
    pair = Pair.load(args.pair)
    prompts = [[{"role": "user", "content": "Reply with JSON only. " + text}]
               for text, _ in TASKS]
    schemas = [{**schema, "x-guidance": STYLE} for _, schema in TASKS]
    configs = [GenerationConfig(max_new_tokens=args.max_new_tokens,
                                grammar=Grammar.json_schema(s)) for s in schemas]
    solo = [pair.generate(p, replace(c, drafter="none")).tokens
            for p, c in zip(prompts, configs, strict=True)]
    groups = [range(i, min(i + args.batch, len(prompts)))
              for i in range(0, len(prompts), args.batch)]
    settings = {"target-only": "none", "speculative (the pair's drafting)": None}
    pair.generate_batch([prompts[i] for i in groups[0]],
                        [configs[i] for i in groups[0]])  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in settings}
    decode: dict[str, list[float]] = {name: [] for name in settings}
    same = dict.fromkeys(settings, 0)
    valid = dict.fromkeys(settings, 0)
    acceptance: list[float] = []
    for _ in range(args.repeats):
        for group in groups:
            for name, drafter in settings.items():
                time.sleep(0.1)
                batch = pair.generate_batch([prompts[i] for i in group],
                                            [replace(configs[i], drafter=drafter)
                                             for i in group])
                rates[name].append(batch.stats.end_to_end_tokens_per_s)
                decode[name].append(batch.stats.tokens_per_s)
                for i, result in zip(group, batch.results, strict=True):
                    same[name] += result.tokens == solo[i]
                    valid[name] += fits(result.text.strip(), TASKS[i][1])
                if drafter is None and batch.stats.proposed:
                    acceptance.append(batch.stats.accepted / batch.stats.proposed)
    n = len(prompts) * args.repeats
    t = statistics.median(rates["target-only"])
    td = statistics.median(decode["target-only"])
    lines = ["# Structured output in batches", "",
             f"`python benchmarks/structured_batch.py {args.pair} --batch {args.batch} "
             f"--max-new-tokens {args.max_new_tokens} --repeats {args.repeats}` "
             f"({time.strftime('%Y-%m-%d')}, {(time.time() - started) / 60:.1f} min, 2-core "
             f"CPU). The 12 JSON extraction prompts of structured_speed.py, in batches of "
             f"{args.batch} rows, each row under its own schema, greedy, the two settings "
             "interleaved batch by batch.", "",
             "| setting | aggregate tok/s e2e (median over batches) | speed-up | decode tok/s "
             "| speed-up | acceptance | fits its schema "
             "| rows == their batch-1 constrained target-only |",
             "|---|---|---|---|---|---|---|---|"]
    for name in settings:
        r, d = statistics.median(rates[name]), statistics.median(decode[name])
        acc = f"{statistics.mean(acceptance):.2f}" if name != "target-only" else "–"
        lines.append(f"| {name} | {r:.1f} | {r / t:.2f}x | {d:.1f} | {d / td:.2f}x | {acc} | "
                     f"{valid[name]}/{n} | {same[name]}/{n} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
