"""Structured output (JSON schemas) with speculation: specedge against ONNX Runtime GenAI's
guidance on the same ONNX files, interleaved prompt by prompt in one process, greedy.

    python benchmarks/structured_speed.py pairs/smollm2-135m-fast --out docs/results/structured.md

Twelve extraction prompts, each with its JSON schema (three schemas). Both systems constrain
with llguidance and the same schema, written with the same JSON style (`x-guidance`: no free
whitespace, ", " and ": " separators). Configurations: specedge target-only free text (what
the masks cost), target-only constrained, speculative constrained (the pair's drafting);
ORT GenAI target-only constrained and speculative constrained at K=3 and K=5 (target 2 / draft 1
threads, its best plan on this machine). Prints end-to-end tokens/s (medians over prompts),
speed-ups, acceptance, outputs that parse and fit their schema, and outputs identical to
specedge's constrained target-only.
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

from specedge.runtime.grammar import Grammar  # noqa: E402
from specedge.runtime.pair import GenerationConfig, Pair  # noqa: E402

STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "city": {"type": "string", "maxLength": 40}}}
REVIEW = {"type": "object", "additionalProperties": False, "required": ["sentiment", "reason"],
          "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                         "reason": {"type": "string", "maxLength": 120}}}
EVENT = {"type": "object", "additionalProperties": False,
         "required": ["title", "date", "attendees"],
         "properties": {"title": {"type": "string", "maxLength": 60},
                        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                        "attendees": {"type": "array", "maxItems": 5,
                                      "items": {"type": "string", "maxLength": 30}}}}
TASKS: list[tuple[str, dict[str, Any]]] = [
    ("Maria Lopez is 34 years old and lives in Lisbon.", PERSON),
    ("Our new colleague, Tom Becker (52), moved here from Hamburg last spring.", PERSON),
    ("Aiko, a 27-year-old designer, works remotely from Osaka.", PERSON),
    ("The oldest member of the club is Pierre Dumas, 81, of Lyon.", PERSON),
    ("The battery lasts two days and the screen is gorgeous. Best phone I have owned.", REVIEW),
    ("It arrived broken and support never answered my emails.", REVIEW),
    ("The hotel was fine: clean rooms, average breakfast, nothing special.", REVIEW),
    ("I would buy these headphones again; the noise cancelling is superb.", REVIEW),
    ("Project kickoff on 2026-03-14 with Ana, Raj and Lena.", EVENT),
    ("The board meeting is set for 2026-11-02; attendees: Chen, Okafor.", EVENT),
    ("Sam and Priya will run the release retro on 2027-01-20.", EVENT),
    ("Hackathon day 2026-06-05, teams led by Ivo, Mei, Jonas and Zara.", EVENT),
]


def fits(text: str, schema: dict[str, Any]) -> bool:
    """The text parses as JSON with exactly the schema's required keys and their types."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict) or set(value) != set(schema["required"]):
        return False
    kinds = {"string": str, "integer": int, "array": list}
    for key, spec in schema["properties"].items():
        if "enum" in spec and value[key] not in spec["enum"]:
            return False
        if spec.get("type") in kinds and not isinstance(value[key], kinds[spec["type"]]):
            return False
    return True


