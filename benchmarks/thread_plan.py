"""Measure thread plans for two ONNX Runtime sessions sharing the CPU (issue 3).

Usage: python benchmarks/thread_plan.py PAIR [OUT.md]
Greedy, 3 chat prompts × 128 new tokens, one warm-up pass per plan; decode tokens/s (prefill
excluded) for target-only, fixed K = 2, 3, 4 and adaptive K (max 6). Ratios within one run count.
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

from specedge.runtime.pair import GenerationConfig, Pair, ThreadPlan, plan_threads
from specedge.runtime.sessions import SessionConfig, physical_cores

PROMPTS = ["Write a short story about a robot learning to paint.",
           "Explain how a hash table works.",
           "List five tips for staying productive when working from home."]


def run(pair: Pair, drafter: str, k: int, adaptive: bool) -> tuple[float, float]:
    tokens = seconds = accepted = proposed = 0.0
    for prompt in PROMPTS:
        r = pair.generate(prompt, GenerationConfig(max_new_tokens=128, drafter=drafter,
                                                   num_draft_tokens=k, adaptive=adaptive,
                                                   chat=True))
        tokens += r.stats.new_tokens
        seconds += r.stats.decode_s
        accepted += r.stats.accepted
        proposed += r.stats.proposed
    return tokens / seconds, accepted / proposed if proposed else 0.0


def plans(cores: int) -> dict[str, ThreadPlan]:
    cpu = lambda n, spin: SessionConfig(intra_op_threads=n, allow_spinning=spin)  # noqa: E731
    return {
        "default: one shared global pool, all cores, spinning": plan_threads(),
        "target all cores + spin, draft cores-1 no spin": plan_threads(target_threads=cores,
                                                                       draft_threads=0),
        f"both {cores} threads, both spin": ThreadPlan(cpu(cores, True), cpu(cores, True)),
        f"both {cores} threads, no spin": ThreadPlan(cpu(cores, False), cpu(cores, False)),
        f"target {cores} no spin, draft 1 no spin": ThreadPlan(cpu(cores, False), cpu(1, False)),
    }


def measure(pair_dir: str, name: str) -> str:
    """One plan, in this process (the global pool is process-wide, so one plan per process)."""
    pair = Pair.load(pair_dir, plan=plans(physical_cores())[name], verify_hashes=False)
    run(pair, "none", 1, False)  # warm-up
    base = run(pair, "none", 1, False)[0]
    cells = [f"{base:.1f}"]
    for k in (2, 3, 4):
        tps, acc = run(pair, "model", k, False)
        cells.append(f"{tps:.1f} ({tps / base:.2f}x, acc {acc:.2f})")
    tps, acc = run(pair, "model", 6, True)
    cells.append(f"{tps:.1f} ({tps / base:.2f}x)")
    return f"| {name} | " + " | ".join(cells) + " |"


def main(pair_dir: str, out: str | None) -> None:
    import subprocess

    cores = physical_cores()
    lines = [f"# Thread plans on {cores} cores ({platform.processor() or platform.machine()}),"
             f" {time.strftime('%Y-%m-%d')}", "",
             "Greedy, 3 chat prompts x 128 new tokens, decode tokens/s (prefill excluded), one "
             "process per plan, one warm-up pass. "
             f"`python benchmarks/thread_plan.py {pair_dir} {out or ''}`", "",
             "| plan | target only | K=2 | K=3 | K=4 | adaptive (K<=6) |",
             "|---|---|---|---|---|---|"]
    for name in plans(cores):
        row = subprocess.run([sys.executable, __file__, "--one", pair_dir, name],
                             capture_output=True, text=True, check=True).stdout.strip()
        lines.append(row.splitlines()[-1])
        print(lines[-1], flush=True)
    if out:
        Path(out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        print(measure(sys.argv[2], sys.argv[3]))
    else:
        main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
