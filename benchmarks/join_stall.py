"""A long prompt joining a continuous batch: how long the running streams stall, by prefill budget.

    python benchmarks/join_stall.py pairs/smollm2-135m-concat --prompt-tokens 1000

Two chat requests decode in a `ContinuousBatch`; after a few rounds a request with a long prompt
(`--prompt-tokens`, text from the README, "Summarize the text above.") joins. Measured for each
`prefill_budget` (0: whole prompts at once, else tokens prefilled between two rounds), repeats
interleaved: the longest gap between two tokens of the running streams while the long request
joins, the joining request's time to its first token, and the running streams' decode speed over
the whole run. Every setting must give the same tokens. Writes markdown with --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.serving import ContinuousBatch

ROOT = Path(__file__).resolve().parents[1]


def one_run(pair: Pair, budget: int | None, running: list[list[int]], long: list[int],
            new: int) -> dict[str, Any]:
    config = GenerationConfig(max_new_tokens=new)
    server = ContinuousBatch(pair, capacity=len(running) + 1, prefill_budget=budget)
    ids = [server.submit_ids(p, config) for p in running]
    done: dict[int, Any] = {}
    for _ in range(4):  # the streams are decoding
        done.update(server.step())
    rows = [r for _, r in server.running.values()]
    joined_at = time.perf_counter()
    late = server.submit_ids(long, GenerationConfig(max_new_tokens=16))
    gaps: list[float] = []
    first_token = None
    last = joined_at
    while server.busy:
        done.update(server.step())
        now = time.perf_counter()
        if first_token is None:
            gaps.append(now - last)  # a step while the long prompt joins
            output = server.output(late)
            if output is None or output.tokens:
                first_token = now - joined_at
        last = now
    decode = sum(r.stats.decode_s for r in rows)
    return {"stall": max(gaps), "ttft": first_token, "steps": len(gaps),
            "tok_s": sum(len(r.generated) for r in rows) / decode if decode else 0.0,
            "tokens": [done[i].tokens for i in [*ids, late]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--budgets", default="0,128,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    pair = Pair.load(args.pair)
    prompts = [json.loads(line)["prompt"] for line in
               (ROOT / "benchmarks" / "prompts.jsonl").read_text().splitlines() if line]
    running = [pair.encode_prompt(p, chat=True) for p in prompts[:2]]
    words = (ROOT / "README.md").read_text().split()
    text, n = "", 0
    while True:  # the longest README prefix within --prompt-tokens as a chat prompt
        candidate = " ".join(words[:n + 50]) + "\n\nSummarize the text above."
        if len(pair.encode_prompt(candidate, chat=True)) > args.prompt_tokens:
            break
        text, n = candidate, n + 50
    long = pair.encode_prompt(text, chat=True)
    budgets = [int(b) for b in args.budgets.split(",")]
    one_run(pair, None, running, long[:200], 8)  # warm-up
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in budgets}
    began = time.perf_counter()
    for _ in range(args.repeats):
        for b in budgets:
            runs[b].append(one_run(pair, b or None, running, long, args.new_tokens))
    elapsed = time.perf_counter() - began
    reference = runs[budgets[0]][0]["tokens"]
    same = all(r["tokens"] == reference for rs in runs.values() for r in rs)
    med = statistics.median
    lines = ["| prefill budget (tokens between rounds) | longest stall of the running streams (ms) "
             "| steps while it joins | joining request's first token (ms) | running streams' "
             "decode tok/s |", "|---|---|---|---|---|"]
    for b, rs in runs.items():
        lines.append(f"| {b or 'whole prompt'} | {med(r['stall'] for r in rs) * 1e3:.0f} | "
                     f"{med(r['steps'] for r in rs):.0f} | "
                     f"{med(r['ttft'] for r in rs) * 1e3:.0f} | "
                     f"{med(r['tok_s'] for r in rs):.1f} |")
    text_out = "\n".join([
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {elapsed / 60:.1f} min, "
        f"`python benchmarks/join_stall.py {args.pair} --prompt-tokens {args.prompt_tokens} "
        f"--new-tokens {args.new_tokens} --budgets {args.budgets} --repeats {args.repeats}`.",
        f"Machine: {platform.machine()}, Python {platform.python_version()}. Two chat requests "
        f"decode ({args.new_tokens} new tokens each, the pair's drafting); after 4 rounds a "
        f"{len(long)}-token chat prompt joins. Medians over {args.repeats} interleaved repeats.",
        "", *lines, "",
        f"- Every setting gave the same tokens: {'yes' if same else 'NO'}.",
    ])
    print(text_out)
    if args.out:
        Path(args.out).write_text("# Chunked prefill: a long prompt joining a decoding batch\n\n"
                                  f"{text_out}\n")
    if not same:
        raise SystemExit("the tokens differ between prefill budgets")


if __name__ == "__main__":
    main()
