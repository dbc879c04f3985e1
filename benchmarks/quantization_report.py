"""Collect the quality reports of quantized pairs into a markdown table.

Usage: python benchmarks/quantization_report.py OUT.md PAIR [PAIR ...]
Each PAIR was written by `specedge quantize SRC -o PAIR --method M`; the report compares its
quantized target with the source pair's fp32 target (held-out perplexity, KL, top-1, greedy).
"""

from __future__ import annotations

import sys
from pathlib import Path

from specedge.runtime.manifest import load_manifest


def main(out: Path, pairs: list[Path]) -> None:
    lines = ["# Quantized SmolLM2-135M targets against the fp32 model", "",
             "Each row: `specedge quantize pairs/smollm2-135m -o PAIR --method M --samples 16` "
             "(built-in calibration sample, 16 texts x prefill + 1/3/5-token steps with a real "
             "past), then `python benchmarks/quantization_report.py` over the folders. Held-out "
             "text: 6 paragraphs disjoint from the calibration data.", "",
             "| method | activations | calibrated | perplexity (fp32) | KL vs fp32 | top-1 vs fp32 "
             "| greedy outputs that differ (of 8) | time (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for pair in pairs:
        m = load_manifest(pair, verify_hashes=False)
        q = m.target.validation.get("quality", {})
        src = m.target.source.get("quantization", {})
        g = q.get("greedy_vs_reference", {})
        method = src.get("method", "?")
        calibrated = "yes" if src.get("calibration_inputs") else "no"
        acts = ("int8 (accuracy level 4)" if src.get("accuracy_level", 4) == 4 else "fp32")
        if method.startswith("int8"):
            acts = "int8 per-tensor, " + ("dynamic" if method == "int8-dynamic" else "static")
        elif method == "fp16":
            acts = "fp16 (attention and norms fp32)"
        elif method == "fp8":
            acts = "fp8 E4M3 per-tensor, static"
        if src.get("symmetric") is False:
            method += " (asymmetric)"
        ppl = q.get("perplexity", float("nan"))
        lines.append(f"| {method} | {acts} | {calibrated} | {ppl:.2f} "
                     f"({q.get('reference_perplexity', float('nan')):.2f}) | "
                     f"{q.get('kl_mean', float('nan')):.4f} | "
                     f"{q.get('top1_agreement', float('nan')):.3f} | {g.get('differ', '?')} | "
                     f"{src.get('seconds', '?')} |")
    notes = Path(str(out) + ".notes")
    if notes.is_file():
        lines += ["", notes.read_text().strip()]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
