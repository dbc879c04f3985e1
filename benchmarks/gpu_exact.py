"""The GPU check's `check` phase (`benchmarks/gpu_check.py`): greedy speculative (K=3 and
adaptive) == greedy target-only on CUDA, also with CUDA graphs, structured output and reused
prefixes; top-1 agreement of the CUDA pair with the CPU pair, teacher-forced on the target-only
outputs."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gpu_plan import (
    PairInfo,
    Plan,
    all_logits,
    load_variant,
    pairs,
    prompt_ids,
    ready,
    variants,
    wait_for,
    write_part,
)


def phase_check(plan: Plan) -> None:
    try:
        check(plan)
    except Exception as exc:  # the report says why, instead of a traceback in a log
        write_part(plan, "check-error", {"error": f"{type(exc).__name__}: {str(exc)[:500]}"})
        raise


def check(plan: Plan) -> None:
    import numpy as np

    from specedge.runtime.pair import GenerationConfig, Pair

    info = pairs(plan)[0]
    result: dict[str, Any] = {"pair": str(info.folder), "provider": plan.provider}
    if not wait_for(info.folder, plan, reserve=20):
        result["error"] = f"{info.folder} was not built"
        write_part(plan, "check", result)
        return
    pair = Pair.load(info.folder, providers=plan.provider)
    # Does this provider compute a position alike in a decode step and a verification block?
    result["target_steps"] = pair.target.steps_note()
    result["row_probe"] = (dataclasses.asdict(pair.target.row_probe)
                           if pair.target.row_probe else None)
    print(f"check: target {result['target_steps']}")
    ids = prompt_ids(info, plan.check_prompts)
    base = GenerationConfig(max_new_tokens=plan.check_new, drafter="none")
    configs = {"K=3": GenerationConfig(max_new_tokens=plan.check_new, drafter="model",
                                       num_draft_tokens=3, adaptive=False),
               "adaptive": GenerationConfig(max_new_tokens=plan.check_new, drafter="model",
                                            num_draft_tokens=6, adaptive=True)}
    outputs, rows = [], []
    for i, prompt in enumerate(ids):
        ref, _, _ = pair.generate_ids(prompt, base)
        outputs.append(ref)
        row: dict[str, Any] = {"prompt": i, "tokens": len(ref)}
        for name, cfg in configs.items():
            out, _, _ = pair.generate_ids(prompt, cfg)
            row[name] = out == ref
            if out != ref:
                pos = next((j for j, (a, b) in enumerate(zip(out, ref, strict=False))
                            if a != b),
                           min(len(out), len(ref)))
                row[f"{name}_first_difference"] = pos
                row[f"{name}_target_margin"] = top2_margin(pair, prompt + ref[:pos])
        rows.append(row)
    result["equal"] = {name: sum(r[name] for r in rows) for name in configs}
    result["prompts"] = len(rows)
    result["rows"] = rows
    write_part(plan, "check", result)
    print(f"check: speculative == target-only {result['equal']} of {len(rows)} prompts")
    # Top-1 agreement, teacher-forced on prompt + target-only output: this pair on its provider
    # against the CPU pair (fp32 reference) and against this same file on the CPU provider.
    sequences = [p + o for p, o in zip(ids, outputs, strict=True)]
    starts = [len(p) - 1 for p in ids]
    mine = [all_logits(pair, s) for s in sequences]
    del pair
    others = {"cpu pair (fp32 target)": info.cpu_folder, "same file on the cpu provider":
              info.folder}
    agreement: dict[str, dict[str, Any]] = {}
    for label, folder in others.items():
        if folder is None or not ready(folder) or plan.left() < 10:
            agreement[label] = {"error": "not available (not built, or no time left)"}
            continue
        other = Pair.load(folder, providers="cpu", load_draft=False)
        same = total = 0
        max_diff = 0.0
        for seq, start, a in zip(sequences, starts, mine, strict=True):
            b = all_logits(other, seq)
            same += int((a[start:].argmax(-1) == b[start:].argmax(-1)).sum())
            total += len(seq) - start
            max_diff = max(max_diff, float(np.abs(a[start:] - b[start:]).max()))
        agreement[label] = {"top1_agreement": same / total, "positions": total,
                            "max_abs_logit_diff": max_diff, "pair": str(folder)}
        del other
    result["cuda_vs_cpu"] = agreement
    write_part(plan, "check", result)
    print(f"check: top-1 agreement {json.dumps(agreement)}")
    # Last, so the bars above come first: with each runtime variant (CUDA graphs on, the argmax
    # on the host), K=3 must give that variant's own target-only tokens (the bar). Its
    # target-only against the default's is reported beside it: CUDA graphs run on a mask as
    # long as the cache, and flash attention splits its work by that length, so fp16 sums
    # round in another order and a near-tie may flip (the margin at the first difference says).
    result["variants"] = {}
    for label, fields in variants(plan).items():
        if plan.left() < 25:
            result["variants"][label] = {"error": "no time left"}
            continue
        try:
            other = load_variant(info.folder, plan, fields)
            equal = {"target-only": 0, "K=3": 0}
            margins: list[float] = []
            done = 0
            for prompt, ref in zip(ids, outputs, strict=True):
                if plan.left() < 8:
                    break
                own = other.generate_ids(prompt, base)[0]
                equal["target-only"] += own == ref
                equal["K=3"] += other.generate_ids(prompt, configs["K=3"])[0] == own
                if own != ref:
                    pos = next((j for j, (a, b) in enumerate(zip(own, ref, strict=False))
                                if a != b), min(len(own), len(ref)))
                    margins.append(top2_margin(other, prompt + ref[:pos]))
                done += 1
            result["variants"][label] = {**equal, "prompts": done, "of": len(ids),
                                         "target_only_margins": margins}
            del other
        except Exception as exc:  # reported, not fatal
            result["variants"][label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        write_part(plan, "check", result)
    print(f"check: variants {json.dumps(result['variants'])}")
    try:
        result["prefix_cache"] = prefix_check(plan, info, ids)
    except Exception as exc:  # reported, not fatal
        result["prefix_cache"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    write_part(plan, "check", result)
    print(f"check: prefix cache {json.dumps(result['prefix_cache'])}")
    try:
        result["structured"] = structured_check(plan, info, ids)
    except Exception as exc:  # reported, not fatal
        result["structured"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    write_part(plan, "check", result)
    print(f"check: structured output {json.dumps(result['structured'])}")


STRUCTURED_SCHEMA = {"type": "object", "additionalProperties": False,
                     "required": ["answer", "confident"],
                     "properties": {"answer": {"type": "string", "maxLength": 60},
                                    "confident": {"type": "boolean"}}}


def structured_check(plan: Plan, info: PairInfo, ids: list[list[int]]) -> dict[str, Any]:
    """Structured output on this provider: every prompt answered under a JSON schema, K=3 ==
    target-only token for token (the masks follow each verification row's drafts), and how
    many finished outputs parse."""
    from specedge.runtime.grammar import Grammar
    from specedge.runtime.pair import GenerationConfig, Pair

    if plan.left() < 12:
        return {"error": "no time left"}
    pair = Pair.load(info.folder, providers=plan.provider, verify_hashes=False)
    base = GenerationConfig(max_new_tokens=plan.check_new, drafter="none",
                            grammar=Grammar.json_schema(STRUCTURED_SCHEMA))
    spec = dataclasses.replace(base, drafter="model", num_draft_tokens=3, adaptive=False)
    equal = done = finished = parsed = 0
    for prompt in ids:
        if plan.left() < 5:
            break
        ref, reason, _ = pair.generate_ids(prompt, base)
        equal += pair.generate_ids(prompt, spec)[0] == ref
        done += 1
        if reason == "eos":
            finished += 1
            try:
                parsed += isinstance(json.loads(pair.tokenizer.decode(ref)), dict)
            except ValueError:
                pass
    return {"equal": equal, "prompts": done, "of": len(ids), "finished": finished,
            "parsed": parsed}


def prefix_check(plan: Plan, info: PairInfo, ids: list[list[int]]) -> dict[str, Any]:
    """A conversation (each prompt: the last one, its output and the next prompt) on a pair that
    keeps prefixes against one that does not: the same tokens every turn (greedy, target-only
    and K=3), and how many prompt tokens each turn reused."""
    from specedge.runtime.pair import GenerationConfig, Pair

    if plan.left() < 12:
        return {"error": "no time left"}
    warm = Pair.load(info.folder, providers=plan.provider, verify_hashes=False, prefix_cache=1)
    cold = Pair.load(info.folder, providers=plan.provider, verify_hashes=False)
    configs = [GenerationConfig(max_new_tokens=plan.check_new, drafter="none"),
               GenerationConfig(max_new_tokens=plan.check_new, drafter="model",
                                num_draft_tokens=3, adaptive=False)]
    equal = turns = 0
    reused: list[int] = []
    seq: list[int] = []
    for prompt in ids:
        if plan.left() < 5 or len(seq) + len(prompt) + 2 * plan.check_new > 1500:
            break
        seq = seq + prompt
        outs = []
        for cfg in configs:
            got, _, stats = warm.generate_ids(seq, cfg)
            equal += got == cold.generate_ids(seq, cfg)[0]
            reused.append(stats.cached_tokens)
            outs.append(got)
        turns += 1
        seq = seq + outs[0]
    return {"equal": equal, "generations": 2 * turns, "turns": turns, "reused": reused}


def top2_margin(pair: Any, seq: list[int]) -> float:
    """Gap between the target's two largest logits after `seq` (how close to a tie)."""
    import numpy as np

    last = np.sort(all_logits(pair, seq)[-1])
    return float(last[-1] - last[-2])
