"""Exporter tests on tiny seeded models: every architecture, precisions, bad input."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.export,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs [export]"),
]

from specedge.runtime.errors import SpecEdgeError  # noqa: E402

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "gpt2"]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("export")


def _export(target: Path | str, out: Path, **kw: object):  # noqa: ANN202
    from specedge.exporter.pair import ExportOptions, export_pair

    return export_pair(ExportOptions(target=str(target), output=out, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_exports_validates_and_decodes(work: Path, arch: str) -> None:
    from specedge.exporter.tiny import make_tiny_model
    from specedge.runtime.pair import GenerationConfig, Pair

    hf = make_tiny_model(arch, work / arch, seed=1)
    report = _export(hf, work / f"{arch}-pair")
    v = report.manifest.target.validation
    assert v["passed"] and v["tolerance"] == 1e-3
    assert v["step_with_past"]["max_abs_diff"] <= 1e-3
    assert v["step_with_past"]["top1_agreement"] >= 0.99
    assert v["prefill"]["max_abs_diff"] <= 1e-3
    assert v["batch2_max_abs_diff"] <= 1e-5
    pair = Pair.load(report.folder)
    ids = pair.encode_prompt("The quick brown fox jumps")
    base, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=24, drafter="none"))
    spec, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=24, drafter="ngram",
                                                         num_draft_tokens=4, adaptive=False))
    assert spec == base


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_drafts_report_agreement(work: Path, precision: str) -> None:
    from specedge.exporter.tiny import make_tiny_model
    from specedge.runtime.pair import GenerationConfig, Pair

    hf = work / "llama-q"
    if not (hf / "config.json").is_file():
        make_tiny_model("llama", hf, seed=2)
    report = _export(hf, work / f"q-{precision}", draft_precision=precision)
    draft = report.manifest.draft
    assert draft is not None and draft.precision == precision
    v = draft.validation
    assert v["tolerance"] is None and 0.0 <= v["step_with_past"]["top1_agreement"] <= 1.0
    assert v["step_with_past"]["kl_mean"] >= 0.0
    pair = Pair.load(report.folder)
    ids = pair.encode_prompt("Edge devices")
    base, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=20, drafter="none"))
    spec, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=20, drafter="model",
                                                         num_draft_tokens=3, adaptive=False))
    assert spec == base


def _no_leftovers(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(SpecEdgeError, match="no such file or folder"):
        _export(tmp_path / "nope", tmp_path / "out")
    _no_leftovers(tmp_path / "out")


def test_not_a_causal_lm(tmp_path: Path) -> None:
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert",
                                                    "architectures": ["BertModel"]}))
    with pytest.raises(SpecEdgeError, match="not supported; supported model types: gemma"):
        _export(folder, tmp_path / "out")
    _no_leftovers(tmp_path / "out")


def test_draft_with_another_vocabulary(tmp_path: Path, work: Path) -> None:
    from specedge.exporter.tiny import make_tiny_model, make_tokenizer

    target = make_tiny_model("llama", tmp_path / "t", seed=0)
    draft = make_tiny_model("llama", tmp_path / "d", seed=0)
    make_tokenizer(draft, vocab_size=300)  # same model, a different tokenizer
    with pytest.raises(SpecEdgeError, match="different vocabularies"):
        _export(target, tmp_path / "out", draft=str(draft))
    _no_leftovers(tmp_path / "out")


def test_unwritable_output(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SpecEdgeError, match="cannot create the output folder|not writable"):
        _export(tmp_path / "whatever", blocker / "pair")


def test_existing_output_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SpecEdgeError, match="--force"):
        _export(tmp_path / "whatever", out)
    assert (out / "keep.txt").read_text() == "mine"


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(SpecEdgeError, match="could not read the GGUF file"):
        _export(bad, tmp_path / "out")
    _no_leftovers(tmp_path / "out")
    notgguf = tmp_path / "weights.bin"
    notgguf.write_bytes(b"\x00" * 32)
    with pytest.raises(SpecEdgeError, match="not a .gguf file"):
        _export(notgguf, tmp_path / "out")


def test_validation_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           work: Path) -> None:
    """A failed validation (simulated by a zero tolerance) aborts the export atomically."""
    from specedge.exporter import validate
    from specedge.exporter.tiny import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "m", seed=3)
    monkeypatch.setitem(validate.TOLERANCE, "fp32", 0.0)
    with pytest.raises(SpecEdgeError, match="differs from torch"):
        _export(hf, tmp_path / "out")
    _no_leftovers(tmp_path / "out")


def test_fp16_needs_a_gpu_provider(tmp_path: Path) -> None:
    with pytest.raises(SpecEdgeError, match="--provider cuda"):
        _export(tmp_path / "whatever", tmp_path / "out", precision="fp16")


def test_fp16_for_cuda_exports_and_validates_on_cpu(work: Path) -> None:
    from specedge.exporter.tiny import make_tiny_model

    hf = work / "llama-fp16"
    make_tiny_model("llama", hf, seed=4)
    report = _export(hf, work / "fp16-pair", precision="fp16", provider="cuda")
    target = report.manifest.target
    assert target.precision == "fp16" and target.kv.dtype == "float16"
    assert target.validation["passed"] and target.validation["tolerance"] == 5e-2
