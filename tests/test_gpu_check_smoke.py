"""`scripts/gpu_check.sh --cpu-smoke`: the whole GPU check, every phase, on the CPU.

The GPU machine is lent to few sessions, for 15 minutes, so the check must work the first time
it gets there. This runs the same phases with the tiny fixture pairs (about 30 s) and checks the
report: the exactness bars passed, the batched rows equal their batch-1 runs, and the shaped
batched pair (a separate gqa-shared draft whose table is padded to fewer ids than the concat
target's, as Qwen2.5-0.5B beside Qwen2.5-7B) was built and its costs measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.export,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs [export]"),
]

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_runs_every_phase(tmp_path: Path, fixtures_dir: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
               SPECEDGE_FIXTURES=str(fixtures_dir), GPU_CHECK_BUDGET_S="240")
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    phases = (tmp_path / "work" / "parts" / "phases.tsv").read_text().split("\n")
    codes = {line.split("\t")[0]: line.split("\t")[1] for line in phases if line}
    assert codes == {p: "0" for p in ("env", "build", "check", "bench", "batch", "hf")}, codes
    data = json.loads((tmp_path / "out" / "gpu_cpu_smoke.json").read_text())
    bars = {b["bar"]: b["passed"] for b in data["bars"]}
    exact = [bar for bar in bars if "== target-only" in bar or "rows == their batch-1" in bar]
    assert exact and all(bars[bar] for bar in exact), bars
    assert "structured output (JSON schema): K=3 == target-only, all prompts" in exact
    manifest = json.loads((tmp_path / "work" / "pairs" / "tiny-concat" / "specedge.json")
                          .read_text())
    assert manifest["models"]["draft"]["input_vocab_size"] < manifest["vocab_size"]
    assert manifest["models"]["draft"]["graph"] == "gqa-shared"  # in place, as the GPU's
    shaped = data["batch-tiny"]["rows"]
    assert shaped and all(r["target-only"]["equal_to_batch1"] == int(b)
                          for b, r in shaped.items())
    # the batched reference decoded with its in-place draft replaying (fixed buffers here)
    reference = data["batch-reference"]["rows"]
    assert all(r["K=2, draft graphs"]["equal_to_batch1"] == int(b) for b, r in reference.items())
    # chats in a continuous batch that keeps prefixes in its free slots: exact, and reused
    slots = data["batch-reference"]["slot_prefix"]
    assert slots["equal"] == slots["generations"] > 0 and max(slots["reused"]) > 0, slots
    assert slots["shared"][0] == 0 and min(slots["shared"][1:]) >= 128, slots
    # its draft's steps timed plain and on fixed buffers (CUDA graphs on a GPU)
    assert all({"draft_step", "draft_step_graph"} <= set(r["costs"]) for r in shaped.values())
    # and the host's greedy share of a call, which the predicted bar adds to each verify
    assert all({"host_1", "host_3"} <= set(r["costs"]) for r in shaped.values())
    assert "host's greedy work" in (tmp_path / "out" / "gpu_cpu_smoke.md").read_text()
    # the acceptance a real draft would need for the B=8 bar, beside each prediction
    assert "acceptance needed for 1.3x" in (tmp_path / "out" / "gpu_cpu_smoke.md").read_text()


def test_the_acceptance_needed_for_the_batch_bar_reaches_it_exactly() -> None:
    """`needed_acceptance` is the predicted speed-up solved for acceptance: put back into the
    prediction, it gives the bar."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_report import BATCH_BAR, batch_predicted

    costs = {"verify_1": 4.0e-3, "verify_3": 4.3e-3, "verify_4": 4.5e-3, "draft_step": 0.6e-3,
             "host_1": 0.1e-3, "host_3": 0.2e-3, "host_4": 0.25e-3}
    for k in (2, 3):
        needed = batch_predicted({"batch-reference": {"rows": {"8": {f"K={k}": {
            "acceptance": 0.5}}}}, "batch-x": {"rows": {"8": {"costs": costs}}}},
            "x")[0]["acceptance_for_bar"]
        again = batch_predicted({"batch-reference": {"rows": {"8": {f"K={k}": {
            "acceptance": needed}}}}, "batch-x": {"rows": {"8": {"costs": costs}}}}, "x")[0]
        assert 0 < needed < 1 and abs(again["predicted_speedup"] - BATCH_BAR) < 1e-12
