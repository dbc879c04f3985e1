"""What a CPU can show of the GPU check before a GPU session (docs/results/gpu_preview_cpu.md).

    python benchmarks/gpu_preview.py exports [--work DIR] [PAIR ...]
        run the GPU check's own export commands (`gpu_build.export_jobs`, GPU mode) one by one
        and print each one's exit code, wall time and peak RSS
    python benchmarks/gpu_preview.py agreement [--work DIR] [--prompts N] [--new N]
        the bar "CUDA vs CPU top-1 agreement >= 99%" with the fp16 reference file on the CPU
        provider in place of CUDA (teacher-forced on the fp16 pair's greedy outputs, as the
        check does; needs `exports ref-cuda ref-cpu` first)

Run with the export environment (`.venv/bin/python`); pairs go to WORK/pairs (default
/tmp/specedge-gpu-preview), as on the GPU machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_build  # noqa: E402
import gpu_plan  # noqa: E402


def plan_for(work: Path) -> gpu_plan.Plan:
    args = argparse.Namespace(cpu_smoke=False, work=work, out=work / "out",
                              deadline=time.time() + 24 * 3600)
    return gpu_plan.make_plan(args)


def exports(work: Path, only: list[str]) -> None:
    plan = plan_for(work)
    status: dict = {"notes": []}
    made: dict[str, bool] = {}
    for name, _out, sources, argv in gpu_build.export_jobs(plan):
        if only and name not in only:
            continue
        for src in sources:
            if src not in made:
                t0 = time.perf_counter()
                made[src] = gpu_build.make_source(plan, src, status)
                print(f"source {src}: {made[src]} in {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        run = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True,
                             cwd=gpu_plan.ROOT,
                             env=dict(os.environ, PYTHON=sys.executable, TQDM_DISABLE="1"))
        peak = next((line.split(":")[-1].strip() for line in run.stderr.splitlines()
                     if "Maximum resident" in line), "?")
        rss = f"{int(peak) / 2**20:.1f} GB" if peak.isdigit() else "?"
        print(f"export {name}: rc={run.returncode} in {time.perf_counter() - t0:.0f} s, peak "
              f"RSS {rss}", flush=True)
        if run.returncode:
            print("\n".join((run.stdout + run.stderr).splitlines()[-15:]))
    for note in status["notes"]:
        print(note)


def agreement(work: Path, prompts: int, new: int) -> None:
    import numpy as np

    from specedge.runtime.pair import GenerationConfig, Pair

    info = gpu_plan.pairs(plan_for(work))[0]  # the reference pair: fp16 (GPU) and fp32
    assert info.cpu_folder is not None
    ids = gpu_plan.prompt_ids(info, prompts)
    fp16 = Pair.load(info.folder, load_draft=False)  # on the CPU provider
    fp32 = Pair.load(info.cpu_folder, load_draft=False)
    cfg = GenerationConfig(max_new_tokens=new, drafter="none")
    same = total = equal = 0
    worst = 0.0
    for prompt in ids:
        out = fp16.generate_ids(prompt, cfg)[0]
        equal += out == fp32.generate_ids(prompt, cfg)[0]
        seq, start = prompt + out, len(prompt) - 1
        a, b = gpu_plan.all_logits(fp16, seq)[start:], gpu_plan.all_logits(fp32, seq)[start:]
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(a)
        worst = max(worst, float(np.abs(a - b).max()))
    print(f"fp16 file on the CPU provider vs the fp32 pair: top-1 agreement {same}/{total} = "
          f"{same / total:.4f}; max |dlogit| {worst:.3f}; greedy outputs identical "
          f"{equal}/{len(ids)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("exports", "agreement"))
    ap.add_argument("pairs", nargs="*", help="exports: only these (ref-cuda, qwen2.5-1.5b, ...)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/specedge-gpu-preview"))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_intermixed_args()
    if args.what == "exports":
        exports(args.work, args.pairs)
    else:
        agreement(args.work, args.prompts, args.new)


if __name__ == "__main__":
    main()
