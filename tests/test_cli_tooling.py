"""The CLI as a thin layer: its choices come from the modules that implement them, its default
prompts ship as package data, its tables are whole when stdout is not a terminal, and its
comma-separated integer options fail as click usage errors. None of these load a model."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

from specedge.cli import main
from specedge.exporter.quantize import METHODS

from .test_cli import assert_clean_error, invoke

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def _choices(command: str, name: str) -> tuple[str, ...]:
    param = next(p for p in main.commands[command].params if p.name == name)
    assert isinstance(param.type, click.Choice), (command, name, param.type)
    return tuple(param.type.choices)


# ----------------------------------------------------------------------------- choices


def test_quantization_methods_come_from_the_quantizer() -> None:
    assert "int8-rtn" in METHODS
    assert _choices("quantize", "method") == METHODS
    assert _choices("export", "calibrate_method") == METHODS


@pytest.mark.parametrize("method", METHODS)
def test_quantize_accepts_every_method(runner: CliRunner, tmp_path: Path, method: str) -> None:
    # Issue 15, bug 1: `--method int8-rtn` was a usage error before the pair was even read.
    result = invoke(runner, "quantize", tmp_path / "nope", "-o", tmp_path / "out",
                    "--method", method)
    assert_clean_error(result, "no such pair folder")


def test_other_choices_come_from_their_modules() -> None:
    from specedge.calibration.draft_search import PRECISIONS as DRAFT_PRECISIONS
    from specedge.exporter.pair import GRAPHS, PRECISIONS, PROVIDERS
    from specedge.runtime.manifest import DRAFTERS
    from specedge.runtime.pair import DRAFTER_CHOICES

    assert _choices("generate", "drafter") == DRAFTER_CHOICES
    assert _choices("chat", "drafter") == DRAFTER_CHOICES
    assert _choices("bench", "drafter") == DRAFTERS
    assert _choices("export", "precision") == PRECISIONS
    assert _choices("export", "draft_precision") == PRECISIONS
    assert _choices("export", "provider") == PROVIDERS
    assert _choices("export", "graph") == ("auto", *GRAPHS)
    assert _choices("draft", "precision") == DRAFT_PRECISIONS


# ----------------------------------------------------------------------------- package data


def _install_copy(site: Path) -> None:
    """Lay the package out as an installation does: the modules and the declared package data,
    nothing else of the source tree."""
    # Python 3.10 has no tomllib; pytest brings its backport there
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in config["packages"]:
        src = ROOT / config["package-dir"][package]
        dst = site.joinpath(*package.split("."))
        dst.mkdir(parents=True)
        files = list(src.glob("*.py"))
        for pattern in config.get("package-data", {}).get(package, []):
            files += src.glob(pattern)
        for file in files:
            (dst / file.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, dst / file.relative_to(src))


def test_bench_batch_default_prompts_outside_a_source_checkout(tmp_path: Path) -> None:
    # Issue 15, bug 10: `bench --batch` read benchmarks/prompts20.txt from the source tree, so an
    # installed specedge had no default prompts ("needs at least that many prompts; got 0").
    site = tmp_path / "site"
    _install_copy(site)
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONWARNINGS="ignore")
    where = subprocess.run([sys.executable, "-c",
                            "import specedge.cli; print(specedge.cli.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(site)  # the copy runs, not the checkout
    proc = subprocess.run([sys.executable, "-m", "specedge.cli", "bench", str(tmp_path / "pair"),
                           "--batch", "64"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    found = re.search(r"needs at least that many prompts; got (\d+)", proc.stderr)
    assert found, proc.stderr
    assert int(found.group(1)) == 20


# ----------------------------------------------------------------------------- tables


def _validation(diff: float) -> dict:
    return {"step_with_past": {"max_abs_diff": diff, "top1_agreement": 0.6, "kl_mean": 2.28e-11},
            "prefill": {"max_abs_diff": 6.34e-05}, "passed": True}


def test_tables_are_whole_when_stdout_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    # Issue 15, bug 11: rich cut cells to 80 columns in logs ("precis…", "gqa-sh…", "5.34e-…").
    from specedge import cli

    monkeypatch.delenv("COLUMNS", raising=False)
    target = SimpleNamespace(precision="fp32", graph="gqa-shared", validation=_validation(5.34e-5),
                             source={})
    draft = SimpleNamespace(precision="int4", graph="gqa-shared", validation=_validation(1.07),
                            source={})
    report = SimpleNamespace(folder=Path("/pairs/smollm2-135m-instruct-reference-pair"),
                             seconds=45.6, peak_rss_mb=1884.0,
                             manifest=SimpleNamespace(
                                 target=target, draft=draft, provenance={},
                                 defaults=SimpleNamespace(drafter="hybrid", num_draft_tokens=5,
                                                          adaptive=False)))
    cli._print_export(report)
    out = capsys.readouterr().out
    assert "…" not in out
    for text in ("precision", "gqa-shared", "5.34e-05", "1.07e+00", "2.28e-11", "6.34e-05",
                 "step max|Δ|", "prefill max|Δ|", "smollm2-135m-instruct-reference-pair"):
        assert text in out, out


def test_bench_table_is_whole_through_the_cli(runner: CliRunner, tiny_pair_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    result = invoke(runner, "bench", tiny_pair_dir, "--ks", "2", "--repeats", "1", "--warmup",
                    "0", "--max-new-tokens", "4", "--plain", "--no-adaptive")
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    for header in ("tok/s median (min–max)", "verify(K+1)/verify(1)", "host ms/round"):
        assert header in result.stdout, result.stdout


# ----------------------------------------------------------------------------- option types


@pytest.mark.parametrize("args", [
    ["bench", "P", "--ks", "1,x"],
    ["bench", "P", "--batch", "2,a"],
    ["bench", "P", "--batch", ","],
    ["tune", "P", "--ks", "one"],
    ["draft", "T", "-o", "O", "--prompts", "f.txt", "--vocab-sizes", "8k"],
])
def test_comma_separated_integers_are_usage_errors(runner: CliRunner, args: list[str]) -> None:
    result = invoke(runner, *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "Invalid value for" in result.stderr and "comma-separated integers" in result.stderr


def test_gpu_switches_and_build_engine_are_on_the_cli(runner: CliRunner,
                                                     tiny_pair_dir: Path) -> None:
    """--cuda-graph / --argmax reach Pair.load; build-engine is registered on the group."""
    assert "build-engine" in main.commands
    assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "hi", "--cuda-graph"),
                       "CUDA graphs need a model on the cuda provider")
    assert _choices("generate", "argmax") == ("auto", "device", "host")
    host = invoke(runner, "generate", tiny_pair_dir, "The quick", "--max-new-tokens", "8")
    device = invoke(runner, "generate", tiny_pair_dir, "The quick", "--max-new-tokens", "8",
                    "--argmax", "device")
    assert host.exit_code == device.exit_code == 0 and host.stdout == device.stdout
