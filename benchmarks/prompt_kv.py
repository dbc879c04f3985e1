"""A self-draft that reads the target's prompt against one that prefills its own: end-to-end
speed on short prompts, long prompts and tool calls, interleaved prompt by prompt, greedy.

    python benchmarks/prompt_kv.py pairs/smollm2-135m-fast --out docs/results/prompt_kv.md

Three prompt sets of six: short chat questions; long prompts (a ~1 KB paragraph of this
repository's README and a question about it, ~330 tokens); and tool calls (four tools, one
forced call, the prompt `specedge serve` renders, ~360 tokens). For each prompt: target-only,
speculative with the draft's own prefill (`Pair.shares_prompt_kv = False`) and speculative with
the target's prompt keys and values (the default for a self-draft), the pair's drafting.
Prints medians of end-to-end and decode tokens/s, prefill seconds and acceptance, and how many
outputs equal target-only's.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import emit, interleaved_args  # noqa: E402
from tool_calls_speed import REQUESTS, TOOLS  # noqa: E402

from specedge.runtime.pair import GenerationConfig, Pair  # noqa: E402
from specedge.runtime.tool_prompt import ToolPlan  # noqa: E402
from specedge.runtime.tool_set import ToolSet  # noqa: E402

SHORT = ["Write a haiku about the sea.", "Name three rivers in Europe.",
         "What is the capital of France?", "Explain photosynthesis briefly.",
         "Give me a short poem about cats.", "How do I boil an egg?"]
QUESTIONS = ["Summarize this text in two sentences.", "What is the main point of this text?",
             "List three facts from this text.", "Explain this text to a beginner.",
             "What problem does this text solve?",
             "Rewrite the first sentence in simpler words."]
MODES = ("target-only", "speculative, draft prefills", "speculative, target's prompt")


def prompt_sets(pair: Pair, max_new_tokens: int) -> dict[str, list[tuple[list[int], Any]]]:
    base = GenerationConfig(max_new_tokens=max_new_tokens)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    paragraphs = [p for p in readme.split("\n\n")
                  if 700 < len(p) < 1600 and not p.startswith("```")][:len(QUESTIONS)]
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(TOOLS, "required", False))
    return {
        "short chat": [(pair.encode_prompt([{"role": "user", "content": q}]), base)
                       for q in SHORT],
        "long prompt": [(pair.encode_prompt([{"role": "user", "content": f"{p}\n\n{q}"}]), base)
                        for p, q in zip(paragraphs, QUESTIONS, strict=True)],
        "tool call": [(plan.prompt_ids(pair.tokenizer, [{"role": "user", "content": t}]),
                       replace(base, grammar=plan.grammar)) for t in REQUESTS[::2]],
    }


def main() -> None:
    args = interleaved_args(__doc__)
    started = time.time()
    pair = Pair.load(args.pair)
    if not pair.shares_prompt_kv:
        sys.exit(f"{args.pair}: its draft is not a self-draft of its target")
    sets = prompt_sets(pair, args.max_new_tokens)

    def run(ids: list[int], config: Any, mode: str) -> tuple[Any, list[int]]:
        pair.shares_prompt_kv = mode == MODES[2]
        out, _, st = pair.generate_ids(ids, replace(config, drafter="none")
                                       if mode == MODES[0] else config)
        return st, out

    for ids, config in sets["short chat"][:2]:  # warm-up
        for mode in MODES:
            run(ids, config, mode)
    lines = ["# A self-draft reading the target's prompt", "",
             f"`python benchmarks/prompt_kv.py {args.pair} --max-new-tokens "
             f"{args.max_new_tokens} --repeats {args.repeats}` ({time.strftime('%Y-%m-%d')}, "
             f"2-core CPU), greedy, the pair's drafting, modes interleaved prompt by prompt; "
             "medians over prompts and repetitions.", "",
             "| prompts | tokens (median) | mode | tok/s e2e | × target-only | tok/s decode "
             "| prefill s | acceptance | = target-only |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, items in sets.items():
        stats: dict[str, list[Any]] = {m: [] for m in MODES}
        same = dict.fromkeys(MODES, 0)
        for _ in range(args.repeats):
            for ids, config in items:
                reference: list[int] | None = None
                for mode in MODES:
                    st, out = run(ids, config, mode)
                    stats[mode].append(st)
                    reference = out if reference is None else reference
                    same[mode] += out == reference
        n = len(items) * args.repeats
        base = statistics.median(s.end_to_end_tokens_per_s for s in stats[MODES[0]])
        length = statistics.median(len(ids) for ids, _ in items)
        for mode in MODES:
            rows = stats[mode]
            e2e = statistics.median(s.end_to_end_tokens_per_s for s in rows)
            acc = statistics.median(s.acceptance_rate for s in rows)
            lines.append(f"| {name} | {length:.0f} | {mode} | {e2e:.1f} | {e2e / base:.2f}x | "
                         f"{statistics.median(s.tokens_per_s for s in rows):.1f} | "
                         f"{statistics.median(s.prefill_s for s in rows):.3f} | "
                         f"{'–' if mode == MODES[0] else f'{acc:.2f}'} | {same[mode]}/{n} |")
    lines += ["", f"{(time.time() - started) / 60:.1f} min."]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
