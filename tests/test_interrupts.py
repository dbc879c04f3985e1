"""Ctrl-C during export or generate leaves no temporary files or half-written folders."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _interrupt(cmd: list[str], after: float, cwd: Path,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # As a terminal starts it: SIGINT at its default (a suite started as a background job of a
    # script inherits SIG_IGN, and Python then never raises KeyboardInterrupt).
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.export
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs [export]")
@pytest.mark.parametrize("after", [1.5, 4.0])
def test_ctrl_c_during_export(tmp_path: Path, after: float) -> None:
    from specedge.exporter.tiny import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf", seed=5)
    out = tmp_path / "outdir" / "pair"
    tmp = tmp_path / "tmp"  # a private TMPDIR: other processes' exports use the shared one
    tmp.mkdir()
    result = _interrupt([sys.executable, "-m", "specedge.cli", "export", str(hf), "-o", str(out),
                         "--draft-precision", "int4"], after, tmp_path, {"TMPDIR": str(tmp)})
    if result.returncode == 0:
        pytest.skip("the export finished before the interrupt")
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir()] if out.parent.exists() else True
    leftovers = [p.name for p in tmp.iterdir() if p.is_dir()]
    assert not leftovers


def test_ctrl_c_during_generate(reference_pair_dir: Path, tmp_path: Path) -> None:
    result = _interrupt([sys.executable, "-m", "specedge.cli", "generate",
                         str(reference_pair_dir), "Tell me a very long story.", "--chat",
                         "--max-new-tokens", "4000"], 4.0, tmp_path)
    assert result.returncode == 130 and "interrupted" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


_INTERRUPT_WHILE_LOADING = """
import os, signal, sys

class CtrlC:
    # A real SIGINT, sent the moment `specedge.cli` starts to load: where Ctrl-C lands when
    # the user presses it during the second or more that the CLI's libraries take to import.
    def find_spec(self, name, path=None, target=None):
        if name == "specedge.cli":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["specedge", "--version"]
from specedge.launch import main
main()
print("the CLI ran")
"""


def test_ctrl_c_while_the_cli_loads_is_one_line(tmp_path: Path) -> None:
    # Regression: an interrupt during the CLI's imports printed a KeyboardInterrupt traceback
    # (the one-line handling only wraps the commands).
    result = subprocess.run([sys.executable, "-c", _INTERRUPT_WHILE_LOADING], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert result.returncode == 130, result.stderr
    assert result.stderr == "interrupted\n"
    assert "the CLI ran" not in result.stdout


def test_python_dash_m_specedge_is_the_cli(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "specedge", "--version"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "version" in result.stdout
