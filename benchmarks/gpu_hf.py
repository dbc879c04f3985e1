"""The GPU check's `hf` phase (`benchmarks/gpu_check.py`): transformers `generate` and assisted
generation with the draft on the GPU (fp16), on the same prompt ids."""

from __future__ import annotations

import json
import time
from typing import Any

from gpu_plan import Plan, pairs, write_part

HF_PROMPTS = 4  # transformers runs the first prompts only: it is the slowest system by far


def phase_hf(plan: Plan) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if plan.provider == "cuda" and torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    result: dict[str, Any] = {"device": device, "dtype": str(dtype)}
    for info in pairs(plan):
        prompts_file = plan.work / "prompts" / f"{info.name}.json"
        if info.target_hf is None or not (info.target_hf / "config.json").is_file() \
                or not prompts_file.is_file() or plan.left() < (4 if plan.smoke else 15):
            result[info.name] = {"error": "no HF folder, no prompts from bench, or no time"}
            continue
        ids = json.loads(prompts_file.read_text())
        model: Any = AutoModelForCausalLM.from_pretrained(str(info.target_hf), dtype=dtype)
        model = model.to(device).eval()
        assistant: Any = None
        kind = None
        if info.draft_hf is not None:
            kind = "same model" if info.draft_hf == info.target_hf else "draft-shaped model"
            assistant = model if info.draft_hf == info.target_hf else \
                AutoModelForCausalLM.from_pretrained(str(info.draft_hf), dtype=dtype)
            assistant = assistant.to(device).eval()
        k = best_k(plan, info.name)
        runs: dict[str, list[tuple[int, float]]] = {"transformers generate": []}
        if assistant is not None:
            runs[f"transformers assisted (K={k}, {kind})"] = []
        for label in runs:  # warm-up: allocations, kernels, assisted generation's setup
            hf_generate(model, assistant if "assisted" in label else None, ids[0], 8, k, device)
        for prompt in ids[:HF_PROMPTS]:
            for label in runs:
                runs[label].append(hf_generate(model, assistant if "assisted" in label else None,
                                               prompt, plan.bench_new, k, device))
            if plan.left() < 10:
                break
        result[info.name] = {label: {"e2e_tokens_per_s": sum(n for n, _ in r) / sum(s for _, s in r)
                                     if r else float("nan"), "generations": len(r)}
                             for label, r in runs.items()}
        write_part(plan, "hf", result)
        print(f"hf {info.name}: {json.dumps(result[info.name])}")
        del model, assistant
        if device == "cuda":
            torch.cuda.empty_cache()
    write_part(plan, "hf", result)


def best_k(plan: Plan, name: str) -> int:
    """specedge's fastest fixed K on this pair (from bench), else 3."""
    try:
        data = json.loads((plan.parts / f"bench-{name}.json").read_text())["settings"]
    except (OSError, KeyError, json.JSONDecodeError):
        return 3
    fixed = {int(k.split("=")[1]): v["decode_tokens_per_s"] for k, v in data.items()
             if k.startswith("specedge K=") and "," not in k}
    return max(fixed, key=fixed.__getitem__) if fixed else 3


def hf_generate(model: Any, assistant: Any, prompt: list[int], new: int, k: int,
                device: str) -> tuple[int, float]:
    """One greedy generate() (assisted with a fixed K when `assistant`), end to end."""
    import torch

    ids = torch.tensor([prompt], device=device)
    kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=new, do_sample=False, num_beams=1,
                                  pad_token_id=model.generation_config.pad_token_id or 0)
    if assistant is not None:
        gc = assistant.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = k, "constant"
        gc.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    return int(out.shape[1] - len(prompt)), time.perf_counter() - t0
