#!/usr/bin/env bash
# Check the module dependency rules ([tool.importlinter] in pyproject.toml) with import-linter.
# import-linter finds a package's modules on the file system under the package's folder, but
# pyproject's package-dir puts specedge.runtime in runtime/ (and exporter/, calibration/), not in
# specedge/: so give it the installed layout as a tree of symlinks.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LINT_IMPORTS=${LINT_IMPORTS:-$ROOT/.venv/bin/lint-imports}
view=$(mktemp -d)
trap 'rm -rf "$view"' EXIT
mkdir "$view/specedge"
ln -s "$ROOT"/specedge/*.py "$view/specedge/"
for part in runtime exporter calibration; do
  ln -s "$ROOT/$part" "$view/specedge/$part"
done
ln -s "$ROOT/pyproject.toml" "$view/pyproject.toml"
cd "$view"  # lint-imports puts the working folder first on sys.path
PYTHONPATH="$view" "$LINT_IMPORTS" --no-cache "$@"
