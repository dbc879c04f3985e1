"""Tiny seeded random models, built in seconds from a config, for tests and demos.

`make_tiny_model("llama", folder, seed=0)` writes a complete Hugging Face folder (config,
safetensors, a small byte-level BPE tokenizer trained in memory, tokenizer_config.json and a chat
template) for any family in `archs.ARCHS`. Same seed, same weights. `permute_vocab` and
`truncate_vocab` copy a model folder under another tokenizer (for drafts with their own
tokenizer, `vocab_bridge.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .archs import ARCHS

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "def add(a, b):\n    return a + b\n",
    "héllo wörld, 日本語のテキスト, emoji 🙂🚀 and numbers 0123456789.",
    "Edge devices like Jetson run small language models with TensorRT.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Train a small byte-level BPE tokenizer and save it; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return int(tok.get_vocab_size(with_added_tokens=True))


def make_tiny_model(model_type: str, folder: Path, *, seed: int = 0, num_layers: int | None = None,
                    init_std: float = 0.1, tied: bool = False,
                    sizes: dict[str, int] | None = None) -> Path:
    """Write a tiny random model of family `model_type` (see `archs.ARCHS`) to `folder`.

    `tied` ties the LM head to the embedding; `sizes` overrides config entries (e.g.
    hidden_size, num_hidden_layers) to build larger synthetic models for memory measurements.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = ARCHS[model_type]
    vocab = make_tokenizer(folder)
    kwargs = dict(spec.tiny_config, **(sizes or {}))
    if num_layers is not None:
        kwargs["n_layer" if model_type == "gpt2" else "num_hidden_layers"] = num_layers
    vocab = max(vocab, int(kwargs.pop("vocab_size", vocab)))  # ids past the tokenizer's are unused
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        initializer_range=init_std, tie_word_embeddings=tied, architectures=[spec.architecture],
        **{k: v for k, v in kwargs.items() if k != "pad_token_id"},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Norm weights start at 1 (or 0 for gemma's 1+w form); jitter them so every weight matters.
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.05)
    model.eval()
    model.save_pretrained(str(folder))
    return folder


# ----------------------------------------------- vocabulary variants (vocab_bridge tests, bench)


def _rewrite_rows(src: Path, dst: Path, rows: Any, vocab_size: int) -> None:
    """Copy HF folder `src` to `dst` with the embedding (and untied head) rows taken in the
    order of `rows` (a torch index), the config's vocab_size set to `vocab_size`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    for key in list(weights):
        if key.endswith(("embed_tokens.weight", "lm_head.weight", "wte.weight")):
            weights[key] = weights[key][rows].contiguous()
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def permute_vocab(src: Path, dst: Path, seed: int = 0) -> Path:
    """The model of HF folder `src` under other ids: its non-special BPE tokens' ids shuffled,
    embedding and head rows moved with them, written to `dst`."""
    import numpy as np
    import torch

    doc = json.loads((src / "tokenizer.json").read_text())
    special = {t["id"] for t in doc["added_tokens"]}
    ids = sorted(set(doc["model"]["vocab"].values()) - special)
    perm = dict(zip(ids, np.random.default_rng(seed).permutation(ids).tolist(), strict=True))
    rows = json.loads((src / "config.json").read_text())["vocab_size"]
    order = torch.arange(rows)
    for old, new in perm.items():
        order[new] = old  # row `new` of the copy is row `old` of the source
    _rewrite_rows(src, dst, order, rows)
    doc["model"]["vocab"] = {tok: perm.get(i, i) for tok, i in doc["model"]["vocab"].items()}
    (dst / "tokenizer.json").write_text(json.dumps(doc))
    return dst


def truncate_vocab(src: Path, dst: Path, size: int) -> Path:
    """The model of HF folder `src` with a smaller tokenizer: only its BPE tokens of id < `size`
    and the merges that make them, embedding and head cut to `size` rows, written to `dst`."""
    import torch

    doc = json.loads((src / "tokenizer.json").read_text())
    vocab = {tok: i for tok, i in doc["model"]["vocab"].items() if i < size}

    def kept(merge: Any) -> bool:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        return left in vocab and right in vocab and left + right in vocab

    doc["model"]["vocab"] = vocab
    doc["model"]["merges"] = [m for m in doc["model"]["merges"] if kept(m)]
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["id"] < size]
    _rewrite_rows(src, dst, torch.arange(size), size)
    (dst / "tokenizer.json").write_text(json.dumps(doc))
    return dst
