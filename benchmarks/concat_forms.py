"""The two concat forms side by side, in one run: what batched verification costs in each.

`--graph concat` now rewrites the model builder's graph (`exporter/concat_form.py`: its fused
norms and weights kept, GroupQueryAttention replaced by standard-op attention under a mask);
`--graph concat-standard` is the torch export it replaces as the default. This script loads one
pair of each (the same model and precisions) and measures, interleaved batch size by batch
size so drift hits both alike:

- graph size: nodes in the file and in ONNX Runtime's optimized graph (CPU provider, all
  optimizations), and how many of those compute int64 shapes (the per-call host work that
  stays on the CPU provider on a GPU);
- per-call costs (`runtime.batch_bench.measure_batch_costs`): verify(B, s) for s = 1, 3, 5 and
  the draft's step, B rows after a past of 128 tokens, median of 7;
- aggregate greedy tok/s of `generate_batch` for target-only and K=3 over the same prompts,
  and whether each row's tokens are the same in both forms.

Usage:
    python benchmarks/concat_forms.py pairs/smollm2-135m-concat pairs/smollm2-135m-concat-std \\
        --batch 1,2,4,8 --out docs/results/concat_forms.md
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from specedge.runtime.batch_bench import measure_batch_costs
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts

SHAPE_OPS = {"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Range", "Equal",
             "Where", "Cast", "Expand", "ConstantOfShape", "Add", "Sub", "Mul", "Div", "Less",
             "LessOrEqual", "And", "Not", "Reshape", "Tile"}


def graph_size(model_path: Path) -> dict[str, Any]:
    """Nodes in the file and after ONNX Runtime's optimizations on the CPU provider."""
    raw = onnx.load(str(model_path), load_external_data=False)
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                    "opt.onnx.data")
        ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        opt = onnx.load(str(Path(tmp) / "opt.onnx"), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(opt, strict_mode=False)
    int64 = {v.name for v in list(inferred.graph.value_info) + list(inferred.graph.input)
             if v.type.tensor_type.elem_type == onnx.TensorProto.INT64}
    shape_nodes = sum(1 for n in opt.graph.node if n.op_type in SHAPE_OPS
                      and n.output and n.output[0] in int64)
    return {"file_nodes": len(raw.graph.node), "optimized_nodes": len(opt.graph.node),
            "int64_shape_nodes": shape_nodes,
            "top_ops": Counter(n.op_type for n in opt.graph.node).most_common(6)}


def throughput(pair: Pair, prompts: list[str], batch: int, k: int,
               max_new: int) -> tuple[float, list[list[int]]]:
    cfg = GenerationConfig(max_new_tokens=max_new, drafter="model" if k else "none",
                           num_draft_tokens=k or None, adaptive=False)
    tokens, seconds, rows = 0, 0.0, []
    for start in range(0, len(prompts) // batch * batch, batch):
        result = pair.generate_batch(prompts[start:start + batch], cfg)
        tokens += result.stats.new_tokens
        seconds += result.stats.decode_s
        rows += [r.tokens for r in result.results]
    return tokens / seconds, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fused", type=Path)
    ap.add_argument("standard", type=Path)
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    forms = {"fused (builder + rewrite)": args.fused, "standard (torch export)": args.standard}
    # Sizes first: loading a pair gives this process ONNX Runtime's shared thread pool.
    sizes = {name: {m: graph_size(path / m / "model.onnx") for m in ("target", "draft")}
             for name, path in forms.items()}
    pairs = {name: Pair.load(path) for name, path in forms.items()}
    prompts = list(default_prompts())[:args.prompts]
    results: dict[str, Any] = {"batches": {}, "sizes": sizes}
    for pair in pairs.values():  # warm both
        pair.generate_batch(prompts[:2], GenerationConfig(max_new_tokens=4))
    for batch in batches:
        entry: dict[str, Any] = {}
        outputs: dict[str, dict[int, list[list[int]]]] = {}
        for name, pair in pairs.items():
            costs = measure_batch_costs(pair, batch, (2, 4))
            rates, outs = {}, {}
            for k in (0, args.k):
                rates[k], outs[k] = throughput(pair, prompts, batch, k, args.max_new_tokens)
            entry[name] = {"costs_ms": {c: v * 1e3 for c, v in costs.items()},
                           "tok_s": {str(k): r for k, r in rates.items()}}
            outputs[name] = outs
        a, b = (outputs[n][0] for n in forms)
        entry["rows_equal_across_forms"] = [sum(x == y for x, y in zip(a, b, strict=True)),
                                            len(a)]
        for name in forms:
            o = outputs[name]
            entry[name]["spec_equals_target_only"] = [
                sum(x == y for x, y in zip(o[0], o[args.k], strict=True)), len(o[0])]
        results["batches"][str(batch)] = entry
        print(json.dumps({batch: entry}))
    report = render(results, forms, args, batches)
    print(report)
    if args.out:
        args.out.write_text(report)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


def render(results: dict[str, Any], forms: dict[str, Path], args: argparse.Namespace,
           batches: list[int]) -> str:
    names = list(forms)
    lines = [
        "# The two concat forms: batched verification on this CPU",
        "",
        f"`python benchmarks/concat_forms.py {args.fused} {args.standard} --batch "
        f"{args.batch} --prompts {args.prompts} --max-new-tokens {args.max_new_tokens} "
        f"--k {args.k}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} cores, one process, batch sizes interleaved. Raw: the .json beside "
        "this file.",
        "",
        "## Graph size",
        "",
        "| form | model | nodes in the file | after ORT optimization (CPU) | int64 shape nodes |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        for m, s in results["sizes"][name].items():
            lines.append(f"| {name} | {m} | {s['file_nodes']} | {s['optimized_nodes']} | "
                         f"{s['int64_shape_nodes']} |")
    lines += ["", "## Per-call costs (ms, B rows after a past of 128) and throughput", "",
              "| B | form | verify(B,1) | verify(B,3) | verify(B,5) | draft step | "
              f"target-only tok/s | K={args.k} tok/s | K={args.k} / target-only | "
              "greedy rows equal to target-only |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for batch in batches:
        entry = results["batches"][str(batch)]
        for name in names:
            e = entry[name]
            c, t = e["costs_ms"], e["tok_s"]
            eq = e["spec_equals_target_only"]
            lines.append(
                f"| {batch} | {name} | {c['verify_1']:.1f} | {c['verify_3']:.1f} | "
                f"{c['verify_5']:.1f} | {c.get('draft_step', float('nan')):.1f} | "
                f"{t['0']:.1f} | {t[str(args.k)]:.1f} | {t[str(args.k)] / t['0']:.2f}x | "
                f"{eq[0]}/{eq[1]} |")
    lines += ["", "Speed of the fused form over the standard one (same batch, same setting):", ""]
    for batch in batches:
        entry = results["batches"][str(batch)]
        f, s = (entry[n] for n in names)
        ratios = [f"verify(B,1) {s['costs_ms']['verify_1'] / f['costs_ms']['verify_1']:.2f}x",
                  f"target-only {f['tok_s']['0'] / s['tok_s']['0']:.2f}x",
                  f"K={args.k} {f['tok_s'][str(args.k)] / s['tok_s'][str(args.k)]:.2f}x"]
        eq = entry["rows_equal_across_forms"]
        lines.append(f"- B={batch}: {', '.join(ratios)}; target-only rows equal across the "
                     f"forms {eq[0]}/{eq[1]}")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
