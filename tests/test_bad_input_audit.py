"""Regression tests for the bad-input audit of session 17: each case gave a traceback, clobbered a
file, exited with the wrong code or said the wrong thing before its fix."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from specedge.runtime.errors import InputError, OutputError, SpecEdgeError
from specedge.runtime.files import write_atomic
from specedge.runtime.pair import GenerationConfig, Pair

from .test_hardening import CLI, clean_error, invoke, one_error_line, pair_copy, rehash, run_cli

__all__ = ["pair_copy"]  # a fixture, imported for the tests below

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_SERVE = importlib.util.find_spec("uvicorn") is not None


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


# ----------------------------------------------------------------------------- report files


def test_write_atomic_refuses_a_pipe_and_writes_through_a_link(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="not a regular file"):
        write_atomic(fifo, "{}")
    assert fifo.is_fifo()  # a rename used to replace it with a regular file
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    with pytest.raises(OutputError, match="is a folder"):
        write_atomic(tmp_path, "{}")


@pytest.mark.parametrize("case", ["prompts", "plot", "fifo"])
def test_bench_outputs_never_replace_inputs_or_each_other(runner: CliRunner, tiny_pair_dir: Path,
                                                          tmp_path: Path, case: str) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n")
    out = {"prompts": prompts, "plot": tmp_path / "same.out", "fifo": tmp_path / "fifo"}[case]
    if case == "fifo":
        os.mkfifo(out)
    args = ["bench", tiny_pair_dir, "--prompts", prompts, "--ks", "1", "--repeats", "1",
            "--max-new-tokens", "2", "--json", out]
    if case == "plot":
        args += ["--plot", out]
    clean_error(invoke(runner, *args), str(out))
    assert prompts.read_text() == "Hello\n"
    assert out.is_fifo() if case == "fifo" else (case == "prompts" or not out.exists())


# ----------------------------------------------------------------------------- tracebacks


def test_quantize_negative_seed_is_one_line() -> None:
    from specedge.calibration.data import CalibrationOptions

    with pytest.raises(InputError, match="--seed"):
        CalibrationOptions(seed=-1)


@pytest.mark.export
@pytest.mark.skipif(not HAS_TORCH, reason="needs the [export] extra")
def test_export_config_of_the_wrong_type_is_one_line(tmp_path: Path) -> None:
    from specedge.exporter.folder_files import hf_config
    from specedge.exporter.tiny import make_tiny_model
    from specedge.runtime.errors import ExportError

    folder = make_tiny_model("llama", tmp_path / "m", seed=0)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = "two"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="config.json: transformers cannot read it"):
        hf_config(folder)


@pytest.mark.export
@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="needs onnx")
def test_split_head_on_a_corrupt_model_is_one_line(pair_copy: Path) -> None:
    from specedge.exporter.split_head import split_head
    from specedge.runtime.errors import ModelError
    from specedge.runtime.manifest import load_manifest

    model = pair_copy / "target" / "model.onnx"
    model.write_bytes(model.read_bytes()[:5000])
    rehash(pair_copy, "target/model.onnx")
    spec = load_manifest(pair_copy, verify_hashes=False).target
    with pytest.raises(ModelError, match="not a valid ONNX file"):
        split_head(pair_copy, spec)


def test_an_empty_chat_template_blames_the_template(pair_copy: Path) -> None:
    (pair_copy / "chat_template.jinja").write_text("")
    rehash(pair_copy, "chat_template.jinja")
    pair = Pair.load(pair_copy)
    with pytest.raises(InputError, match="chat template rendered these messages as no tokens"):
        pair.generate("Hi", GenerationConfig(max_new_tokens=2, chat=True))


def test_chat_with_stdin_closed_and_invalid_system(tiny_pair_dir: Path) -> None:
    closed = subprocess.run([*CLI, "chat", str(tiny_pair_dir)], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60,
                            preexec_fn=lambda: os.close(0), check=False)
    assert closed.returncode == 1 and "Traceback" not in closed.stderr, closed.stderr
    assert closed.stderr.startswith("error: chat reads its turns from stdin"), closed.stderr
    bad = run_cli(["chat", tiny_pair_dir, "--system", b"\xff"], input=b"hi\n")
    one_error_line(bad, "--system is not valid UTF-8")  # exited 0 after failing every turn


def test_closed_stdout_full_disk_and_closed_pipe(tiny_pair_dir: Path) -> None:
    gen = subprocess.run([*CLI, "generate", str(tiny_pair_dir), "Hi", "--max-new-tokens", "2"],
                         capture_output=False, stderr=subprocess.PIPE, text=True, timeout=60,
                         preexec_fn=lambda: os.close(1), check=False)
    assert gen.returncode == 0 and "Traceback" not in gen.stderr, gen.stderr
    if Path("/dev/full").exists():
        for args in (["--help"], ["doctor"]):
            with open("/dev/full", "w") as full:
                proc = subprocess.run([*CLI, *args], stdout=full, stderr=subprocess.PIPE,
                                      text=True, timeout=120, check=False)
            assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
            assert proc.stderr.strip().startswith("error:") and len(
                proc.stderr.strip().splitlines()) == 1, proc.stderr
    doctor = subprocess.Popen([*CLI, "doctor"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert doctor.stdout is not None
    doctor.stdout.readline()
    doctor.stdout.close()  # `| head -1`
    _, err = doctor.communicate(timeout=120)
    assert doctor.returncode == 141 and not err, (doctor.returncode, err)  # rich exited 1


@pytest.mark.skipif(not HAS_SERVE, reason="needs the [serve] extra")
def test_serve_on_a_taken_port_is_one_line(tiny_pair_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli(["serve", tiny_pair_dir, "--port", port], timeout=60)
    line = one_error_line(proc, f"cannot listen on 127.0.0.1:{port}")
    assert "choose another --port" in line and proc.returncode == 1  # was exit 3, 7 log lines


# ----------------------------------------------------------------------------- exit codes, timing


def test_generate_without_prompt_or_batch_is_a_usage_error(runner: CliRunner,
                                                           tiny_pair_dir: Path) -> None:
    result = invoke(runner, "generate", tiny_pair_dir)
    clean_error(result, "give a PROMPT or --batch FILE")
    assert result.exit_code == 2


def test_bench_model_drafts_need_a_draft(tiny_pair_dir: Path) -> None:
    from specedge.runtime.bench import bench_drafter

    pair = Pair.load(tiny_pair_dir, load_draft=False)
    with pytest.raises(InputError, match="--drafter model needs a draft model"):
        bench_drafter(pair, "model")  # measured target-only alone and exited 0
    assert bench_drafter(pair, None) == "ngram" and bench_drafter(pair, "ngram") == "ngram"
    assert bench_drafter(Pair.load(tiny_pair_dir), None) == "model"


@pytest.mark.export
@pytest.mark.skipif(not HAS_TORCH, reason="needs the [export] extra")
@pytest.mark.parametrize(("change", "message"), [
    ({"ks": (0,)}, "--ks takes values in 1..64, got 0"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"eval_prompts": ("  ",)}, "a prompt of --prompts is empty"),
    ({"vocab_sizes": (8,)}, "got 8"),
])
def test_draft_options_fail_before_building(tmp_path: Path, change: dict, message: str) -> None:
    from specedge.calibration.draft_search import DraftSearchOptions

    options = {"target": "t", "output": tmp_path / "o", "eval_prompts": ("Hi",), **change}
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        DraftSearchOptions(**options)


def test_an_empty_jsonl_prompt_names_its_line(tmp_path: Path) -> None:
    from specedge.runtime.prompts import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "Hi"}\n{"prompt": " "}\n')
    with pytest.raises(InputError, match=r"p.jsonl:2: \"prompt\" is empty"):
        read_prompts(path)


# ----------------------------------------------------------------------------- Python API


def test_api_mistakes_are_specedge_errors(tiny_pair: Pair, concat_dir: Path,
                                          tiny_pair_dir: Path) -> None:
    from specedge.runtime.serving import ContinuousBatch

    mistakes = [
        lambda: tiny_pair.generate("Hi", {"max_new_tokens": 4}),  # type: ignore[arg-type]
        lambda: tiny_pair.generate_batch(["Hi", "Yo"], [None, None]),  # type: ignore[list-item]
        lambda: tiny_pair.generate_batch(["Hi"], {"max_new_tokens": 4}),  # type: ignore[arg-type]
        lambda: tiny_pair.generate_ids(None),  # type: ignore[arg-type]
        lambda: tiny_pair.plan(5),  # type: ignore[arg-type]
        lambda: Pair.load(None),  # type: ignore[arg-type]
        lambda: Pair.load(tiny_pair_dir, providers=5),  # type: ignore[arg-type]
        lambda: Pair.load(tiny_pair_dir, plan="x"),  # type: ignore[arg-type]
    ]
    for mistake in mistakes:
        with pytest.raises(SpecEdgeError):
            mistake()
    concat = Pair.load(concat_dir)
    with pytest.raises(InputError, match="capacity"):
        ContinuousBatch(concat, capacity="x")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="expected a GenerationConfig"):
        ContinuousBatch(concat, capacity=2).submit("Hi", {"max_new_tokens": 3})  # type: ignore
    with pytest.raises(InputError, match="KV cache needs"):  # numpy's MemoryError before
        ContinuousBatch(concat, capacity=10**7)


def test_server_integer_fields_say_their_range() -> None:
    from specedge.runtime import openai_api

    defaults = openai_api.RequestDefaults(model="m", max_tokens_limit=64)
    with pytest.raises(openai_api.APIError, match=r"\[1, 64\]") as info:
        openai_api._max_tokens({"max_tokens": "5"}, defaults)
    assert "9223372036854775808" not in str(info.value)
    with pytest.raises(openai_api.APIError, match="a 64-bit integer") as info:
        openai_api._seed({"seed": 1.5})
    assert "9223372036854775808" not in str(info.value)
