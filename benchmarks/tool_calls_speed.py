"""Tool calls with speculation: specedge against ONNX Runtime GenAI's guidance on the same ONNX
files and the same grammar, interleaved prompt by prompt in one process, greedy.

    python benchmarks/tool_calls_speed.py pairs/smollm2-135m-fast --out docs/results/tool_calls.md

Twelve requests, four tools, `tool_choice: "required"` with one call (`parallel_tool_calls:
false`): the prompt is what `specedge serve` renders (`runtime/tool_prompt`), and the reply is
constrained to a call by the grammar the server uses (a Lark grammar with one JSON schema per
tool, `ToolFormat.grammar`), which ORT GenAI takes as its `lark_grammar` guidance (both run
llguidance). Configurations: specedge target-only and speculative (the pair's drafting); ORT
GenAI target-only and speculative at K=3 and K=5 (target 2 / draft 1 threads, its best plan on
this machine); and specedge with a prefix cache, as `specedge serve` runs (every request repeats
the tool listing). Prints end-to-end and decode tokens/s (medians over requests), speed-ups,
acceptance, replies that are one call fitting its tool's schema, and replies identical to
specedge's target-only.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from anchors import ort_genai  # noqa: E402
from report import emit, interleaved_args  # noqa: E402

from specedge.runtime.pair import GenerationConfig, Pair  # noqa: E402
from specedge.runtime.tool_prompt import ToolPlan  # noqa: E402
from specedge.runtime.tool_set import ToolSet  # noqa: E402


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(properties), "additionalProperties": False}}}


TOOLS = [
    _tool("get_weather", "The current weather in a city",
          {"city": {"type": "string", "maxLength": 40},
           "unit": {"enum": ["celsius", "fahrenheit"]}}),
    _tool("get_time", "The current time in a city", {"city": {"type": "string", "maxLength": 40}}),
    _tool("convert_currency", "Convert an amount of money",
          {"amount": {"type": "number"}, "from": {"type": "string", "maxLength": 3},
           "to": {"type": "string", "maxLength": 3}}),
    _tool("web_search", "Search the web", {"query": {"type": "string", "maxLength": 80}}),
]
REQUESTS = [
    "What's the weather like in Lisbon right now, in celsius?",
    "Is it hot in Phoenix today? Use fahrenheit.",
    "Tell me the weather in Oslo.",
    "What time is it in Tokyo?",
    "Current time in Buenos Aires, please.",
    "What's the local time in Nairobi?",
    "How much is 250 US dollars in euros?",
    "Convert 1200 yen to dollars.",
    "How many pounds is 80 euros?",
    "Search the web for the tallest building in Europe.",
    "Find recent news about the James Webb telescope.",
    "Look up a recipe for banana bread.",
]


def fits(calls: tuple[Any, ...]) -> bool:
    """One call, to one of the tools, with exactly its arguments."""
    if len(calls) != 1:
        return False
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    schema = spec.get(calls[0].name)
    try:
        arguments = json.loads(calls[0].arguments)
    except ValueError:
        return False
    return schema is not None and isinstance(arguments, dict) and \
        set(arguments) == set(schema["required"])


def main() -> None:
    args = interleaved_args(__doc__)
    started = time.time()
    genai_t, genai_s = ort_genai.target_and_speculative(args.pair)
    pair = Pair.load(args.pair)
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(TOOLS, "required", False))
    grammar = plan.grammar
    assert grammar is not None
    prompts = [plan.prompt_ids(pair.tokenizer, [{"role": "user", "content": text}])
               for text in REQUESTS]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, grammar=grammar)

    def ours(ids: list[int], drafter: str | None, on: Pair = pair
             ) -> tuple[float, float, list[int], float]:
        out, _, st = on.generate_ids(ids, replace(config, drafter=drafter))
        return st.end_to_end_tokens_per_s, st.tokens_per_s, out, st.acceptance_rate

    def theirs(model: Any, ids: list[int], k: int | None
               ) -> tuple[float, float, list[int], float]:
        run = ort_genai.run_one(model[0], model[1], ids, args.max_new_tokens,
                                num_draft_tokens=k, guidance=("lark_grammar", grammar.source))
        rate = run.new_tokens / (run.seconds + run.prefill_seconds)
        decode = max(0, run.new_tokens - 1) / run.seconds if run.seconds > 0 else 0.0
        acc = (run.accepted or 0) / run.proposed if run.proposed else 0.0
        return rate, decode, run.tokens, acc

    cached = Pair.load(args.pair, prefix_cache=1)  # as `specedge serve` runs: tools re-sent
    configs: dict[str, Any] = {
        "specedge target-only": lambda ids: ours(ids, "none"),
        "specedge speculative": lambda ids: ours(ids, None),
        "specedge target-only, prefix cache": lambda ids: ours(ids, "none", cached),
        "specedge speculative, prefix cache": lambda ids: ours(ids, None, cached),
        "ORT GenAI target-only": lambda ids: theirs(genai_t, ids, None),
        "ORT GenAI K=3": lambda ids: theirs(genai_s, ids, 3),
        "ORT GenAI K=5": lambda ids: theirs(genai_s, ids, 5),
    }
    for run in configs.values():  # warm-up
        run(prompts[0])
    rates: dict[str, list[float]] = {name: [] for name in configs}
    decode: dict[str, list[float]] = {name: [] for name in configs}
    accept: dict[str, list[float]] = {name: [] for name in configs}
    valid = dict.fromkeys(configs, 0)
    same = dict.fromkeys(configs, 0)
    example = ""
    for _ in range(args.repeats):
        for ids in prompts:
            reference: list[int] | None = None
            for name, run in configs.items():
                time.sleep(0.1)  # let the previous configuration's spinning threads sleep
                rate, dec, tokens, acc = run(ids)
                rates[name].append(rate)
                decode[name].append(dec)
                accept[name].append(acc)
                if name == "specedge target-only":
                    reference = tokens
                    example = example or pair.tokenizer.decode(tokens)
                eos = set(pair.manifest.eos_token_ids)
                text = pair.tokenizer.decode([t for t in tokens if t not in eos])
                valid[name] += fits(plan.fmt.parse(text).calls)
                same[name] += [t for t in tokens if t not in eos] == \
                    [t for t in reference or [] if t not in eos]
    n = len(prompts) * args.repeats
    med = {name: statistics.median(v) for name, v in rates.items()}
    dmed = {name: statistics.median(v) for name, v in decode.items()}
    lines = ["# Tool calls with speculation: specedge vs ORT GenAI guidance",
             "",
             f"`python benchmarks/tool_calls_speed.py {args.pair} --max-new-tokens "
             f"{args.max_new_tokens} --repeats {args.repeats}` ({time.strftime('%Y-%m-%d')}, "
             f"{(time.time() - started) / 60:.1f} min, 2-core CPU). {len(prompts)} requests, "
             f"{len(TOOLS)} tools, `tool_choice: \"required\"`, one call each, the prompt as "
             "`specedge serve` renders it; {args.repeats} repetitions, greedy, configurations "
             "interleaved request by request. Both systems constrain with llguidance and the "
             "same Lark grammar (ORT GenAI: `lark_grammar` guidance).".replace(
                 "{args.repeats}", str(args.repeats)),
             "",
             "| configuration | tok/s e2e (median) | × specedge target-only "
             "| × ORT GenAI target-only | tok/s decode (median) | decode × specedge "
             "target-only | acceptance | one call that fits "
             "| identical to specedge target-only |",
             "|---|---|---|---|---|---|---|---|---|"]
    ref_t, ref_g = med["specedge target-only"], med["ORT GenAI target-only"]
    for name in configs:
        acc = statistics.mean(accept[name]) if "speculative" in name or "K=" in name else None
        lines.append(f"| {name} | {med[name]:.1f} | {med[name] / ref_t:.2f}x | "
                     f"{med[name] / ref_g:.2f}x | {dmed[name]:.1f} | "
                     f"{dmed[name] / dmed['specedge target-only']:.2f}x | "
                     f"{'–' if acc is None else f'{acc:.2f}'} | "
                     f"{valid[name]}/{n} | {same[name]}/{n} |")
    best_g = max(med["ORT GenAI K=3"], med["ORT GenAI K=5"])
    served = med["specedge speculative, prefix cache"]
    lines += ["", f"specedge speculative vs ORT GenAI's best speculative: "
              f"**{med['specedge speculative'] / best_g:.2f}x** end to end (cold prompts); vs "
              f"its own target-only: **{med['specedge speculative'] / ref_t:.2f}x** end to end, "
              f"**{dmed['specedge speculative'] / dmed['specedge target-only']:.2f}x** in "
              f"decoding. As the server runs (prefix cache: the tool listing that every "
              f"request repeats is prefilled once): **{served / ref_t:.2f}x** specedge's cold "
              f"target-only, **{served / ref_g:.2f}x** ORT GenAI's target-only, "
              f"**{served / best_g:.2f}x** its best speculative (it keeps no prefix between "
              "requests).", "",
              f"A reply (the first request, target-only): `{example!r}`"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