def main() -> None:
    args = interleaved_args(__doc__)
    started = time.time()
    genai_t, genai_s = ort_genai.target_and_speculative(args.pair)
    pair = Pair.load(args.pair)
    tasks = [(pair.encode_prompt([{"role": "user", "content": "Reply with JSON only. " + text}]),
              {**schema, "x-guidance": STYLE}) for text, schema in TASKS]
    base = GenerationConfig(max_new_tokens=args.max_new_tokens)

    def ours(ids: list[int], schema: dict[str, Any] | None, drafter: str | None
             ) -> tuple[float, list[int], str, float]:
        grammar = Grammar.json_schema(schema) if schema is not None else None
        out, _, st = pair.generate_ids(ids, replace(base, grammar=grammar, drafter=drafter))
        text = pair.tokenizer.decode(out)
        return st.end_to_end_tokens_per_s, out, text, st.acceptance_rate

    def theirs(model: Any, ids: list[int], schema: dict[str, Any], k: int | None
               ) -> tuple[float, list[int], str, float]:
        run = ort_genai.run_one(model[0], model[1], ids, args.max_new_tokens,
                                num_draft_tokens=k, guidance=("json_schema", json.dumps(schema)))
        rate = run.new_tokens / (run.seconds + run.prefill_seconds)
        acc = (run.accepted or 0) / run.proposed if run.proposed else 0.0
        return rate, run.tokens, pair.tokenizer.decode(run.tokens), acc

    configs: dict[str, Any] = {
        "specedge target-only, free text": lambda ids, s: ours(ids, None, "none"),
        "specedge target-only, constrained": lambda ids, s: ours(ids, s, "none"),
        "specedge speculative, constrained": lambda ids, s: ours(ids, s, None),
        "ORT GenAI target-only, constrained": lambda ids, s: theirs(genai_t, ids, s, None),
        "ORT GenAI K=3, constrained": lambda ids, s: theirs(genai_s, ids, s, 3),
        "ORT GenAI K=5, constrained": lambda ids, s: theirs(genai_s, ids, s, 5),
    }
    for run in configs.values():  # warm-up
        run(*tasks[0])
    rates: dict[str, list[float]] = {name: [] for name in configs}
    accept: dict[str, list[float]] = {name: [] for name in configs}
    valid = dict.fromkeys(configs, 0)
    same = dict.fromkeys(configs, 0)
    for _ in range(args.repeats):
        for ids, schema in tasks:
            reference: list[int] | None = None
            for name, run in configs.items():
                time.sleep(0.1)  # let the previous configuration's spinning threads sleep
                rate, tokens, text, acc = run(ids, schema)
                rates[name].append(rate)
                accept[name].append(acc)
                if name == "specedge target-only, constrained":
                    reference = tokens
                valid[name] += fits(text.strip(), schema)
                same[name] += tokens == reference
    n = len(tasks) * args.repeats
    med = {name: statistics.median(v) for name, v in rates.items()}
    lines = ["# Structured output with speculation: specedge vs ORT GenAI guidance",
             "",
             f"`python benchmarks/structured_speed.py {args.pair} --max-new-tokens "
             f"{args.max_new_tokens} --repeats {args.repeats}` ({time.strftime('%Y-%m-%d')}, "
             f"{(time.time() - started) / 60:.1f} min, 2-core CPU). {len(tasks)} extraction "
             f"prompts (chat template), each with one of three JSON schemas, {args.repeats} "
             "repetitions, greedy, configurations interleaved prompt by prompt. Both systems "
             "constrain with llguidance and the same schemas and JSON style.",
             "",
             "| configuration | tok/s e2e (median) | × specedge constrained target-only "
             "| × ORT GenAI constrained target-only | acceptance | fits its schema "
             "| identical to specedge constrained target-only |",
             "|---|---|---|---|---|---|---|"]
    ref_t = med["specedge target-only, constrained"]
    ref_g = med["ORT GenAI target-only, constrained"]
    for name in configs:
        acc = statistics.mean(accept[name]) if "speculative" in name or "K=" in name else None
        lines.append(f"| {name} | {med[name]:.1f} | {med[name] / ref_t:.2f}x | "
                     f"{med[name] / ref_g:.2f}x | {'–' if acc is None else f'{acc:.2f}'} | "
                     f"{valid[name]}/{n} | "
                     f"{'–' if 'free' in name else f'{same[name]}/{n}'} |")
    best_g = max(med["ORT GenAI K=3, constrained"], med["ORT GenAI K=5, constrained"])
    lines += ["", f"specedge speculative vs ORT GenAI's best speculative: "
              f"**{med['specedge speculative, constrained'] / best_g:.2f}x**; vs its own "
              f"constrained target-only: "
              f"**{med['specedge speculative, constrained'] / ref_t:.2f}x**. The masks cost "
              f"{(1 - ref_t / med['specedge target-only, free text']) * 100:.0f}% of "
              "target-only speed here (free text decodes different, longer answers, so this "
              "is indicative only)."]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
