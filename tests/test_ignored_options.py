"""Options and input that were silently ignored, or said something untrue, before session 18:
each test fails before its fix.

- `export --data` without `--calibrate` exported without calibrating, and a bad `--data` file
  failed only after the whole export;
- `quantize --exclude` with a mistyped node name quantized that node after all;
- `draft --vocab-sizes` at or above the vocabulary built "smaller" heads as large as the model's;
- a stop string holding a lone surrogate (undecodable bytes on the command line) could never
  match, so generation ran to its limit;
- a batch or prompt file that starts with a UTF-8 byte-order mark (as Windows editors write)
  failed on its first line;
- a KV cache whose heads differ from the manifest's was reported as "the past_key_values.0.key
  model's past_key_values.0.key has 2 ...", naming a tensor as the model;
- `export --chat-template /dev/zero` read without end (a MemoryError traceback under a memory
  cap), and a template file starting with a byte-order mark put U+FEFF into every prompt;
- chat said it had dropped the oldest exchanges for a turn that then failed, and so dropped
  nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specedge.runtime.errors import InputError, ModelError
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import read_prompts

from .test_hardening import (
    HAS_ONNX,
    HAS_TORCH,
    clean_error,
    edit_manifest,
    invoke,
    one_error_line,
    pair_copy,
    run_cli,
    runner,
)

__all__ = ["pair_copy", "runner"]  # fixtures, imported for the tests below


@pytest.mark.skipif(not HAS_TORCH, reason="needs the [export] extra")
def test_export_data_needs_calibrate_and_is_read_first(runner: CliRunner, tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("Some calibration text.\n")
    out = tmp_path / "out"
    result = invoke(runner, "export", "any/model", "-o", out, "--data", data)
    assert result.exit_code == 2, result.output
    assert "--data is calibration data for --calibrate" in result.stderr
    # A bad data file is refused before the export starts (the hub id would fail later).
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    result = invoke(runner, "export", "any/model", "-o", out, "--calibrate", "int8-minmax",
                    "--data", bad)
    clean_error(result, "bad.jsonl:1")
    assert not out.exists()


@pytest.mark.export
@pytest.mark.skipif(not HAS_ONNX, reason="needs the [export] extra")
def test_quantize_exclude_names_a_matmul(runner: CliRunner, tiny_pair_dir: Path,
                                         tmp_path: Path) -> None:
    out = tmp_path / "q"
    result = invoke(runner, "quantize", tiny_pair_dir, "-o", out, "--method", "int8-rtn",
                    "--exclude", "/lm_head/Matmul")
    line = clean_error(result, "--exclude '/lm_head/Matmul' is not a node of")
    assert "did you mean /lm_head/MatMul" in line
    assert not out.exists()
    from specedge.exporter.quantize import check_exclude

    graph = tiny_pair_dir / "target" / "model.onnx"
    check_exclude(graph, ("/lm_head/MatMul",), "int8-rtn")  # a real MatMul: accepted
    import onnx

    other = next(n for n in onnx.load(str(graph), load_external_data=False).graph.node
                 if n.op_type != "MatMul" and n.name)
    with pytest.raises(InputError, match="quantizes MatMul nodes only"):
        check_exclude(graph, (other.name,), "int8-rtn")
    check_exclude(graph, (other.name,), "fp16")  # fp16 keeps any node in float


@pytest.mark.export
@pytest.mark.skipif(not HAS_TORCH, reason="needs the [export] extra")
def test_draft_vocab_sizes_must_be_below_the_vocabulary(tmp_path: Path) -> None:
    from specedge.calibration.draft_search import DraftSearchOptions, search
    from specedge.exporter.tiny import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf", seed=3)
    opts = DraftSearchOptions(target=str(hf), output=tmp_path / "pair", vocab_sizes=(96, 100_000),
                              eval_prompts=("Hi",), ks=(1,), max_new_tokens=4)
    with pytest.raises(InputError, match=r"--vocab-sizes 100000: the target's vocabulary has"):
        search(opts, say=lambda _msg: None)
    assert not (tmp_path / "pair").exists()
    assert not any(p.name.startswith(".specedge-draft-") for p in tmp_path.iterdir())


def test_a_stop_string_must_be_text(runner: CliRunner, tiny_pair_dir: Path) -> None:
    with pytest.raises(InputError, match="the stop string .* lone surrogate U\\+DCFF"):
        GenerationConfig(stop=("ok", "\udcff"))
    result = invoke(runner, "generate", tiny_pair_dir, "Hello", "--stop", "\udcff")
    clean_error(result, "lone surrogate")


def test_a_byte_order_mark_starts_a_file(runner: CliRunner, concat_dir: Path,
                                         tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "Hello"}\n{"prompt": "Hi"}\n')
    assert read_prompts(prompts) == ("Hello", "Hi")
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "Hello"}).encode() + b"\n")
    result = invoke(runner, "generate", concat_dir, "--batch", batch, "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output


def test_chat_names_dropped_exchanges_only_when_the_turn_happens(runner: CliRunner,
                                                                 tiny_pair_dir: Path) -> None:
    """Two turns that fit, then one too long for the context even alone: chat must say the
    turn failed and that nothing was dropped (the conversation goes on whole)."""
    turns = ["Tell me a story about a robot " * 6] * 2 + ["robot " * 2500, "Hi"]
    result = invoke(runner, "chat", tiny_pair_dir, "--max-new-tokens", "8",
                    input="\n".join(turns) + "\n")
    assert result.exit_code == 0, result.output
    assert "error: the prompt has" in result.stderr, result.stderr
    assert "dropped" not in result.stderr, result.stderr
    assert result.stdout.count("> ") == len(turns) + 1


def test_a_kv_shape_error_names_the_model(pair_copy: Path) -> None:
    def change(d: dict) -> None:
        d["models"]["target"]["num_kv_heads"] += 1

    edit_manifest(pair_copy, change)
    with pytest.raises(ModelError, match=r"the target model's past_key_values\.0\.key has 2 at "
                                         r"dimension 1 but the manifest's num_kv_heads is 3"):
        Pair.load(pair_copy)


@pytest.mark.export
@pytest.mark.skipif(not HAS_TORCH, reason="needs the [export] extra")
def test_a_failed_builder_leaves_its_log_where_the_error_says(tmp_path: Path) -> None:
    """The export's working folder (which held the builder's log) is removed when the export
    fails; the error must name a log that still exists."""
    import re
    import shutil

    from specedge.exporter.onnx_export import build_gqa
    from specedge.runtime.errors import ExportError

    work = tmp_path / "work"
    work.mkdir()
    broken = tmp_path / "hf"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "architectures": ["Nope"]}')
    with pytest.raises(ExportError, match="builder failed") as info:
        build_gqa(broken, work / "out", "fp32", "cpu", work / "cache", {}, work / "b.log")
    shutil.rmtree(work)  # as a failed export does
    log = Path(re.search(r"full log: (\S+)$", str(info.value)).group(1))  # type: ignore[union-attr]
    assert log.is_file() and log.read_text().strip()
    log.unlink()


@pytest.mark.skipif(not HAS_TORCH, reason="needs the [export] extra")
def test_a_chat_template_file_is_read_bounded_and_without_its_bom(tmp_path: Path) -> None:
    from specedge.exporter.template_files import read_chat_template

    proc = run_cli(["export", "any/model", "-o", tmp_path / "out", "--chat-template",
                    "/dev/zero"], timeout=60, memory=2 << 30)
    one_error_line(proc, "--chat-template /dev/zero: larger than 1 MiB")
    assert not (tmp_path / "out").exists()
    template = tmp_path / "t.jinja"
    template.write_bytes(b"\xef\xbb\xbf{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(template).startswith("{% for")
