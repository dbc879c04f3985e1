"""Memory each pair recipe needs (weights + KV cache), for docs/jetson.md.

Usage: python benchmarks/gpu_memory_budget.py [PAIR_DIR ...]

Weights: the file sizes of built pairs where they exist (the SmolLM2-135M exports), else the
parameter count of the model's published shape times the bytes per parameter measured on the
SmolLM2-135M exports (fp32 4.017, fp16 2.009, int4 0.643 for a CPU build and 0.572 for a CUDA
build, where the builder's int4 keeps a tied table in int4); an untied embedding table stays in
float (fp32 on CPU, fp16 on CUDA) and only the rest is int4. KV cache: 2 (K and V) x layers x KV
heads x head size x bytes per element x tokens, for target and draft; float32 KV for CPU builds,
float16 for CUDA builds. The runtime allocates the cache per generation for prompt + new tokens +
K + 1, at most the model's context (`max_seq_len` in the manifest), so both ends are shown.
Printed, nothing measured: this is arithmetic on shapes and file sizes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_models import SHAPES, Shape  # noqa: E402

GB = 1e9
# bytes per parameter measured on the SmolLM2-135M exports (134,515,008 parameters):
# fp32 target 540,328,112 B; fp16 (CUDA) target 270,249,432 B; int4 CPU draft 86,513,245 B;
# int4 CUDA draft 76,985,791 B (model.onnx + model.onnx.data)
BYTES_PER_PARAM = {("fp32", "cpu"): 4.017, ("fp16", "cuda"): 2.009, ("int4", "cpu"): 0.643,
                   ("int4", "cuda"): 0.572}

HUB = {  # the published config.json shapes of the hub recipes' models
    "SmolLM2-1.7B": Shape("llama", 2048, 8192, 24, 32, 32, 49152, 8192, True, 1.3e5, 1e-5),
    "Qwen2.5-7B": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, 32768, False, 1e6),
    "Llama-3.1-8B": Shape("llama", 4096, 14336, 32, 32, 8, 128256, 131072, False, 5e5, 1e-5),
    "Llama-2-7B": Shape("llama", 4096, 11008, 32, 32, 32, 32000, 4096, False, 1e4, 1e-5),
    "TinyLlama-1.1B": Shape("llama", 2048, 5632, 22, 32, 4, 32000, 2048, False, 1e4, 1e-5),
    "SmolLM2-135M": SHAPES["smollm2-135m"], "Qwen2.5-1.5B": SHAPES["qwen2.5-1.5b"],
    "Qwen2.5-0.5B": SHAPES["qwen2.5-0.5b"], "Llama-3.2-1B": SHAPES["llama-3.2-1b"],
}


@dataclass(frozen=True)
class Recipe:
    """A pair recipe: target and draft models with their precisions."""

    name: str
    target: str
    target_precision: str
    draft: str
    draft_precision: str


RECIPES = [
    Recipe("smollm2-135m-gpu.sh", "SmolLM2-135M", "fp16", "SmolLM2-135M", "int4"),
    Recipe("smollm2-135m-reference.sh (CPU build)", "SmolLM2-135M", "fp32", "SmolLM2-135M",
           "int4"),
    Recipe("hub-pairs.sh smollm2", "SmolLM2-1.7B", "fp32", "SmolLM2-135M", "int4"),
    Recipe("hub-pairs.sh qwen25-1.5b", "Qwen2.5-1.5B", "fp32", "Qwen2.5-0.5B", "int4"),
    Recipe("hub-pairs.sh qwen25-7b", "Qwen2.5-7B", "int4", "Qwen2.5-0.5B", "int4"),
    Recipe("hub-pairs.sh llama3", "Llama-3.1-8B", "int4", "Llama-3.2-1B", "int4"),
    Recipe("hub-pairs.sh tinyllama-llama2", "Llama-2-7B", "int4", "TinyLlama-1.1B", "int4"),
]


def weight_bytes(shape: Shape, precision: str, build: str) -> float:
    """Estimated file bytes of one model exported at `precision` for `build` ("cpu"/"cuda")."""
    if precision == "fp32" and build == "cuda":
        precision = "fp16"  # on a GPU the recipes' fp32 targets are exported as fp16
    if precision == "fp16" and build == "cpu":
        precision = "fp32"
    rate = BYTES_PER_PARAM[(precision, build)]
    if precision != "int4" or shape.tie_word_embeddings:
        return shape.parameters * rate
    embedding = shape.vocab_size * shape.hidden_size
    return (shape.parameters - embedding) * rate + embedding * (4 if build == "cpu" else 2)


def kv_bytes_per_token(shape: Shape, build: str) -> float:
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * (
        4 if build == "cpu" else 2)


def measured_weights(pair_dir: Path) -> dict[str, float]:
    """Bytes of each model's files in a built pair (from its manifest)."""
    manifest = json.loads((pair_dir / "specedge.json").read_text())
    out = {}
    for name, spec in manifest["models"].items():
        if spec:
            out[name] = float(sum((pair_dir / f).stat().st_size for f in spec["files"]))
    return out


def budget(recipe: Recipe, build: str, tokens: int | None) -> dict[str, float]:
    """Weights and KV (at `tokens`, None: each model's full context) in bytes."""
    t, d = HUB[recipe.target], HUB[recipe.draft]
    context = min(t.max_position_embeddings, d.max_position_embeddings)
    n = context if tokens is None else min(tokens, context)
    return {"target_weights": weight_bytes(t, recipe.target_precision, build),
            "draft_weights": weight_bytes(d, recipe.draft_precision, build),
            "kv": n * (kv_bytes_per_token(t, build) + kv_bytes_per_token(d, build)),
            "tokens": float(n), "context": float(context)}


def main(argv: list[str]) -> int:
    for pair in argv:
        print(f"measured files of {pair}: " + ", ".join(
            f"{k} {v / 1e6:.1f} MB" for k, v in measured_weights(Path(pair)).items()))
    print("| recipe | build | target weights | draft weights | KV per 1k tokens | "
          "total at 2k tokens | context | total at full context |")
    print("|---|---|---|---|---|---|---|---|")
    for recipe in RECIPES:
        for build in ("cuda", "cpu"):
            small, full = budget(recipe, build, 2048), budget(recipe, build, None)
            t, d = HUB[recipe.target], HUB[recipe.draft]
            per_k = 1024 * (kv_bytes_per_token(t, build) + kv_bytes_per_token(d, build))
            w = small["target_weights"] + small["draft_weights"]
            print(f"| {recipe.name} | {build} | {small['target_weights'] / GB:.2f} GB | "
                  f"{small['draft_weights'] / GB:.3f} GB | {per_k / GB:.3f} GB | "
                  f"{(w + small['kv']) / GB:.2f} GB | {full['context']:.0f} | "
                  f"{(w + full['kv']) / GB:.2f} GB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
