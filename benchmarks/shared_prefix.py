"""Rows of a batch that share a long prefix (one document, several questions), prefilled once
and copied, against each row prefilling it.

    python benchmarks/shared_prefix.py pairs/smollm2-135m-concat --doc-tokens 800 --rows 4

Each row is a chat prompt: the same document (README text) and its own question. Both settings
run `runtime.batch.decode_batch` on the same loaded pair, repeats interleaved: with
`keep_prefixes=True` (what `generate_batch` and `ContinuousBatch` do) the first row prefills the
document and the others copy its whole 128-position chunks; with False every row prefills it.
Reported: the batch's prefill seconds, its end-to-end seconds, the rows' reused tokens; the
tokens must be identical. Writes markdown with --out.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from specedge.runtime.batch import RowRequest, decode_batch
from specedge.runtime.pair import GenerationConfig, Pair

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["Summarize the text above in three sentences.",
             "Which commands does the text describe?",
             "What does the text say about GPUs?",
             "List the file formats the text mentions.",
             "Who is this project for?", "What is measured, and how?",
             "Name two limitations the text admits.", "What would you try first?"]


def one_run(pair: Pair, prompts: list[list[int]], config: GenerationConfig, share: bool
            ) -> dict[str, Any]:
    plan = pair.plan(config)
    max_len = plan.cache_len(max(len(p) for p in prompts) + config.max_new_tokens, 0)
    requests = [RowRequest(prompt=p, output=pair.new_output(p, config), params=config.sampling)
                for p in prompts]
    t0 = time.perf_counter()
    rows, totals = decode_batch(pair.target, pair.draft, plan, requests, max_len=max_len,
                                keep_prefixes=share)
    return {"total": time.perf_counter() - t0, "prefill": totals.prefill_s,
            "decode": totals.decode_s, "reused": [r.stats.cached_tokens for r in rows],
            "tokens": [list(r.generated) for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--doc-tokens", type=int, default=800)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    pair = Pair.load(args.pair)
    words = (ROOT / "README.md").read_text().split()
    n = 50
    while len(pair.encode_prompt(" ".join(words[:n + 50]), chat=False)) <= args.doc_tokens:
        n += 50
    doc = " ".join(words[:n])
    prompts = [pair.encode_prompt([{"role": "user", "content": f"{doc}\n\n{q}"}])
               for q in (QUESTIONS * args.rows)[:args.rows]]
    config = GenerationConfig(max_new_tokens=args.new_tokens)
    one_run(pair, prompts[:2], GenerationConfig(max_new_tokens=4), True)  # warm-up
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    began = time.perf_counter()
    for _ in range(args.repeats):
        for share in (False, True):
            runs[share].append(one_run(pair, prompts, config, share))
    elapsed = time.perf_counter() - began
    same = all(r["tokens"] == runs[False][0]["tokens"] for rs in runs.values() for r in rs)
    med = statistics.median
    lines = ["| rows prefill the document | prefill s | end to end s | prompt tokens reused |",
             "|---|---|---|---|"]
    for share, label in ((False, "each"), (True, "once, copied")):
        rs = runs[share]
        lines.append(f"| {label} | {med(r['prefill'] for r in rs):.2f} | "
                     f"{med(r['total'] for r in rs):.2f} | {rs[0]['reused']} |")
    ratio = med(r["prefill"] for r in runs[False]) / med(r["prefill"] for r in runs[True])
    total = med(r["total"] for r in runs[False]) / med(r["total"] for r in runs[True])
    text = "\n".join([
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {elapsed / 60:.1f} min, "
        f"`python benchmarks/shared_prefix.py {args.pair} --doc-tokens {args.doc_tokens} --rows "
        f"{args.rows} --new-tokens {args.new_tokens} --repeats {args.repeats}`.",
        f"Machine: {platform.machine()}, Python {platform.python_version()}. {args.rows} chat "
        f"prompts of {min(map(len, prompts))}–{max(map(len, prompts))} tokens: one document, a "
        f"question each; {args.new_tokens} new tokens a row, the pair's drafting; medians over "
        f"{args.repeats} interleaved repeats.", "", *lines, "",
        f"- Prefill {ratio:.2f}x shorter, end to end {total:.2f}x.",
        f"- Tokens identical in every run: {'yes' if same else 'NO'}.",
    ])
    print(text)
    if args.out:
        Path(args.out).write_text("# Rows sharing a document: prefilled once\n\n" + text + "\n")
    if not same:
        raise SystemExit("the tokens differ with shared prefixes")


if __name__ == "__main__":
    main()
