"""Bad model folders and files given to the exporter, from an audit of its inputs (session 18):
each case gave a traceback, a misleading message, a late failure or an output left behind
before its fix. Every case must end in one `error:` line, exit 1, and nothing at `-o`."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from .test_hardening import clean_error, invoke, one_error_line, rehash, run_cli

pytestmark = [
    pytest.mark.export,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs [export]"),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specedge.exporter.tiny import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("hf") / "hf", seed=3)


def _copy(base: Path, tmp_path: Path, change: Callable[[Path], None]) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    change(folder)
    return folder


def _config(key: str, value: object) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg[key] = value
        (folder / "config.json").write_text(json.dumps(cfg))
    return change


def _write(name: str, content: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(content)


def _zero(name: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to("/dev/zero")
    return change


@pytest.mark.parametrize(("change", "message"), [
    (_config("num_hidden_layers", 0), "num_hidden_layers is 0; the target needs at least one"),
    (_write("generation_config.json", "{bad"), "generation_config.json: unreadable (not JSON"),
    (_zero("generation_config.json"), "generation_config.json: not a regular file"),
    (_write("tokenizer.json", "{bad"), "tokenizer.json: not a tokenizer the tokenizers"),
    (lambda f: (f / "tokenizer.json").unlink(), "no tokenizer.json (a fast tokenizer"),
    (_write("chat_template.jinja", "{% for %}"), "chat_template.jinja: not a valid jinja"),
    (_write("chat_template.jinja", "{{ raise_exception('no') }}"), "rejected the messages"),
], ids=["zero-layers", "generation-config-not-json", "generation-config-dev-zero",
        "tokenizer-not-json", "no-tokenizer", "template-not-jinja", "template-raises"])
def test_a_bad_model_folder_fails_before_any_build(runner: CliRunner, base: Path,
                                                   tmp_path: Path, change: Callable[[Path], None],
                                                   message: str) -> None:
    folder = _copy(base, tmp_path, change)
    out = tmp_path / "out"
    result = invoke(runner, "export", folder, "-o", out, "--precision", "fp32")
    clean_error(result, message)
    assert "exporting the target" not in result.stderr  # refused before building anything
    assert not out.exists()


def test_a_bad_draft_folder_fails_in_one_line(runner: CliRunner, base: Path,
                                              tmp_path: Path) -> None:
    draft = _copy(base, tmp_path, _write("tokenizer.json", "[]"))
    out = tmp_path / "out"
    result = invoke(runner, "export", base, "--draft", draft, "-o", out, "--no-validate")
    clean_error(result, "tokenizer.json: not a tokenizer the tokenizers")
    assert not out.exists()


def test_a_template_override_that_renders_no_message_is_refused(runner: CliRunner, base: Path,
                                                                tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    result = invoke(runner, "export", base, "-o", tmp_path / "out", "--chat-template", template)
    clean_error(result, "renders a user message without its text")
    # An override replaces a broken template of the folder, which is then not judged.
    broken = _copy(base, tmp_path, _write("chat_template.jinja", "{% for %}"))
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    result = invoke(runner, "export", broken, "-o", tmp_path / "ok", "--precision", "fp32",
                    "--no-validate", "--chat-template", template)
    assert result.exit_code == 0, result.output


def test_a_device_or_pipe_as_the_model_is_named(runner: CliRunner, tmp_path: Path) -> None:
    zero = tmp_path / "zero.gguf"
    zero.symlink_to("/dev/zero")
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    for path in (zero, fifo):
        result = invoke(runner, "export", path, "-o", tmp_path / "out")
        clean_error(result, "not a regular file nor a folder")


# Each way a folder's model is loaded: validation; ONNX Runtime GenAI's builder in its child
# process (with --no-validate it used to write the random values transformers filled in, exit 0);
# the torch export of the concat form.
@pytest.mark.parametrize("options", [[], ["--no-validate"],
                                     ["--no-validate", "--graph", "concat-standard"]],
                         ids=["validated", "builder", "torch-export"])
def test_weights_missing_from_the_checkpoint_are_named(base: Path, tmp_path: Path,
                                                       options: list[str]) -> None:
    from safetensors.torch import load_file, save_file

    def drop(folder: Path) -> None:
        weights = load_file(folder / "model.safetensors")
        del weights["model.layers.0.mlp.down_proj.weight"]
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    folder = _copy(base, tmp_path, drop)
    out = tmp_path / "out"
    proc = run_cli(["export", folder, "-o", out, "--precision", "fp32", *options], timeout=300)
    line = one_error_line(proc, "the checkpoint lacks 1 weight(s)")
    assert "model.layers.0.mlp.down_proj.weight" in line and ".tmp-" not in line
    assert "LOAD REPORT" not in proc.stderr  # transformers' own table, without -v
    assert not out.exists()


def test_the_builders_loader_checks_every_way_it_is_called(base: Path, tmp_path: Path) -> None:
    """`builder_shim.install_checks` in a child process, as the builder runs: a model class's
    `from_pretrained` by keyword, by position and through the auto class all refuse a checkpoint
    that lacks a weight; a complete one loads, with loading info when asked for."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    def drop(folder: Path) -> None:
        weights = load_file(folder / "model.safetensors")
        del weights["model.layers.1.self_attn.q_proj.weight"]
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    broken = _copy(base, tmp_path, drop)
    script = f"""
from specedge.exporter.builder_shim import install_checks
from specedge.runtime.errors import ExportError
install_checks()
from transformers import AutoModelForCausalLM, LlamaForCausalLM
calls = [lambda: LlamaForCausalLM.from_pretrained(pretrained_model_name_or_path={str(broken)!r}),
         lambda: LlamaForCausalLM.from_pretrained({str(broken)!r}),
         lambda: AutoModelForCausalLM.from_pretrained({str(broken)!r})]
for call in calls:
    try:
        call()
        print("loaded")
    except ExportError as exc:
        print("refused:", exc)
model, info = AutoModelForCausalLM.from_pretrained({str(base)!r}, output_loading_info=True)
print("complete:", type(model).__name__, sorted(info))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused = [ln for ln in lines if ln.startswith("refused:")]
    assert len(refused) == 3, lines
    assert all("model.layers.1.self_attn.q_proj.weight" in ln for ln in refused)
    assert any(ln.startswith("complete: LlamaForCausalLM") and "missing_keys" in ln
               for ln in lines), lines


def test_quantize_leaves_no_output_when_its_quality_check_fails(runner: CliRunner,
                                                                tiny_pair_dir: Path,
                                                                tmp_path: Path) -> None:
    pair = tmp_path / "pair"
    shutil.copytree(tiny_pair_dir, pair)
    (pair / "chat_template.jinja").write_text("{% for %}")
    rehash(pair, "chat_template.jinja")
    out = tmp_path / "q"
    result = invoke(runner, "quantize", pair, "-o", out, "--method", "int8-rtn")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1].startswith("error: the chat template")
    assert not out.exists()


def test_an_output_under_a_file_is_named(runner: CliRunner, base: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    result = invoke(runner, "export", base, "-o", tmp_path / "afile" / "sub" / "pair")
    clean_error(result, "afile is a file, not a folder; choose another --output")


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()
