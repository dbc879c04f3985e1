"""Calibration: data readers and errors, calibrated quantization, quality report, tune."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from specedge.calibration import data
from specedge.runtime.errors import InputError, SpecEdgeError
from specedge.runtime.manifest import load_manifest
from specedge.runtime.pair import Pair

needs_onnx = pytest.mark.skipif(importlib.util.find_spec("onnx") is None,
                                reason="quantizers need the onnx package ([export])")


def test_read_texts_formats(tmp_path: Path) -> None:
    assert data.read_texts(None) == list(data.BUILTIN_TEXTS)
    txt = tmp_path / "a.txt"
    txt.write_text("first paragraph\nstill first\n\nsecond\n")
    assert data.read_texts(txt) == ["first paragraph\nstill first", "second"]
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"text": "t"}\n{"prompt": "p"}\n'
                  '{"messages": [{"role": "user", "content": "hi"}]}\n')
    texts = data.read_texts(jl)
    assert texts == ["t", "p", [{"role": "user", "content": "hi"}]]
    # a .txt file is plain text, whatever it looks like (it was parsed as a chat before)
    chatty = tmp_path / "b.txt"
    chatty.write_text('[{"role": "user", "content": "hi"}]\n')
    assert data.read_texts(chatty) == ['[{"role": "user", "content": "hi"}]']


@pytest.mark.parametrize("content, suffix, match", [
    ("", ".txt", "no calibration text"),
    ("\n\n\n", ".txt", "no calibration text"),
    ("not json\n", ".jsonl", ":1: not valid JSON"),
    ('["a list"]\n', ".jsonl", ":1: expected a JSON object"),
    ('{"other": 1}\n', ".jsonl", ":1: expected a \"text\""),
    ('{"text": "t"}\n{"messages": []}\n', ".jsonl", ":2: chat messages must be a non-empty"),
    ('{"messages": [{"foo": 1}]}\n', ".jsonl", ":1: chat message 0 has no 'role' key"),
])
def test_bad_calibration_files(tmp_path: Path, content: str, suffix: str, match: str) -> None:
    f = tmp_path / f"bad{suffix}"
    f.write_text(content)
    with pytest.raises(InputError, match=match):
        data.read_texts(f)


def test_missing_and_binary_calibration_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such calibration file"):
        data.read_texts(tmp_path / "nope.txt")
    b = tmp_path / "b.txt"
    b.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(InputError, match="cannot read"):
        data.read_texts(b)


def test_calibration_text_longer_than_context(tiny_pair: Pair) -> None:
    with pytest.raises(InputError, match="more than the context"):
        data.tokenize(tiny_pair, ["word " * 2000], data.CalibrationOptions())


def test_feeds_cover_prefill_and_steps_with_real_past(tiny_pair: Pair,
                                                      tiny_pair_dir: Path) -> None:
    opts = data.CalibrationOptions(samples=2, step_sizes=(1, 3))
    tokens = data.tokenize(tiny_pair, data.BUILTIN_TEXTS, opts)
    feeds = list(data.model_feeds(tiny_pair_dir, tiny_pair.target, tokens, opts))
    assert len(feeds) == 2 * 3
    spec = tiny_pair.manifest.target
    past = spec.kv.past_key.format(i=0)
    assert feeds[0][past].shape[2] == 0
    assert feeds[1][spec.input_ids].shape[1] == 1 and feeds[1][past].shape[2] > 0
    assert abs(feeds[1][past]).sum() > 0  # real keys, not zeros
    assert feeds[2][spec.input_ids].shape[1] == 3


@needs_onnx
@pytest.mark.export
@pytest.mark.parametrize("method", ["int8-minmax", "int8-percentile", "int4-gptq", "int4-rtn",
                                    "int4-hqq", "fp8", "fp16"])
def test_quantize_writes_a_valid_pair_with_a_report(tiny_pair_dir: Path, tmp_path: Path,
                                                    method: str) -> None:
    from specedge.calibration.quality import annotate
    from specedge.calibration.quantize import QuantizeOptions, quantize
    from specedge.runtime.pair import GenerationConfig

    out = quantize(QuantizeOptions(pair=tiny_pair_dir, output=tmp_path / "q", method=method,
                                   calibration=data.CalibrationOptions(samples=3)),
                   say=lambda _m: None)
    report = annotate(tiny_pair_dir, out, "target", prompts=2)
    assert report["perplexity"] > 1 and 0 <= report["top1_agreement"] <= 1
    assert report["kl_mean"] >= 0 and "greedy_vs_reference" in report
    manifest = load_manifest(out)  # hashes of the new files verify
    assert manifest.target.precision == method.split("-")[0]
    assert manifest.target.source["quantization"]["method"] == method
    assert manifest.target.validation["quality"]["perplexity"] == report["perplexity"]
    pair = Pair.load(out)
    assert len(pair.generate("The quick", GenerationConfig(max_new_tokens=6)).tokens) == 6
    assert load_manifest(tiny_pair_dir).target.precision == "fp32"  # source untouched


@needs_onnx
@pytest.mark.export
def test_repeated_nodes_are_dropped_and_the_graph_loads(tmp_path: Path) -> None:
    """onnxruntime's float16 converter before 1.32 writes two identical Casts of one value (the
    fp16 row above failed so on 1.31: "two nodes with same node name"); the first one stays."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specedge.exporter.quantize import drop_duplicate_nodes
    from specedge.runtime.sessions import SessionConfig, session_options

    cast = helper.make_node("Cast", ["x"], ["x32"], name="x_cast", to=TensorProto.FLOAT)
    other = helper.make_node("Cast", ["x"], ["x64"], name="x_cast64", to=TensorProto.DOUBLE)
    nodes = [cast, helper.make_node("Relu", ["x32"], ["a"], name="relu"), cast,
             helper.make_node("Neg", ["x32"], ["b"], name="neg"), other]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("a", "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = session_options(SessionConfig())  # the shared pool, where an earlier test made it
    with pytest.raises(Exception, match="same node name"):
        ort.InferenceSession(model.SerializeToString(), options,
                             providers=["CPUExecutionProvider"])
    assert drop_duplicate_nodes(model.graph) == 1
    assert [n.name for n in model.graph.node] == ["x_cast", "relu", "neg", "x_cast64"]
    assert drop_duplicate_nodes(model.graph) == 0
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    a, b = session.run(None, {"x": np.array([-1.5, 2.0], np.float16)})
    assert a.tolist() == [0.0, 2.0] and b.tolist() == [1.5, -2.0]


@needs_onnx
@pytest.mark.export
def test_quantize_refuses_bad_requests(tiny_pair_dir: Path, tmp_path: Path) -> None:
    from specedge.calibration.quantize import QuantizeOptions, quantize

    with pytest.raises(InputError, match="--method"):
        QuantizeOptions(pair=tiny_pair_dir, output=tmp_path / "q", method="int3")
    with pytest.raises(InputError, match="already int4"):
        quantize(QuantizeOptions(pair=tiny_pair_dir, output=tmp_path / "q",
                                 method="int4-rtn", model="draft"), say=lambda _m: None)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SpecEdgeError, match="no calibration text"):
        quantize(QuantizeOptions(pair=tiny_pair_dir, output=tmp_path / "q2",
                                 method="int8-minmax", data_file=empty), say=lambda _m: None)
    assert not (tmp_path / "q2").exists()


