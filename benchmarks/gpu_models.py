"""Realistic-shape models with random weights, and the arithmetic of what a token costs.

`make_shaped_model("qwen2.5-1.5b", folder)` writes a Hugging Face folder whose config has the
published shape of Qwen2.5-1.5B (layers, widths, heads, vocabulary) and seeded random weights,
plus a word-level tokenizer with exactly the model's vocabulary (`w3 w17 ...`), so a pair
exported from it loads and decodes like a real one. Acceptance on such pairs means nothing; their
per-call costs and bytes per token are what they are for. The weights are made on the GPU when
there is one (seconds for 1.5B parameters) and saved in fp16.

`bytes_per_token` is the roofline arithmetic: the bytes one decode step of the target reads from
memory (every weight once, except an untied embedding table of which one row is gathered, plus
the KV cache of the context), and `roofline_tokens_per_s` divides a bandwidth by it. With tied
embeddings the ONNX Runtime GenAI builder stores one table, which the LM head reads whole (a
2-layer Qwen2.5-0.5B-shaped fp16 export is 336 MB: 60 MB of layers and one 272 MB table).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{{ message['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """The published shape of a model family member (config.json values)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tokenizer_size: int | None = None  # the tokenizer's ids (None: vocab_size); the table pads

    @property
    def tokens(self) -> int:
        return self.tokenizer_size or self.vocab_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def parameters(self) -> int:
        """Weights, counted from the shapes (qwen2's q/k/v biases included)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads
        attn = h * h * 2 + h * kv * self.head_dim * 2  # q, o, k, v
        if self.model_type == "qwen2":
            attn += h + 2 * kv * self.head_dim
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h


SHAPES: dict[str, Shape] = {
    # Qwen/Qwen2.5-1.5B-Instruct and Qwen/Qwen2.5-0.5B-Instruct config.json; one tokenizer of
    # 151,665 ids for the family, tables padded to 151,936 (<= 3B) or 152,064 (7B and up)
    "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 151936, 32768, True, 1e6,
                          tokenizer_size=151665),
    "qwen2.5-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 151936, 32768, True, 1e6,
                          tokenizer_size=151665),
    # Qwen/Qwen2.5-7B-Instruct config.json: an edge target of the Jetson AGX Orin class, whose
    # decode step on an H200 reads 15 GB, so bound by memory, with Qwen2.5-0.5B as its draft
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, 32768, False, 1e6,
                        tokenizer_size=151665),
    # meta-llama/Llama-3.2-1B-Instruct config.json (its llama3 rope scaling left out: random
    # weights do not care, and the cost of a step does not change)
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 128256, 131072, True, 5e5, 1e-5),
    # HuggingFaceTB/SmolLM2-135M-Instruct (for the arithmetic; the real weights come from GGUF)
    "smollm2-135m": Shape("llama", 576, 1536, 30, 9, 3, 49152, 8192, True, 1e5, 1e-5),
    # for the CPU smoke run of scripts/gpu_check.sh
    "tiny": Shape("llama", 64, 128, 2, 4, 2, 512, 512, False, 1e4, 1e-5, tokenizer_size=400),
    # its draft, padded to fewer ids (as Qwen2.5-0.5B beside Qwen2.5-7B)
    "tiny-draft": Shape("llama", 64, 128, 1, 4, 2, 448, 512, False, 1e4, 1e-5,
                        tokenizer_size=400),
}


def shape_of(config: dict[str, Any]) -> Shape:
    """A Shape from a config.json dict (for the real reference model)."""
    return Shape(config["model_type"], config["hidden_size"], config["intermediate_size"],
                 config["num_hidden_layers"], config["num_attention_heads"],
                 config.get("num_key_value_heads") or config["num_attention_heads"],
                 config["vocab_size"], config.get("max_position_embeddings", 2048),
                 bool(config.get("tie_word_embeddings", False)),
                 float(config.get("rope_theta", 10000.0)), float(config.get("rms_norm_eps", 1e-6)))


def make_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer with exactly `vocab_size` tokens: the specials, then `w3`..."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIALS))  # split out of "w5<|im_end|>" as their own ids
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[2], "pad_token": SPECIALS[0], "unk_token": SPECIALS[0],
        "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE}, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def make_shaped_model(name: str, folder: Path, *, seed: int = 0, device: str | None = None,
                      dtype: str = "float16") -> Path:
    """Write an HF folder with shape `SHAPES[name]` and seeded random weights (see module doc).

    Nothing is written again when `folder/config.json` exists (the GPU machine keeps /tmp while
    it stays up, so a second run skips the minutes this takes on a CPU).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    s = SHAPES[name]
    make_word_tokenizer(folder, s.tokens)
    fields = {k: v for k, v in asdict(s).items() if k not in ("model_type", "tokenizer_size")}
    config = AutoConfig.for_model(s.model_type, bos_token_id=0, eos_token_id=2, pad_token_id=0,
                                  architectures=[{"llama": "LlamaForCausalLM",
                                                  "qwen2": "Qwen2ForCausalLM"}[s.model_type]],
                                  **fields)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.eval()
    model.save_pretrained(str(folder))
    del model
    return folder


def weight_bytes(pair_dir: Path, name: str = "target") -> int:
    """Bytes of one model's ONNX files in a pair folder (graph + external data)."""
    folder = pair_dir / name
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.onnx"))


def bytes_per_token(weights: int, shape: Shape, context: int, kv_bytes: int = 2,
                    weight_elem_bytes: float = 2.0) -> dict[str, float]:
    """What one decode step of a target reads: the weights once (less an untied embedding
    table, of which one row is gathered; a tied one is the LM head, read whole) and the KV cache
    of `context` tokens.

    Args:
        weights: bytes of the model's files (`weight_bytes`).
        shape: the model's shape.
        context: tokens in the KV cache.
        kv_bytes: bytes per KV element (2 for fp16).
        weight_elem_bytes: bytes per element of the embedding table in the file.
    """
    embedding = 0.0 if shape.tie_word_embeddings else \
        shape.vocab_size * shape.hidden_size * weight_elem_bytes
    kv = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * context \
        * kv_bytes
    read = max(0.0, weights - embedding) + kv
    return {"weights_bytes": float(weights), "embedding_bytes": embedding, "kv_bytes": float(kv),
            "bytes_per_token": read, "context": float(context)}


def roofline_tokens_per_s(bytes_per_token_: float, bandwidth_bytes_per_s: float) -> float:
    """The memory-bound ceiling of target-only decoding: bandwidth / bytes per token."""
    return bandwidth_bytes_per_s / bytes_per_token_ if bytes_per_token_ > 0 else float("nan")
