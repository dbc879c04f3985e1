"""Supported model families, as data.

Each family is one small spec: which Hugging Face architecture class it is, how it is turned into
ONNX (the graph form), and a tiny config for the seeded test model. Nothing else in specedge
branches on an architecture name; the manifest carries everything the runtime needs.

Graph forms:
- "gqa-shared": ONNX Runtime GenAI's model builder, GroupQueryAttention with one KV buffer per
  layer bound as past and present (in-place cache, O(1) rollback).
- "concat": present = concat(past, new), for batched verification; the runtime copies the valid
  cache prefix each call. For the builder's families, the builder's graph with its attention
  rewritten (`concat_form`); for families the builder does not cover (and `--graph
  concat-standard`), a torch.onnx export with standard ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specedge.runtime.errors import ExportError


@dataclass(frozen=True)
class ArchSpec:
    """One model family."""

    model_type: str  # config.model_type in transformers
    architecture: str  # config.architectures[0]
    graph: str  # "gqa-shared" | "concat"
    tiny_config: dict[str, Any] = field(default_factory=dict)
    notes: str = ""


_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-5)

ARCHS: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        ArchSpec("llama", "LlamaForCausalLM", "gqa-shared", dict(_LLAMA_LIKE),
                 "SmolLM2, TinyLlama, Llama 2/3.x"),
        ArchSpec("mistral", "MistralForCausalLM", "gqa-shared",
                 dict(_LLAMA_LIKE, sliding_window=None)),
        ArchSpec("qwen2", "Qwen2ForCausalLM", "gqa-shared", dict(_LLAMA_LIKE),
                 "Qwen2 / Qwen2.5"),
        ArchSpec("qwen3", "Qwen3ForCausalLM", "gqa-shared", dict(_LLAMA_LIKE, head_dim=16)),
        ArchSpec("phi3", "Phi3ForCausalLM", "gqa-shared",
                 dict(_LLAMA_LIKE, num_key_value_heads=4, pad_token_id=0,
                      original_max_position_embeddings=512), "Phi-3 / Phi-3.5 / Phi-4-mini"),
        ArchSpec("gemma", "GemmaForCausalLM", "gqa-shared", dict(_LLAMA_LIKE, head_dim=16)),
        ArchSpec("gemma2", "Gemma2ForCausalLM", "gqa-shared",
                 dict(_LLAMA_LIKE, head_dim=16, sliding_window=64, query_pre_attn_scalar=16)),
        ArchSpec("gemma3_text", "Gemma3ForCausalLM", "gqa-shared",
                 dict(_LLAMA_LIKE, head_dim=16, sliding_window=64, query_pre_attn_scalar=16,
                      sliding_window_pattern=2)),
        ArchSpec("smollm3", "SmolLM3ForCausalLM", "gqa-shared",
                 dict(_LLAMA_LIKE, no_rope_layer_interval=2), "SmolLM3"),
        ArchSpec("granite", "GraniteForCausalLM", "gqa-shared",
                 dict(_LLAMA_LIKE, embedding_multiplier=2.0, attention_multiplier=0.2,
                      residual_multiplier=0.5, logits_scaling=4.0), "Granite 3.x"),
        ArchSpec("ernie4_5", "Ernie4_5ForCausalLM", "gqa-shared", dict(_LLAMA_LIKE, head_dim=16),
                 "ERNIE 4.5"),
        ArchSpec("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", "gqa-shared",
                 dict(_LLAMA_LIKE, head_dim=16), "Hunyuan dense"),
        ArchSpec("gpt2", "GPT2LMHeadModel", "concat",
                 dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    )
}


def default_graph(spec: ArchSpec, config: Any) -> str:
    """The graph form a model exports in by default: its family's, except that a Gemma 3 whose
    rotary scaling the builder cannot take (see `builder_shim`) stays in the concat form."""
    from .builder_shim import flattenable

    if spec.graph == "gqa-shared" and not flattenable(config):
        return "concat"
    return spec.graph


def supported() -> str:
    return ", ".join(sorted(ARCHS))


def arch_for(config: Any, *, where: str) -> ArchSpec:
    """The spec for a transformers config, or a clear error listing the supported families."""
    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    spec = ARCHS.get(str(model_type))
    if spec is None:
        raise ExportError(
            f"{where}: model type {model_type!r} ({', '.join(archs) or 'no architectures'}) is not "
            f"supported; supported model types: {supported()}"
        )
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ExportError(
            f"{where}: {', '.join(archs)} is not a causal language model; specedge exports "
            "causal LMs (…ForCausalLM)"
        )
    return spec