def test_tune_picks_the_fastest_measured_setting(tiny_pair_dir: Path, tmp_path: Path) -> None:
    import shutil

    from specedge.calibration.tune import TuneOptions, pick_best, tune

    pair_dir = tmp_path / "pair"
    shutil.copytree(tiny_pair_dir, pair_dir)
    table = tune(TuneOptions(pair=pair_dir, prompts=("The quick", "def add"), ks=(1, 2, 3),
                             drafters=("model", "ngram"), max_new_tokens=12))
    best = table["best"]
    assert best == pick_best(table["rows"])
    assert {(r["drafter"], r["adaptive"]) for r in table["rows"]} >= {
        ("model", True), ("ngram", True), ("model", False), ("none", False)}
    defaults = load_manifest(pair_dir).defaults
    if best["drafter"] != "none":
        assert (defaults.drafter, defaults.num_draft_tokens, defaults.adaptive) == (
            best["drafter"], best["k"], best["adaptive"])
    assert "tune" in load_manifest(pair_dir).provenance


def test_tune_keeps_adaptive_k_within_the_margin_of_the_fastest() -> None:
    from specedge.calibration.tune import ADAPTIVE_MARGIN, pick_best

    def row(drafter: str, k: int, adaptive: bool, tps: float) -> dict[str, object]:
        return {"drafter": drafter, "k": k, "adaptive": adaptive, "tokens_per_s": tps}

    fixed, adaptive = row("hybrid", 5, False, 100.0), row("hybrid", 8, True, 98.0)
    none = row("none", 0, False, 60.0)
    assert pick_best([none, fixed, adaptive]) is adaptive
    slow = row("hybrid", 8, True, 100.0 * ADAPTIVE_MARGIN - 1)
    assert pick_best([none, fixed, slow]) is fixed
    # When target-only is fastest, drafting is not kept however close adaptive comes.
    assert pick_best([row("none", 0, False, 101.0), fixed, adaptive])["drafter"] == "none"


@needs_onnx
@pytest.mark.export
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs [export]")
def test_export_with_calibrate(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter.tiny import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf", seed=6)
    out = tmp_path / "pair"
    result = CliRunner().invoke(main, ["export", str(hf), "-o", str(out), "--draft-precision",
                                       "int4", "--calibrate", "int4-rtn"])
    assert result.exit_code == 0, result.output
    # The validation table is whole although stdout is not a terminal (issue 15, bug 11).
    assert "…" not in result.stdout
    assert "precision" in result.stdout and "gqa-shared" in result.stdout
    manifest = load_manifest(out)
    assert manifest.target.precision == "int4" and manifest.draft is not None
    assert "quality" in manifest.target.validation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "pair"]
    bad = CliRunner().invoke(main, ["export", str(hf), "-o", str(tmp_path / "x"), "--precision",
                                    "int4", "--calibrate", "int4-rtn"])
    assert bad.exit_code != 0 and not (tmp_path / "x").exists()
