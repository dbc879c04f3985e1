"""The runtime on an onnxruntime older than 1.23, whose Python module cannot make the
process-wide thread pool (`set_global_thread_pool_sizes` came in 1.23): Jetson wheels and
Python 3.10 installs are often older. The default thread plan then gives each session its own
pool instead of ending in an AttributeError at `Pair.load`. Older still (1.20-1.22) cannot load
the builder's graphs; a model that fails to load then names the version to upgrade. Before 1.32
an fp8 pair loads only without the QDQ fusion (tests/test_prompt_kv.py decodes one exactly)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from specedge.runtime import loading, sessions
from specedge.runtime.doctor import diagnose
from specedge.runtime.errors import InputError, ModelError
from specedge.runtime.pair import plan_threads
from specedge.runtime.providers import QDQ_FUSION, fusions_to_skip, onnxruntime_too_old

WITHOUT_GLOBAL_POOL = r'''
from onnxruntime.capi import _pybind_state
del _pybind_state.set_global_thread_pool_sizes  # as in onnxruntime 1.20-1.22
'''


def test_the_default_plan_needs_no_global_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "global_pool_supported", lambda: False)
    plan = plan_threads("cpu", "cpu", cores=2)
    assert not plan.target.shared_pool and not plan.draft.shared_pool
    assert plan.target.intra_op_threads == 2 and plan.target.allow_spinning
    assert plan.draft.intra_op_threads == 1 and not plan.draft.allow_spinning
    monkeypatch.setattr(loading, "global_pool_supported", lambda: True)
    assert plan_threads("cpu", "cpu", cores=2).target.shared_pool


def test_asking_for_the_shared_pool_there_is_one_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions, "_global_pool_threads", None)
    monkeypatch.setattr(sessions, "global_pool_supported", lambda: False)
    with pytest.raises(InputError, match=r"needs onnxruntime >= 1\.23 .*shared_pool=False"):
        sessions.session_options(sessions.SessionConfig(shared_pool=True))


def test_a_pair_loads_and_decodes_exactly_without_the_global_pool(tiny_pair_dir: Path) -> None:
    code = WITHOUT_GLOBAL_POOL + f'''
from specedge.runtime import sessions
from specedge.runtime.pair import GenerationConfig, Pair
pair = Pair.load({str(tiny_pair_dir)!r})
assert not sessions.global_pool_active()
spec = pair.generate("The quick", GenerationConfig(max_new_tokens=24, num_draft_tokens=3))
plain = pair.generate("The quick", GenerationConfig(max_new_tokens=24, drafter="none"))
assert spec.tokens == plain.tokens and spec.stats.proposed > 0, (spec.tokens, plain.tokens)
print("ok")
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.parametrize(("version", "old"), [
    ("1.22.1", True), ("1.20.0+cu126", True), ("0.9.9", True), ("1.23.0", False),
    ("1.31.1", False), ("2.0.0", False), ("1.24.0.dev20260101", False), ("unknown", False)])
def test_which_versions_are_too_old(version: str, old: bool) -> None:
    said = onnxruntime_too_old(version)
    assert (said is not None) == old
    if said:
        assert said.startswith(f"onnxruntime {version} is older than 1.23") and "\n" not in said


@pytest.mark.parametrize(("precision", "version", "skipped"), [
    ("fp8", "1.23.0", True), ("fp8", "1.31.1", True), ("fp8", "1.20.0+cu126", True),
    ("fp8", "1.32.0", False), ("fp8", "2.0.0", False), ("fp8", "unknown", False),
    ("int8", "1.23.0", False), ("fp32", "1.31.1", False), ("int4", "1.23.0", False)])
def test_which_models_load_without_the_qdq_fusion(precision: str, version: str,
                                                  skipped: bool) -> None:
    assert fusions_to_skip(precision, version) == ((QDQ_FUSION,) if skipped else ())


def test_a_model_that_fails_to_load_on_an_old_onnxruntime_says_so(
        tiny_pair_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What 1.20-1.22 say of the builder's graphs ("Unrecognized attribute: bits for operator
    GatherBlockQuantized") reads like a broken file; the fix that works is an upgrade."""
    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"not a graph")
    config = plan_threads().target
    with pytest.raises(ModelError, match="the file may be truncated"):
        sessions.start_session(broken, config, "the target model",
                               "the file may be truncated or corrupt: re-export the pair")
    monkeypatch.setattr(ort, "__version__", "1.22.1")
    with pytest.raises(ModelError, match=r"could not load the target model \(.*\); onnxruntime "
                                         r"1\.22\.1 is older than 1\.23.*docs/jetson\.md\)$"):
        sessions.start_session(broken, config, "the target model",
                               "the file may be truncated or corrupt: re-export the pair")
    assert any("onnxruntime 1.22.1 is older" in w
               for w in diagnose(self_test=False, jetson_root=tmp_path).warnings)
