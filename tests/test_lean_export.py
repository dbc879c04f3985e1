"""Lean pairs: external data in both graph forms, tied embeddings stored once, GGUF chat
templates (issue 17)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.export,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs [export]"),
]


def _table_copies(onnx_file: Path, vocab: int, hidden: int) -> list[str]:
    """Float initializers shaped like the embedding or its transpose."""
    import onnx

    model = onnx.load(str(onnx_file), load_external_data=False)
    shapes = ([vocab, hidden], [hidden, vocab])
    return [i.name for i in model.graph.initializer
            if list(i.dims) in shapes and i.data_type == onnx.TensorProto.FLOAT]


@pytest.mark.parametrize(("graph", "tied"), [("concat", True), ("concat-standard", True),
                                             ("gqa-shared", True), ("gqa-shared", False)])
def test_pair_is_lean_and_exact(tmp_path: Path, graph: str, tied: bool,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    from specedge.exporter import onnx_export
    from specedge.exporter.pair import ExportOptions, export_pair
    from specedge.exporter.tiny import make_tiny_model
    from specedge.runtime.pair import GenerationConfig, Pair

    builds: list[str] = []
    build_gqa = onnx_export.build_gqa

    def counted(hf_dir: Path, out: Path, precision: str, *args: object) -> object:
        builds.append(precision)
        return build_gqa(hf_dir, out, precision, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(onnx_export, "build_gqa", counted)
    hf = make_tiny_model("llama", tmp_path / "hf", seed=3, tied=tied)
    out = tmp_path / "pair"
    report = export_pair(ExportOptions(target=str(hf), output=out, graph=graph,
                                       draft_precision="int4"))
    # One fp32 build: the int4 self-draft is quantized from the target's files (in a child
    # process), not built a second time (issue 17: the builder's int4 run was the peak).
    # (The concat form is the builder's graph rewritten; concat-standard is torch's.)
    assert builds == ([] if graph == "concat-standard" else ["fp32"])
    assert report.manifest.draft.source["quantization"]["method"] == "int4-rtn"
    for name in ("target", "draft"):
        spec = getattr(report.manifest, name)
        assert spec.validation["passed"]
        assert (out / name / "model.onnx.data").is_file()  # always external data
    vocab = report.manifest.vocab_size
    copies = _table_copies(out / "target" / "model.onnx", vocab, 64)
    assert len(copies) == (1 if tied else 2)  # a tied table is stored once
    assert _table_copies(out / "draft" / "model.onnx", vocab, 64) == []  # int4 embedding too
    import onnx

    draft = onnx.load(str(out / "draft" / "model.onnx"), load_external_data=False)
    assert "GatherBlockQuantized" in {n.op_type for n in draft.graph.node}
    pair = Pair.load(out)
    ids = pair.encode_prompt("The quick brown fox jumps")
    base, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=24, drafter="none"))
    spec, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=24, drafter="model",
                                                         num_draft_tokens=3))
    assert spec == base


def test_chat_template_from_gguf_metadata(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from specedge.exporter import template_files

    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    for name, value in (("with.gguf", template), ("without.gguf", None)):
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        if value is not None:
            writer.add_chat_template(value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    assert template_files.gguf_chat_template(tmp_path / "with.gguf") == template
    assert template_files.gguf_chat_template(tmp_path / "without.gguf") is None
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{}")
    template_files.set_chat_template(folder, template)
    assert (folder / "chat_template.jinja").read_text() == template
    assert '"chat_template"' in (folder / "tokenizer_config.json").read_text()
