"""Multi-turn chat with and without prefix caching: the time to the first token of each turn.

    python benchmarks/prefix_cache.py pairs/smollm2-135m-fast --turns 8 --conversations 3

Each conversation re-sends its whole history every turn, as `specedge chat` and chat clients of
`specedge serve` do. The same loaded models run it twice, interleaved turn by turn (the order
alternating): a pair that keeps no caches (`prefix_cache=0`) and one that keeps one
(`prefix_cache=1`) and prefills each prompt and reply ahead after the turn, as `specedge chat`
does. Greedy replies must be identical; the table gives, per turn, the prompt's
tokens, those a kept prefix held, and the median time to the first token (prefill + first
token) and end-to-end time of each. Writes markdown with --out.

    python benchmarks/prefix_cache.py pairs/smollm2-135m-fast --draft-prefills-ahead

adds a third pair, interleaved too: cached, its self-draft computing its own keys and values
when prefilling ahead (`Pair.shares_prompt_kv = False`) instead of copying the target's.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import read_prompts

SYSTEM = ("You are a helpful assistant running on a small device. Answer clearly and "
          "concisely, use lists where they help, and ask a question when a request is unclear.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", default=str(Path(__file__).with_name("prompts.jsonl")))
    ap.add_argument("--out", default=None, help="write the table as markdown here")
    ap.add_argument("--draft-prefills-ahead", action="store_true",
                    help="add a cached pair whose self-draft prefills its own keys ahead")
    args = ap.parse_args()
    base = Pair.load(args.pair)
    pairs = {size: Pair(base.manifest, base.tokenizer, base.target, base.draft, min(size, 1))
             for size in (0, 1, 2)[:3 if args.draft_prefills_ahead else 2]}
    if args.draft_prefills_ahead:
        if not base.shares_prompt_kv:
            raise SystemExit(f"{args.pair}: its draft is not a self-draft of its target")
        pairs[2].shares_prompt_kv = False
    questions = list(read_prompts(Path(args.prompts)))
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, chat=True)
    rows: dict[int, dict[str, list[float]]] = {}
    same = total = 0
    start = time.perf_counter()
    for c in range(args.conversations):
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(args.turns):
            question = questions[(c * args.turns + turn) % len(questions)]
            messages.append({"role": "user", "content": question})
            texts = {}
            order = list(pairs)[::1 if (c + turn) % 2 == 0 else -1]
            for size in order:
                t0 = time.perf_counter()
                stream = pairs[size].stream(messages, config)
                first = None
                while True:
                    try:
                        next(stream)
                    except StopIteration as done:
                        result = done.value
                        break
                    first = first or time.perf_counter() - t0
                texts[size] = result.text
                row = rows.setdefault(turn, {})
                if size:  # as `specedge chat` does while the reply is read (not timed above)
                    t1 = time.perf_counter()
                    pairs[size].prefill_ahead(pairs[size].conversation_ids(
                        messages, result.text))
                    row.setdefault(f"ahead{size}", []).append(time.perf_counter() - t1)
                    row.setdefault(f"acceptance{size}", []).append(
                        result.stats.acceptance_rate)
                row.setdefault(f"ttft{size}", []).append(first or result.stats.total_s)
                row.setdefault(f"total{size}", []).append(result.stats.total_s)
                row.setdefault("prompt", []).append(result.stats.prompt_tokens)
                if size == 1:
                    row.setdefault("cached", []).append(result.stats.cached_tokens)
            total += 1
            same += len(set(texts.values())) == 1
            messages.append({"role": "assistant", "content": texts[0]})
    elapsed = time.perf_counter() - start

    def med(values: list[float]) -> float:
        return statistics.median(values)

    lines = [
        "| turn | prompt tokens | reused | first token, no cache (ms) | first token, cached "
        "(ms) | × | end to end, no cache (ms) | end to end, cached (ms) | prefilled ahead "
        "after it (ms) |",
        "|---|---|---|---|---|---|---|---|---|"]
    for turn, r in sorted(rows.items()):
        lines.append(f"| {turn + 1} | {med(r['prompt']):.0f} | {med(r['cached']):.0f} | "
                     f"{med(r['ttft0']) * 1e3:.0f} | {med(r['ttft1']) * 1e3:.0f} | "
                     f"{med(r['ttft0']) / med(r['ttft1']):.2f} | {med(r['total0']) * 1e3:.0f} | "
                     f"{med(r['total1']) * 1e3:.0f} | {med(r['ahead1']) * 1e3:.0f} |")
    ttft = [sum(x for r in rows.values() for x in r[f"ttft{s}"]) for s in (0, 1)]
    if 2 in pairs:
        lines += ["", *_ahead_lines(rows)]
    head = [
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {elapsed / 60:.1f} min, "
        f"`python benchmarks/prefix_cache.py {args.pair} --turns {args.turns} --conversations "
        f"{args.conversations} --max-new-tokens {args.max_new_tokens}"
        f"{' --draft-prefills-ahead' if 2 in pairs else ''}`.",
        f"Machine: {platform.machine()}, Python {platform.python_version()}; pair "
        f"{args.pair} ({base.target.steps_note()}); greedy, the pair's default drafting; "
        f"median over {args.conversations} conversations.",
        "",
        *lines,
        "",
        f"- Replies identical with and without the cache: {same}/{total}"
        + (" (all three pairs)." if 2 in pairs else "."),
        f"- Time to first token over all turns: {ttft[0]:.2f} s without, {ttft[1]:.2f} s with "
        f"the cache ({ttft[0] / ttft[1]:.2f}x).",
        "- What a turn reuses: the whole 128-token chunks of the previous prompt and reply. "
        "After each reply the cached pair prefills the conversation so far ahead, rendered as "
        "the next prompt will render it (`Pair.conversation_ids`, `Pair.prefill_ahead`: what "
        "`specedge chat` does while the reply is read and `specedge serve` when no request "
        "waits), in the chunks a cold prefill would make: "
        "decoding wrote the reply's keys and values in steps and verification blocks, which "
        "are not the cold computation bit for bit. That time (last column) is not in the "
        "turn's figures. A turn that needs a longer cache than the previous one (a power of "
        "two, at least 1024) reuses nothing.",
    ]
    text = "\n".join(head)
    print(text)
    if args.out:
        title = "Prefilling ahead with a self-draft" if 2 in pairs else "Prefix caching"
        Path(args.out).write_text(f"# {title}: multi-turn chat\n\n{text}\n")
    if same != total:
        raise SystemExit("replies differ with the prefix cache")


def _ahead_lines(rows: dict[int, dict[str, list[float]]]) -> list[str]:
    """The cached pair against the one whose self-draft prefills its own keys ahead."""
    sums = [sum(x for r in rows.values() for x in r[f"{key}{s}"])
            for key in ("ahead", "ttft") for s in (1, 2)]
    acc = [statistics.median(x for r in rows.values() for x in r[f"acceptance{s}"])
           for s in (1, 2)]
    lines = ["| turn | prefilled ahead, draft copies the target's (ms) | prefilled ahead, "
             "draft computes its own (ms) | first token, copied / own (ms) |",
             "|---|---|---|---|"]
    for turn, r in sorted(rows.items()):
        ahead = [statistics.median(r[f"ahead{s}"]) * 1e3 for s in (1, 2)]
        ttft = [statistics.median(r[f"ttft{s}"]) * 1e3 for s in (1, 2)]
        lines.append(f"| {turn + 1} | {ahead[0]:.0f} | {ahead[1]:.0f} | {ttft[0]:.0f} / "
                     f"{ttft[1]:.0f} |")
    return [*lines, "",
            f"- Prefilling ahead over all turns: {sums[0]:.2f} s with the draft copying the "
            f"target's keys and values, {sums[1]:.2f} s with it computing its own "
            f"({sums[1] / max(sums[0], 1e-9):.2f}x the time); time to first token "
            f"{sums[2]:.2f} s against {sums[3]:.2f} s (that pair's draft also prefills each "
            f"new message itself); median acceptance {acc[0]:.2f} against {acc[1]:.2f}."]


if __name__ == "__main__":
    main()
