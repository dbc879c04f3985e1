"""The wheel a user installs on an edge device (`pip wheel .`, then `pip install` it, not an
editable checkout): every module of the four packages, the data files the runtime loads, and the
`specedge` command, built without setuptools' warnings."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"specedge": "specedge", "runtime": "specedge/runtime",
            "exporter": "specedge/exporter", "calibration": "specedge/calibration"}



def _setuptools_major() -> int:
    if importlib.util.find_spec("setuptools") is None:
        return 0
    from importlib.metadata import version

    return int(version("setuptools").split(".")[0])


pytestmark = [
    pytest.mark.export,  # the export environment has a setuptools new enough to build it
    pytest.mark.skipif(_setuptools_major() < 77, reason="needs setuptools >= 77 (pyproject's "
                                                       "build-system), which builds wheels"),
]


def test_the_wheel_holds_every_module_and_data_file(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300,
        cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Package would be ignored" not in proc.stdout + proc.stderr
    wheel = next(tmp_path.glob("specedge-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, where in PACKAGES.items():
        for source in (ROOT / folder).glob("*.py"):
            assert f"{where}/{source.name}" in names, f"{folder}/{source.name} is not packaged"
    for data in (ROOT / "runtime" / "data").iterdir():
        assert f"specedge/runtime/data/{data.name}" in names, f"{data.name} is not packaged"
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "specedge = specedge.launch:main" in zipfile.ZipFile(wheel).read(entry).decode()
