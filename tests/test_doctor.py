"""`specedge doctor`: the real command on this machine, and its parsers on fake inputs."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specedge.doctor_cli import doctor
from specedge.runtime import doctor as doc
from specedge.runtime import machine
from specedge.runtime.errors import InputError

HAS_GPU = shutil.which("nvidia-smi") is not None
SMI = """0, NVIDIA H200, 9.0, 143771, 580.159.03
1, NVIDIA GeForce RTX 4090, 8.9, 24564, 580.159.03
"""
TEGRA = ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
         "DATE: Wed Jan  8 01:49:37 UTC 2025\n"
         "# KERNEL_VARIANT: oot\nTARGET_USERSPACE_LIB_DIR=nvidia\n")


# ----------------------------------------------------------------------------- pure functions


def test_parse_nvidia_smi_rows_and_old_drivers_without_compute_cap() -> None:
    gpus = machine.parse_nvidia_smi(SMI)
    assert [(g.index, g.name, g.compute_capability, g.memory_mib, g.driver) for g in gpus] == [
        (0, "NVIDIA H200", "9.0", 143771, "580.159.03"),
        (1, "NVIDIA GeForce RTX 4090", "8.9", 24564, "580.159.03")]
    old = machine.parse_nvidia_smi("0, Tesla T4, 15360, 470.82.01\n")
    assert old[0].compute_capability is None and old[0].memory_mib == 15360
    assert machine.parse_nvidia_smi("No devices were found\n") == []
    assert machine.parse_nvidia_smi("0, Orin, [N/A], [N/A], 540.4.0")[0].memory_mib is None


def test_jetson_release_parsing_and_jetpack_mapping() -> None:
    assert machine.parse_nv_tegra_release(TEGRA) == "36.4.3"
    assert machine.parse_nv_tegra_release("# R35 (release), REVISION: 4.1, GCID: 1") == "35.4.1"
    assert machine.parse_nv_tegra_release("# R38 (release), REVISION: 2, GCID: 1") == "38.2.0"
    assert machine.parse_nv_tegra_release("garbage") is None
    assert machine.jetpack_for_l4t("36.4.3") == "6.2"
    assert machine.jetpack_for_l4t("36.9.9") == "6.x"
    assert machine.jetpack_for_l4t("38.2.0") == "7.0"
    assert machine.jetpack_for_l4t(None) is None
    assert machine.parse_dpkg_jetpack("nvidia-jetpack\t6.2+b77\n") == "6.2"
    missing = "dpkg-query: no packages found matching nvidia-jetpack"
    assert machine.parse_dpkg_jetpack(missing) is None


def test_jetson_wheel_advice_per_jetpack() -> None:
    assert "pypi.jetson-ai-lab.io/jp6/cu126" in machine.jetson_advice("6.2")
    assert "CUDA 13" in machine.jetson_advice("7.0")
    assert "upgrade to JetPack 6" in machine.jetson_advice("5.1.2")
    assert "pypi.jetson-ai-lab.io" in machine.jetson_advice(None)


def test_detect_jetson_on_a_fake_tree(tmp_path: Path) -> None:
    assert machine.detect_jetson(tmp_path) is None
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "nv_tegra_release").write_text(TEGRA)
    (tmp_path / "proc" / "device-tree").mkdir(parents=True)
    (tmp_path / "proc" / "device-tree" / "model").write_text(
        "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\x00")
    info = machine.detect_jetson(tmp_path)
    assert info is not None and info.l4t == "36.4.3"
    assert info.model and info.model.startswith("NVIDIA Jetson Orin Nano")
    # dpkg-query answers for the machine the test runs on: only a real Jetson names its own
    assert info.jetpack == "6.2" or Path("/etc/nv_tegra_release").is_file()


def test_library_statuses_from_a_fake_locator() -> None:
    found = {"libcuda.so.1": ("loadable", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
             "libcudart.so.13": ("pip only", "/venv/site-packages/nvidia/cu13/lib")}
    libs = machine.library_statuses(13, lambda s: found.get(s, ("missing", None)))
    by_name = {lib.soname: lib for lib in libs}
    assert set(by_name) >= {"libcudart.so.13", "libcublasLt.so.13", "libcufft.so.12",
                            "libcudnn.so.9", "libnvinfer.so.10"}
    assert by_name["libcuda.so.1"].status == "loadable" and by_name["libcuda.so.1"].fix is None
    assert "LD_LIBRARY_PATH=/venv/site-packages/nvidia/cu13/lib" in by_name[
        "libcudart.so.13"].fix
    assert "onnxruntime-gpu[cudnn]" in by_name["libcudnn.so.9"].fix
    assert by_name["libnvinfer.so.10"].fix == "pip install tensorrt-cu13-libs"
    assert "cu12" in {lib.soname: lib for lib in machine.library_statuses(
        12, lambda s: ("missing", None))}["libnvinfer.so.10"].fix
    jetson = {lib.soname: lib for lib in machine.library_statuses(
        12, lambda s: ("missing", None), jetson=True)}
    assert "nvidia-jetpack" in jetson["libcudnn.so.9"].fix


def test_provider_fix_names_the_wheel_or_the_first_missing_library() -> None:
    libs = machine.library_statuses(13, lambda s: ("loadable", "/x") if s != "libcudnn.so.9"
                                else ("missing", None))
    assert machine.provider_fix("cuda", False, libs, None, 13) == machine.GPU_WHEEL
    assert "tensorrt-cu13-libs" in machine.provider_fix("tensorrt", False, libs, None, 13)
    assert machine.provider_fix("cuda", True, libs, None, 13).startswith("cuDNN (libcudnn.so.9)")
    jetson = machine.JetsonInfo("Orin", "36.4.3", "6.2", machine.jetson_advice("6.2"))
    assert "jp6/cu126" in machine.provider_fix("cuda", False, libs, jetson, 12)
    assert machine.provider_fix("cpu", True, libs, None, 13) is None


def test_loader_error_picks_the_missing_library() -> None:
    log = ("2026-11-20 [E:onnxruntime:Default, provider_bridge_ort.cc:2251 TryGetProviderInfo_CUDA]"
           " ... Failed to load library libonnxruntime_providers_cuda.so with error: "
           "libcublasLt.so.13: cannot open shared object file: No such file or directory\n")
    assert doc.loader_error(log) == "libcublasLt.so.13 cannot be loaded"
    assert doc.loader_error("") is None


def test_parse_providers() -> None:
    assert doc.parse_providers(None) == ("cpu",)
    assert doc.parse_providers("CUDA, cpu,cuda") == ("cuda", "cpu")
    with pytest.raises(InputError, match="tensorrt"):
        doc.parse_providers("gpu")


def test_report_is_frozen_and_failure_line_is_one_line() -> None:
    tests = (doc.SelfTest("cpu", True, "passed"),
             doc.SelfTest("cuda", False, "not in build", message="not in this build",
                          fix=machine.GPU_WHEEL))
    report = doc.DoctorReport("3.11", "Linux x86_64", "1.32.0", ("onnxruntime 1.32.0",), None,
                              "CPU", ("CPUExecutionProvider",), (), "none", (), None, tests,
                              ("cpu", "cuda"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.requested = ()  # type: ignore[misc]
    assert not report.ok and [t.provider for t in report.failed] == ["cuda"]
    line = report.failure_line()
    assert "\n" not in line and line.startswith("cuda cannot run here")
    assert "onnxruntime-gpu" in line
    assert json.loads(json.dumps(report.to_json()))["failed"] == ["cuda"]


def test_selftest_graph_matches_numpy_and_ships_with_the_package() -> None:
    model = doc.selftest_model()
    assert model.is_file() and model.stat().st_size < 10_000
    probs, top1 = doc.selftest_reference(doc.selftest_arrays())
    assert probs.shape == (2, 8) and np.allclose(probs.sum(-1), 1)
    result = doc.run_self_test("cpu")
    assert result["passed"], result
    assert result["max_abs_diff"] < 1e-5 and result["ran_on"] == ["CPUExecutionProvider"]


# ----------------------------------------------------------------------------- the real command


def test_doctor_cli_on_this_machine() -> None:
    result = CliRunner().invoke(doctor, [])
    assert result.exit_code == 0, result.output
    for text in ("onnxruntime", "provider self-test", "cpu (asked)", "passed", "GPU libraries",
                 "libcudnn.so.9"):
        assert text in result.output


def test_doctor_json_parses_and_cpu_passes() -> None:
    result = CliRunner().invoke(doctor, ["--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["ok"] is True and data["requested"] == ["cpu"]
    cpu = next(t for t in data["self_tests"] if t["provider"] == "cpu")
    assert cpu["status"] == "passed" and cpu["seconds"] < 30
    assert {lib["soname"] for lib in data["libraries"]} >= {"libcudnn.so.9", "libnvinfer.so.10"}


def test_unknown_provider_is_a_usage_error() -> None:
    result = CliRunner().invoke(doctor, ["--providers", "gpu"])
    assert result.exit_code == 2 and "--providers" in result.output


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_asking_for_cuda_without_it_fails_in_one_line_in_a_subprocess() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-m", "specedge.doctor_cli", "--providers", "cuda",
                           "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["failed"] == ["cuda"]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cuda cannot run here:"), proc.stderr
    assert "fix:" in lines[0] and "Traceback" not in proc.stderr


def test_doctor_does_not_import_torch() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = ("import sys; from specedge.runtime.doctor import diagnose; r = diagnose(); "
            "print(r.ok, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, check=True).stdout.split()
    assert out == ["True", "False", "False"]


def test_registered_in_the_specedge_group_when_cli_has_it() -> None:
    from specedge.cli import main

    assert "doctor" in main.commands
    result = CliRunner().invoke(main, ["doctor", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["ok"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU (nvidia-smi)")
def test_cuda_self_test_passes_on_a_gpu() -> None:
    report = doc.diagnose(("cpu", "cuda"))
    assert report.gpus, report.gpu_note
    assert report.ok, report.failure_line()


def test_cuda_major_from_the_build_then_jetpack() -> None:
    jp6 = machine.JetsonInfo("Orin", "36.4.3", "6.2", "")
    assert machine.cuda_major("13.0") == 13 and machine.cuda_major("12.6", jp6) == 12
    assert machine.cuda_major(None, jp6) == 12 and machine.cuda_major(None) == 13


def test_diagnose_on_a_fake_jetson_gives_the_jetson_wheel(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "nv_tegra_release").write_text(TEGRA)
    report = doc.diagnose(("cpu",), self_test=False, jetson_root=tmp_path)
    assert report.jetson is not None and report.jetson.l4t == "36.4.3"
    cuda = next(t for t in report.self_tests if t.provider == "cuda")
    if not cuda.in_build:  # a CPU onnxruntime: the fix is the Jetson AI Lab wheel, not PyPI's
        assert "pypi.jetson-ai-lab.io" in (cuda.fix or "")
    assert any("libcudart.so.12" == lib.soname for lib in report.libraries) or cuda.in_build


def test_selftest_joins_the_process_wide_pool(tiny_pair_dir) -> None:  # noqa: ANN001
    """After a Pair ran on ONNX Runtime's shared pool (the default thread plan), the in-process
    self-test must join that pool (ONNX Runtime refuses per-session pools then)."""
    from specedge.runtime.pair import Pair

    Pair.load(tiny_pair_dir)
    result = doc.run_self_test("cpu")
    assert result["passed"], result
