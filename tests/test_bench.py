"""`specedge bench` on the tiny pair: the report is complete and consistent (not a timing test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specedge.runtime import bench
from specedge.runtime.errors import InputError
from specedge.runtime.pair import Pair
from specedge.runtime.prompts import default_prompts, read_prompts


def test_bench_report(tiny_pair: Pair) -> None:
    options = bench.BenchOptions(prompts=("The quick", "def add"), max_new_tokens=12, ks=(1, 3),
                                 repeats=2, warmup=1, chat=False)
    calls: list[int] = []
    report = bench.run_bench(tiny_pair, options, lambda _label, n: calls.append(n))
    assert sum(calls) == bench.total_generations(tiny_pair, options)
    rows = report.rows()
    assert [r["setting"] for r in rows] == ["target only", "K=1", "K=3", "adaptive"]
    assert rows[0]["speedup"] == pytest.approx(1.0)
    for r in rows[1:3]:
        assert 0.0 <= r["acceptance"] <= 1.0
        assert 1.0 <= r["tokens_per_round"] <= r["k"] + 1
        assert r["predicted_speedup"] > 0 and r["efficiency"] > 0
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
    assert set(report.costs.target) == set(range(1, 10))
    assert report.costs.draft_step and report.costs.draft_step > 0
    json.dumps(report.to_json())
    assert len(bench.format_rows(report)) == len(rows)


def test_read_prompts(tmp_path: Path) -> None:
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert read_prompts(txt) == ("one", "two")
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a"}\n{"category": "x", "prompt": "b"}\n')
    assert read_prompts(jl) == ("a", "b")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(InputError, match="bad.jsonl:1"):
        read_prompts(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(InputError, match="no prompts"):
        read_prompts(empty)
    with pytest.raises(InputError, match="cannot read prompts"):
        read_prompts(tmp_path / "missing.txt")
    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts.jsonl"
    assert len(read_prompts(committed)) >= 40


def test_default_prompts_are_package_data() -> None:
    prompts = default_prompts()
    assert len(prompts) == 20 and all(p.strip() for p in prompts)


def test_bench_cli(tiny_pair_dir: Path, tmp_path: Path) -> None:
    from specedge.cli import main

    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", str(tiny_pair_dir), "--ks", "2", "--repeats", "1",
                                       "--max-new-tokens", "8", "--plain", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "target only" in result.output and json.loads(out.read_text())["rows"]
    assert "target: batch-invariant" in result.output  # the tiny fp32 target's row probe
    steps = json.loads(out.read_text())["environment"]["target_steps"]
    assert steps["two_rows"] is False and steps["probe"]["block"] == 0.0
    bad = CliRunner().invoke(main, ["bench", str(tiny_pair_dir), "--ks", "0"])
    assert bad.exit_code != 0 and "1..64" in bad.output + (bad.stderr or "")


def test_bench_by_category(tiny_pair: Pair, tmp_path: Path) -> None:
    """Per-category sums add up to the overall figures, and adaptive is set against the best
    fixed K of each category (issue 16's bar is per category)."""
    from specedge.runtime.prompts import read_categories

    jl = tmp_path / "p.jsonl"
    jl.write_text('{"category": "code", "prompt": "def add"}\n'
                  '{"category": "chat", "prompt": "The quick"}\n'
                  '{"category": "code", "prompt": "for i in"}\n')
    categories = read_categories(jl)
    assert categories == ("code", "chat", "code")
    options = bench.BenchOptions(prompts=read_prompts(jl), categories=categories,
                                 max_new_tokens=10, ks=(1, 2), repeats=1, warmup=0, chat=False)
    report = bench.run_bench(tiny_pair, options)
    rows = report.category_rows()
    assert [r["category"] for r in rows] == ["code", "chat"]
    for s in report.settings:
        tokens = sum(v[0] for v in s.by_category.values())
        seconds = sum(v[1] for v in s.by_category.values())
        assert tokens / seconds == pytest.approx(s.tokens_per_s[0])
    for r in rows:
        assert r["speedups"]["target only"] == pytest.approx(1.0)
        assert r["best_fixed"] in ("K=1", "K=2")
        assert r["adaptive_vs_best_fixed"] == pytest.approx(
            r["speedups"]["adaptive"] / r["speedups"][r["best_fixed"]])
    headers, table = bench.format_category_rows(report)
    assert len(table) == 2 and len(headers) == len(table[0])
    json.dumps(report.to_json())
    assert read_categories(tmp_path / "p.txt") is None
    with pytest.raises(InputError, match="one category per prompt"):
        bench.BenchOptions(prompts=("a", "b"), categories=("x",))


def test_bench_measures_the_sampling_asked_for(tiny_pair: Pair, tiny_pair_dir: Path,
                                               tmp_path: Path) -> None:
    """`bench --temperature/--top-k/--top-p/--min-p` measures that sampling in every setting
    (before, only the temperature reached the settings: a top-p user benchmarked another
    distribution), says so in the title and the JSON, and refuses bad values and batches with a
    clean line before any work."""
    from specedge.cli import main

    options = bench.BenchOptions(prompts=("The quick",), max_new_tokens=8, ks=(2,), repeats=1,
                                 warmup=0, chat=False, temperature=0.7, top_k=40, top_p=0.9,
                                 min_p=0.05)
    params = options.sampling()
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.seed) == (
        0.7, 40, 0.9, 0.05, 0)
    seen: list[object] = []
    real = tiny_pair.generate

    def spy(prompt: object, config: object = None) -> object:
        seen.append(config.sampling)  # type: ignore[union-attr]
        return real(prompt, config)  # type: ignore[arg-type]

    tiny_pair.generate = spy  # type: ignore[method-assign]
    try:
        bench.run_bench(tiny_pair, options)
    finally:
        del tiny_pair.generate
    assert seen and all(s == params for s in seen)

    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", str(tiny_pair_dir), "--ks", "2", "--repeats", "1",
                                       "--max-new-tokens", "8", "--plain", "--no-adaptive",
                                       "--temperature", "0.7", "--top-p", "0.9", "--json",
                                       str(out)])
    assert result.exit_code == 0, result.output
    assert "temperature 0.7, top-p 0.9, seed 0" in result.output
    saved = json.loads(out.read_text())["options"]
    assert (saved["temperature"], saved["top_p"], saved["top_k"]) == (0.7, 0.9, 0)
    for args, what in ((["--top-p", "1.5"], "top_p"), (["--top-k", "-1"], "top_k"),
                       (["--min-p", "1"], "min_p")):
        bad = CliRunner().invoke(main, ["bench", str(tiny_pair_dir), "--temperature", "0.7",
                                        *args])
        assert bad.exit_code == 1 and bad.output.strip().count("\n") == 0, bad.output
        assert what in bad.output
    batch = CliRunner().invoke(main, ["bench", str(tiny_pair_dir), "--batch", "1", "--top-p",
                                      "0.9"])
    assert batch.exit_code == 1 and "greedy" in batch.output and "--top-p" in batch.output
