"""The GPU check of issue 13 (part 4), one phase per process; `scripts/gpu_check.sh` runs them.

Usage: python benchmarks/gpu_check.py PHASE --work DIR --out DIR [--cpu-smoke] [--deadline T]

Phases (each writes WORK/parts/<phase>[-<pair>].json as soon as it has a result, so a phase that
fails or is killed by its timeout leaves the others' results; `report` reads whatever is there):
  env     `specedge doctor`, the GPU, package versions, the measured device copy bandwidth
  build   the pairs, exported in parallel: the SmolLM2-135M reference pair from the staged GGUF
          (models/smollm2-135m-gpu.sh: fp16 target + int4 draft for CUDA; and fp32 + int4 for
          CPU, the CPU side of the agreement check), and random-weight pairs of realistic shape
          (Qwen2.5-1.5B target + Qwen2.5-0.5B draft, Llama-3.2-1B target + int4 self-draft,
          and for batching a Qwen2.5-7B-shaped fp16 target + the Qwen2.5-0.5B-shaped int4 draft
          in the concat form)
  check   greedy speculative (K=3 and adaptive) == greedy target-only on CUDA, 20 prompts, also
          with CUDA graphs on; top-1 agreement of the CUDA pair
          with the CPU pair (and with itself on the CPU provider), teacher-forced on the
          target-only outputs
  bench   per pair, interleaved prompt by prompt within each repetition: specedge target-only,
          fixed K sweep, adaptive K, CUDA graphs on (off is the default) for target-only, K=1,
          K=3 and adaptive (and, on the reference pair, n-gram drafting and the draft on the
          CPU), ORT GenAI on the same ONNX files target-only and
          speculative; host time per round; then per-call costs
  batch   batched decoding (issue 19) on the concat-form reference pair, B = 1..32: aggregate
          tok/s of batched target-only, fixed K and adaptive K, greedy rows == their batch-1
          target-only runs, and verify(B x (K+1)) / verify(B x 1) per B; then the 7B-shaped
          pair's costs (B=8 first) and batched target-only, its speed-ups predicted from them
          and the reference pair's acceptance
  hf      transformers `generate` and assisted generation on the GPU (fp16), same prompt ids
  report  OUT/gpu_h200.{md,json} and OUT/gpu_batching.md (OUT/gpu_cpu_smoke.{md,json} with
          --cpu-smoke)

--cpu-smoke runs the same code on the CPU with the tiny fixture pairs ($SPECEDGE_FIXTURES/
tiny-llama and tiny-llama-concat) and one tiny random-weight shape, in about a minute; CUDA graphs
become fixed buffers there (the same steps without the capture) and the argmax variants swap
(host is the CPU default). Its figures are not GPU figures and its report says so.

This file parses the command line and runs one phase; each phase lives in a module of its own:
gpu_build (env, build), gpu_exact (check), gpu_bench (bench), gpu_batch (batch), gpu_hf (hf),
gpu_report (report); gpu_plan holds what they share (the plan, the pairs, their prompts).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_batch  # noqa: E402
import gpu_bench  # noqa: E402
import gpu_build  # noqa: E402
import gpu_exact  # noqa: E402
import gpu_hf  # noqa: E402
from gpu_plan import ROOT, make_plan  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("env", "build", "check", "bench", "batch", "hf",
                                      "report"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/specedge-gpu"))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds")
    ap.add_argument("--pair", default=None, help="bench only this pair")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # "sha256 check skipped on request", once per load
    plan = make_plan(args)
    if args.phase == "report":
        import gpu_report

        gpu_report.write(plan.parts, plan.out, smoke=plan.smoke)
        return 0
    phases = {"env": gpu_build.phase_env, "build": gpu_build.phase_build,
              "check": gpu_exact.phase_check, "hf": gpu_hf.phase_hf, "batch": gpu_batch.phase_batch}
    if args.phase == "bench":
        gpu_bench.phase_bench(plan, args.pair)
    else:
        phases[args.phase](plan)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
