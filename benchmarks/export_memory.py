"""Build the synthetic llama-shaped model that docs/results/export.md measures export memory on.

    .venv/bin/python benchmarks/export_memory.py /tmp/synth-545m
    /usr/bin/time -v .venv/bin/specedge export /tmp/synth-545m -o /tmp/synth-pair \
        --precision fp32 --draft-precision int4 --force

Random weights (seeded), the tiny test tokenizer, a 32k vocabulary and tied embeddings:
about 545M parameters, 2.2 GB of fp32 weights (past protobuf's 2 GB limit for one file).
"""

from __future__ import annotations

import sys
from pathlib import Path

SIZES = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=20,
             num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
             max_position_embeddings=2048)


def main(argv: list[str]) -> int:
    from specedge.exporter.tiny import make_tiny_model

    folder = Path(argv[0] if argv else "/tmp/synth-545m")
    make_tiny_model("llama", folder, seed=0, init_std=0.02, tied=True, sizes=SIZES)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"{folder}: {weights / 1e9:.2f} GB of fp32 weights")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
