"""What a written pair holds besides the models (issue 17): file modes, the chat template and
where it came from, quiet output, the CPU defaults of `specedge export`, and the provider the
export was validated on (issue 13)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

pytestmark = [
    pytest.mark.export,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs [export]"),
]

from specedge.runtime.errors import InputError  # noqa: E402

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specedge.exporter.tiny import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("hf") / "llama", seed=5, tied=True)


def _modes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder.parent)): oct(stat.S_IMODE(p.stat().st_mode))
            for p in [folder, *folder.rglob("*")]}


def _assert_readable(folder: Path) -> None:
    modes = _modes(folder)
    wrong = {p: m for p, m in modes.items()
             if m != ("0o755" if (folder.parent / p).is_dir() else "0o644")}
    assert not wrong, wrong


def test_pair_files_are_readable_by_all(tmp_path: Path, hf: Path) -> None:
    """Files 0644, folders 0755 (the staging folder was 0700, and in the concat form both
    models' model.onnx.data were 0600), for `export` in both graph forms and for `quantize`,
    which writes through the same path."""
    from specedge.cli import main
    from specedge.exporter.pair import ExportOptions, export_pair

    old = os.umask(0o022)
    try:
        for graph in ("concat", "gqa-shared"):
            out = tmp_path / graph
            export_pair(ExportOptions(target=str(hf), output=out, draft_precision="int4",
                                      graph=graph, validate=False))
            _assert_readable(out)
        quantized = tmp_path / "quantized"
        result = CliRunner().invoke(main, ["quantize", str(out), "-o", str(quantized),
                                           "--method", "int8-rtn"])
        assert result.exit_code == 0, result.output
        _assert_readable(quantized)
    finally:
        os.umask(old)


def test_chat_template_from_a_file_replaces_the_models(tmp_path: Path, hf: Path) -> None:
    from specedge.cli import main
    from specedge.exporter.pair import ExportOptions, export_pair
    from specedge.runtime.pair import Pair

    file = tmp_path / "chat.jinja"
    file.write_text(TEMPLATE, encoding="utf-8")
    out = tmp_path / "pair"
    report = export_pair(ExportOptions(target=str(hf), output=out, chat_template=file,
                                       validate=False))
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config.get("chat_template", TEMPLATE) == TEMPLATE  # no second, different template
    origin = report.manifest.provenance["chat_template"]
    assert origin["source"] == "file" and origin["file"] == str(file)
    pair = Pair.load(out)
    assert pair.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    shown = CliRunner().invoke(main, ["inspect", str(out)])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["chat_template"]["source"] == "file"

    plain = export_pair(ExportOptions(target=str(hf), output=tmp_path / "plain",
                                      validate=False))
    assert plain.manifest.provenance["chat_template"]["source"] == "hf-folder"


@pytest.mark.parametrize(("kind", "has_template", "expected"), [
    ("gguf", True, "gguf"), ("folder", True, "hf-folder"), ("hub", True, "hf-folder"),
    ("folder", False, "none")])
def test_chat_template_source_is_recorded(tmp_path: Path, hf: Path, kind: str,
                                          has_template: bool, expected: str) -> None:
    import shutil

    from specedge.exporter import sources

    folder = tmp_path / "src"
    folder.mkdir()
    shutil.copy2(hf / "tokenizer.json", folder)
    config = json.loads((hf / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    if has_template:
        config["chat_template"] = TEMPLATE  # as a GGUF conversion or an older HF folder has it
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    dest = tmp_path / "dest"
    dest.mkdir()
    files, origin = sources.copy_tokenizer(sources.Source(folder, kind, "x"), dest, None)
    assert origin["source"] == expected
    assert ("chat_template.jinja" in files) == has_template


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    (b"\xff\xfe{{ bad", "not UTF-8"),
    (b"{% for m in messages %}{{ m }}", "not a valid jinja template (line 1"),
    (b"  \n", "empty"),
])
def test_bad_chat_template_is_one_clean_line(tmp_path: Path, hf: Path, content: bytes | None,
                                             message: str) -> None:
    from specedge.cli import main
    from specedge.exporter import template_files

    file = tmp_path / "chat.jinja"
    if content is not None:
        file.write_bytes(content)
    with pytest.raises(InputError, match="--chat-template"):
        template_files.read_chat_template(file)
    out = tmp_path / "pair"
    result = CliRunner().invoke(main, ["export", str(hf), "-o", str(out), "--precision", "fp32",
                                       "--chat-template", str(file)])
    assert result.exit_code == 1
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --chat-template") and message in \
        lines[0], result.output
    assert not out.exists() and not list(tmp_path.glob(".pair.tmp-*"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="100")
    return subprocess.run([sys.executable, "-m", "specedge.cli", *args], capture_output=True,
                          text=True, env=env, check=False, timeout=600)


def test_export_prints_no_third_party_info_unless_verbose(tmp_path: Path, hf: Path) -> None:
    """onnxruntime.quantization's matmul_nbits_quantizer calls logging.basicConfig(INFO) on
    import and logs a "skip to quantize" line per node; without -v none of it shows."""
    args = ["export", str(hf), "--precision", "fp32", "--draft-precision", "int4",
            "--graph", "concat", "--no-validate"]
    quiet = _cli(*args, "-o", str(tmp_path / "quiet"))
    assert quiet.returncode == 0, quiet.stderr
    both = quiet.stdout + quiet.stderr
    assert "[INFO]" not in both and "skip to quantize" not in both
    assert "Warning" not in both, both  # torch.onnx's tracer warnings in the concat form
    assert len(both.splitlines()) <= 40
    loud = _cli("-v", *args, "-o", str(tmp_path / "loud"))
    assert loud.returncode == 0, loud.stderr
    assert "skip to quantize" in loud.stdout + loud.stderr


def test_export_without_precision_flags_writes_the_fast_cpu_pair(tmp_path: Path,
                                                                 hf: Path) -> None:
    import onnx

    from specedge.cli import main
    from specedge.runtime.pair import GenerationConfig, Pair

    out = tmp_path / "pair"
    result = CliRunner().invoke(main, ["export", str(hf), "-o", str(out)])
    assert result.exit_code == 0, result.output
    notes = [ln for ln in result.output.splitlines() if ln.startswith("defaults for cpu:")]
    assert len(notes) == 1 and "int8-rtn" in notes[0] and "hybrid" in notes[0]
    # Each stage with its time on stderr, and the pair's sizes (issue 17, quiet and informative).
    stages = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
    assert any(ln.startswith("validating against torch:") and ln.endswith(" s")
               for ln in stages), stages
    assert any(ln.startswith("quantizing the draft (int8-rtn):") for ln in stages), stages
    assert re.search(r"target [0-9.]+ MiB; draft [0-9.]+ MiB", result.stdout), result.stdout
    manifest = json.loads((out / "specedge.json").read_text())
    target, draft = manifest["models"]["target"], manifest["models"]["draft"]
    assert target["precision"] == "fp32" and draft["precision"] == "int8"
    assert draft["source"]["quantization"]["method"] == "int8-rtn"
    assert draft["source"]["quantization"]["block_size"] == 32
    assert draft["validation"]["passed"]
    assert manifest["defaults"]["drafter"] == "hybrid"
    assert manifest["defaults"]["num_draft_tokens"] == 5
    assert manifest["defaults"]["adaptive"] is False
    graph = onnx.load(str(out / "draft" / "model.onnx"), load_external_data=False)
    nbits = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(a.i == 8 for n in nbits for a in n.attribute if a.name == "bits")
    pair = Pair.load(out)
    ids = pair.encode_prompt("The quick brown fox jumps")
    base, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=24, drafter="none"))
    fast, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=24))
    assert fast == base

    # An explicit precision keeps its old meaning: that target, no draft model.
    explicit = tmp_path / "explicit"
    result = CliRunner().invoke(main, ["export", str(hf), "-o", str(explicit), "--precision",
                                       "fp32", "--no-validate"])
    assert result.exit_code == 0, result.output
    assert "defaults for cpu" not in result.output
    assert "nan" not in result.output and "not validated" in result.output  # no "nan%" cells
    manifest = json.loads((explicit / "specedge.json").read_text())
    assert "draft" not in manifest["models"] and manifest["defaults"]["drafter"] == "ngram"


def test_inspect_names_an_unrecorded_template_source(tmp_path: Path,
                                                     tiny_pair_dir: Path) -> None:
    """A pair written before the exporter recorded the template's source says "unknown"."""
    import shutil

    from specedge.cli import main

    pair = tmp_path / "pair"
    shutil.copytree(tiny_pair_dir, pair)
    manifest = json.loads((pair / "specedge.json").read_text())
    manifest.get("provenance", {}).pop("chat_template", None)
    (pair / "specedge.json").write_text(json.dumps(manifest))
    shown = CliRunner().invoke(main, ["inspect", str(pair)])
    assert shown.exit_code == 0, shown.output
    has_template = "chat_template.jinja" in manifest["tokenizer"]["files"]
    assert json.loads(shown.output)["chat_template"] == {
        "source": "unknown" if has_template else "none"}
