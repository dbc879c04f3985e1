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
    bad = CliRunner().invoke(main, ["bench", str(tiny_pair_dir), "--ks", "0"])
    assert bad.exit_code != 0 and "1..64" in bad.output + (bad.stderr or "")
