#!/usr/bin/env bash
# Hub pairs users would pick (need a network; not tested on the offline machine).
# Usage: models/hub-pairs.sh NAME [OUTPUT_FOLDER]   (NAME: see models/README.md)
set -euo pipefail
NAME=${1:?usage: models/hub-pairs.sh NAME [OUT]}
OUT=${2:-pairs/$NAME}
case "$NAME" in
  smollm2) T=HuggingFaceTB/SmolLM2-1.7B-Instruct; TP=fp32; D=HuggingFaceTB/SmolLM2-135M-Instruct ;;
  qwen25-1.5b) T=Qwen/Qwen2.5-1.5B-Instruct; TP=fp32; D=Qwen/Qwen2.5-0.5B-Instruct ;;
  qwen25-7b) T=Qwen/Qwen2.5-7B-Instruct; TP=int4; D=Qwen/Qwen2.5-0.5B-Instruct ;;
  llama3) T=meta-llama/Llama-3.1-8B-Instruct; TP=int4; D=meta-llama/Llama-3.2-1B-Instruct ;;
  tinyllama-llama2) T=meta-llama/Llama-2-7b-chat-hf; TP=int4; D=TinyLlama/TinyLlama-1.1B-Chat-v1.0 ;;
  mistral-qwen25) T=mistralai/Mistral-7B-Instruct-v0.3; TP=int4; D=Qwen/Qwen2.5-0.5B-Instruct ;;
  *) echo "error: unknown pair '$NAME' (see models/README.md)" >&2; exit 2 ;;
esac
exec specedge export "$T" --precision "$TP" --draft "$D" --draft-precision int4 -o "$OUT"
