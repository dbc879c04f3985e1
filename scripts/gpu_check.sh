#!/usr/bin/env bash
# The GPU check of issue 13: build realistic pairs on the GPU machine, check greedy speculative ==
# target-only and CUDA vs CPU agreement, measure specedge against ORT GenAI CUDA and transformers,
# measure batched decoding (issue 19), and write OUT/gpu_h200.md + OUT/gpu_h200.json, and
# OUT/gpu_batching.md for the batch figures (OUT: $OUT when set, else docs/results).
#
# On the GPU machine, after the staged wheels have arrived (../shared/gpu/stage.sh --with-smollm2,
# then .gpu/bin/receive.sh per part; DEVELOPERS.md, "The GPU check"):
#     bash scripts/gpu_check.sh                 # sources .gpu/bin/env.sh itself when present
# On any machine, the same Python code on the CPU with the tiny fixture pairs (a few minutes):
#     SPECEDGE_FIXTURES=$PWD/.cache/fixtures bash scripts/gpu_check.sh --cpu-smoke
#
# Each phase runs in its own process under `timeout`, inside one overall budget
# (GPU_CHECK_BUDGET_S, default 450 s, so the script ends in under 8 minutes); a phase that fails
# or hangs loses only its own results, and the report is always written from what the others left.
#
# --diag (with or without --cpu-smoke): build only the pairs the diagnostics need and run
# benchmarks/gpu_diag.py's phases instead (OUT/gpu_diag.{md,json}; a few minutes on the GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
DIAG=0
for arg in "$@"; do
  case $arg in
    --cpu-smoke) MODE=cpu-smoke ;;
    --diag) DIAG=1 ;;
    *) echo "usage: scripts/gpu_check.sh [--cpu-smoke] [--diag]" >&2; exit 2 ;;
  esac
done
BUDGET=${GPU_CHECK_BUDGET_S:-$([ $MODE = gpu ] && echo 450 || echo 180)}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
OUT_DIR=${OUT:-docs/results}
WORK=${GPU_CHECK_WORK:-/tmp/specedge-gpu}
[ $MODE = cpu-smoke ] && WORK=${GPU_CHECK_WORK:-/tmp/specedge-gpu-smoke}
mkdir -p "$WORK/parts" "$WORK/logs" "$OUT_DIR"
rm -f "$WORK"/parts/*.json "$WORK/parts/phases.tsv"   # pairs and HF folders are kept for reruns

if [ $MODE = gpu ]; then
  # shellcheck disable=SC1091
  [ -f .gpu/bin/env.sh ] && . .gpu/bin/env.sh
  PY=${PYTHON:-python3}
  # the project without installing it (env.sh does this too once receive.sh has run)
  if ! "$PY" -c "import specedge.runtime.pair" 2>/dev/null; then
    for d in runtime exporter calibration; do
      [ -e "specedge/$d" ] || ln -s "../$d" "specedge/$d"
    done
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  SMOKE=()
else
  PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  export SPECEDGE_FIXTURES=${SPECEDGE_FIXTURES:-$PWD/.cache/fixtures}
  [ -f "$SPECEDGE_FIXTURES/tiny-llama/specedge.json" ] \
    || "$PY" scripts/make_fixtures.py "$SPECEDGE_FIXTURES" >/dev/null
  SMOKE=(--cpu-smoke)
fi
export TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONWARNINGS=ignore

# run_phase NAME CAP [ARGS...]: at most CAP seconds, never past the deadline less RESERVE
RESERVE=20
run_phase() {
  local name=$1 cap=$2; shift 2
  local now left limit t0 rc
  now=$(date +%s); left=$((DEADLINE - now - RESERVE)); limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 5 ]; then
    printf '%s\t%s\t%s\t%s\n' "$name" 125 0 0 >> "$WORK/parts/phases.tsv"
    echo "== $name: skipped (no time left)"; return
  fi
  echo "== $name (up to ${limit} s)"
  t0=$(date +%s)
  local script=benchmarks/gpu_check.py phase=$name
  case $name in diag-*) script=benchmarks/gpu_diag.py; phase=${name#diag-} ;; esac
  timeout -k 5 "$limit" "$PY" "$script" "$phase" --work "$WORK" --out "$OUT_DIR" \
    --deadline $((t0 + limit)) "${SMOKE[@]}" "$@" 2>&1 | tee "$WORK/logs/phase-$name.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $(($(date +%s) - t0)) "$limit" >> "$WORK/parts/phases.tsv"
  [ $rc -ne 0 ] && echo "== $name exited $rc$([ $rc -ge 124 ] && echo ' (timed out)')"
}

# On the lent GPU machine only $OUT comes back, at most 8 files: the logs in one file (the last
# 200 KB of each) and the phases' raw results in one archive, so a failed export or phase can be
# read without another run.
take_logs() {
  [ -n "${OUT:-}" ] || return 0
  for f in "$WORK"/logs/*.log; do
    [ -f "$f" ] && { echo "===== $(basename "$f")"; tail -c 200000 "$f"; echo; }
  done > "$OUT/gpu_logs.txt"
  tar -czf "$OUT/gpu_parts.tar.gz" -C "$WORK" parts 2>/dev/null || true
}

if [ $DIAG = 1 ]; then
  [ $MODE = gpu ] && export GPU_CHECK_PAIRS=${GPU_CHECK_PAIRS:-ref-cuda,ref-concat,qwen2.5-1.5b}
  s=$([ $MODE = gpu ] && echo 1 || echo 0)   # phase caps: seconds on the GPU, else a smoke's
  run_phase build $((s ? 100 : 60))   # the export still running then goes on in the background
  # the report after each phase: a machine taken back mid-run still returns what was done
  for phase in profile:30 rounds:40 exact:40 tf32:30 nan:20; do
    run_phase "diag-${phase%:*}" $((s ? ${phase#*:} : 20))
    timeout -k 5 30 "$PY" benchmarks/gpu_diag.py report --work "$WORK" --out "$OUT_DIR" \
      "${SMOKE[@]}" >/dev/null
    take_logs
  done
elif [ $MODE = gpu ]; then
  run_phase env 30
  run_phase build 170     # exports still running at the end go on in the background
  run_phase check 60      # also with CUDA graphs on
  run_phase bench 120     # waits (bounded) for pairs still exporting
  run_phase batch 90      # issue 19: B = 1..32 on the concat reference pair, then the 7B costs
  run_phase hf 45
else
  run_phase env 20
  run_phase build 60
  run_phase check 36
  run_phase bench 40
  run_phase batch 30
  run_phase hf 20
fi
# the report always runs, even past the budget; the script fails when it does
REPORT_RC=0
if [ $DIAG = 0 ]; then
  timeout -k 5 30 "$PY" benchmarks/gpu_check.py report --work "$WORK" --out "$OUT_DIR" \
    "${SMOKE[@]}" || REPORT_RC=$?
fi
take_logs
echo "gpu_check ($MODE) took $(($(date +%s) - START)) s; logs in $WORK/logs"
[ $REPORT_RC -eq 0 ] || echo "gpu_check: the report failed (exit $REPORT_RC)" >&2
exit $REPORT_RC
