"""The `specedge` command line, through click's CliRunner and one real subprocess.

Every bad input must end with a non-zero exit code and exactly one line on stderr that starts
with "error:", never a Python traceback. (click >= 8.2: `result.stderr` is stderr alone,
`result.stdout` stdout alone, `result.output` both as a terminal would show them.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import onnxruntime as ort
import pytest
from click.testing import CliRunner, Result

from specedge.cli import main
from specedge.runtime.pair import GenerationConfig, Pair

HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def invoke(runner: CliRunner, *args: str | Path) -> Result:
    return runner.invoke(main, [str(a) for a in args])


def assert_clean_error(result: Result, contains: str = "") -> str:
    """Non-zero exit, one 'error:' line on stderr, no traceback; returns that line."""
    assert result.exit_code != 0, result.output
    # An exception that is not SystemExit means the CLI let it escape (CliRunner caught it).
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception))
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert contains in lines[0], lines[0]
    assert result.stdout.strip() == ""
    return lines[0]


def generate_json(runner: CliRunner, pair: Path, *args: str) -> dict:
    result = invoke(runner, "generate", pair, *args, "--json")
    assert result.exit_code == 0, result.output
    assert result.exception is None
    out: dict = json.loads(result.stdout)
    return out


# ----------------------------------------------------------------------------- generate


def test_generate_json(runner: CliRunner, tiny_pair_dir: Path) -> None:
    out = generate_json(runner, tiny_pair_dir, "The quick", "--max-new-tokens", "8")
    assert set(out) >= {"text", "tokens", "stop_reason", "stats"}
    assert isinstance(out["text"], str)
    assert 1 <= len(out["tokens"]) <= 8
    assert all(isinstance(t, int) and 0 <= t < 320 for t in out["tokens"])
    assert out["stop_reason"] in ("eos", "max_new_tokens", "context", "stop")
    assert out["stats"]["new_tokens"] == len(out["tokens"])
    assert out["stats"]["prompt_tokens"] >= 1


def test_generate_json_logprobs(runner: CliRunner, tiny_pair_dir: Path, concat_dir: Path,
                                tmp_path: Path) -> None:
    out = generate_json(runner, tiny_pair_dir, "The quick", "--max-new-tokens", "8",
                        "--logprobs", "2")
    want = Pair.load(tiny_pair_dir).generate("The quick", GenerationConfig(
        max_new_tokens=8, logprobs=2, drafter="none"))
    assert want.logprobs is not None and out["tokens"] == want.tokens
    assert [e["id"] for e in out["logprobs"]] == out["tokens"]
    for got, e in zip(out["logprobs"], want.logprobs, strict=True):
        assert got["logprob"] == pytest.approx(e.logprob, abs=1e-4)
        assert [t["id"] for t in got["top"]] == [t for t, _ in e.top]
    assert "logprobs" not in generate_json(runner, tiny_pair_dir, "The quick",
                                           "--max-new-tokens", "2")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Hi there", "max_new_tokens": 4}\n')
    batch = invoke(runner, "generate", concat_dir, "--batch", rows, "--json", "--logprobs", "0")
    assert batch.exit_code == 0, batch.output
    row = json.loads(batch.stdout.splitlines()[0])
    assert len(row["logprobs"]) == len(row["tokens"]) and row["logprobs"][0]["top"] == []
    assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "Hi", "--logprobs", "2"),
                       "--logprobs prints with --json")


def test_generate_penalties(runner: CliRunner, tiny_pair_dir: Path) -> None:
    from specedge.runtime.sampling import SamplingParams

    out = generate_json(runner, tiny_pair_dir, "a b a b a b", "--max-new-tokens", "12",
                        "--presence-penalty", "0.5", "--frequency-penalty", "1")
    want = Pair.load(tiny_pair_dir).generate("a b a b a b", GenerationConfig(
        max_new_tokens=12, drafter="none",
        sampling=SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)))
    assert out["tokens"] == want.tokens
    assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "Hi",
                              "--frequency-penalty", "3"), "frequency_penalty must be")


def test_generate_structured_output(runner: CliRunner, tiny_pair_dir: Path,
                                    tmp_path: Path) -> None:
    from specedge.runtime.grammar import Grammar

    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    pair = Pair.load(tiny_pair_dir)
    for option, value, grammar in (
            ("--json-schema", str(schema_file), Grammar.json_schema(schema)),
            ("--regex", "[a-c]{3}-[0-9]{2}", Grammar("regex", "[a-c]{3}-[0-9]{2}")),
            ("--grammar", 'root ::= "v" [0-9]', Grammar("grammar", 'root ::= "v" [0-9]'))):
        out = generate_json(runner, tiny_pair_dir, "Hi", "--max-new-tokens", "24", option,
                            value)
        want = pair.generate("Hi", GenerationConfig(max_new_tokens=24, drafter="none",
                                                    grammar=grammar))
        assert out["tokens"] == want.tokens and want.stop_reason == "eos"
    assert json.loads(generate_json(runner, tiny_pair_dir, "Hi", "--json-schema",
                                    str(schema_file))["text"]).keys() == {"ok"}
    for bad, message in ((("--regex", "a", "--grammar", "root ::= \"a\""),
                          "give one of --json-schema, --regex and --grammar"),
                         (("--regex", "[a-"), "the regex does not compile"),
                         (("--json-schema", "{not json"), "the json_schema does not compile")):
        assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "Hi", *bad), message)


def test_generate_min_tokens_and_ignore_eos(runner: CliRunner, tiny_pair_dir: Path) -> None:
    from specedge.runtime.sampling import SamplingParams

    eos = Pair.load(tiny_pair_dir).manifest.eos_token_ids[0]
    early = ("--logit-bias", f"{eos}=12", "--max-new-tokens", "16")
    assert len(generate_json(runner, tiny_pair_dir, "Hi", *early)["tokens"]) < 4
    held = generate_json(runner, tiny_pair_dir, "Hi", *early, "--min-tokens", "6")
    want = Pair.load(tiny_pair_dir).generate("Hi", GenerationConfig(
        max_new_tokens=16, drafter="none",
        sampling=SamplingParams(logit_bias={eos: 12}, min_tokens=6)))
    assert held["tokens"] == want.tokens and len(want.tokens) > 6
    full = generate_json(runner, tiny_pair_dir, "Hi", *early, "--ignore-eos")
    assert len(full["tokens"]) == 16 and eos in full["tokens"]
    assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "Hi", "--min-tokens", "-3"),
                       "min_tokens must be an integer")


def test_generate_repetition_penalty_and_logit_bias(runner: CliRunner,
                                                    tiny_pair_dir: Path) -> None:
    from specedge.runtime.sampling import SamplingParams

    out = generate_json(runner, tiny_pair_dir, "a b a b a b", "--max-new-tokens", "12",
                        "--repetition-penalty", "1.5", "--logit-bias", "7=-100",
                        "--logit-bias", "9=2.5")
    want = Pair.load(tiny_pair_dir).generate("a b a b a b", GenerationConfig(
        max_new_tokens=12, drafter="none",
        sampling=SamplingParams(repetition_penalty=1.5, logit_bias={7: -100, 9: 2.5})))
    assert out["tokens"] == want.tokens and 7 not in want.tokens
    for bad, message in ((("--logit-bias", "7"), "--logit-bias takes TOKEN_ID=BIAS"),
                         (("--logit-bias", "x=1"), "logit_bias keys must be token ids"),
                         (("--logit-bias", "7=500"), "logit_bias entries must be"),
                         (("--logit-bias", "99999=1"), "logit_bias names token id 99999"),
                         (("--repetition-penalty", "0"), "repetition_penalty must be")):
        assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "Hi", *bad), message)


def test_generate_plain_text_and_stats(runner: CliRunner, tiny_pair_dir: Path) -> None:
    result = invoke(runner, "generate", tiny_pair_dir, "The quick", "--max-new-tokens", "8",
                    "--stats")
    assert result.exit_code == 0, result.output
    assert result.exception is None
    assert result.stdout.endswith("\n")
    assert "statistics" in result.stderr
    assert "acceptance rate" in result.stderr


@pytest.mark.parametrize("mode", [[], ["--drafter", "ngram"],
                                  ["--drafter", "hybrid", "-k", "5", "--fixed-k"],
                                  ["--drafter", "model", "-k", "3", "--fixed-k"]])
def test_greedy_text_identical_across_drafters(runner: CliRunner, tiny_pair_dir: Path,
                                               mode: list[str]) -> None:
    """Each drafter (the pair's default too) gives target-only's text, and drafted doing so."""
    args = ["A b c a b c a b c", "--max-new-tokens", "24"]  # repetitive: n-gram lookups hit
    base = generate_json(runner, tiny_pair_dir, *args, "--no-speculation")
    assert base["stats"]["proposed"] == 0
    other = generate_json(runner, tiny_pair_dir, *args, *mode)
    assert other["text"] == base["text"]
    assert other["tokens"] == base["tokens"]
    assert other["stats"]["proposed"] > 0 and other["stats"]["accepted"] > 0


def test_stream_output_equals_json_text(runner: CliRunner, tiny_pair_dir: Path) -> None:
    args = ["The quick brown", "--max-new-tokens", "16"]
    as_json = generate_json(runner, tiny_pair_dir, *args)
    plain = invoke(runner, "generate", tiny_pair_dir, *args)
    assert plain.exit_code == 0, plain.output
    assert plain.stdout == as_json["text"] + "\n"


@pytest.mark.parametrize("mode", [["--fixed-k"], ["--no-speculation"], ["--drafter", "ngram",
                                                                          "--fixed-k"]])
def test_generate_sampling_with_seed_is_reproducible(runner: CliRunner, tiny_pair_dir: Path,
                                                     mode: list[str]) -> None:
    # Not with the default adaptive K: it picks K from measured wall-clock costs, so the random
    # stream is consumed differently from run to run (see the report on --seed).
    args = ["Edge devices", "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9",
            "--seed", "7", *mode]
    a = generate_json(runner, tiny_pair_dir, *args)
    b = generate_json(runner, tiny_pair_dir, *args)
    assert (a["tokens"], a["text"]) == (b["tokens"], b["text"])


def test_generate_threads_and_no_verify(runner: CliRunner, tiny_pair_dir: Path) -> None:
    out = generate_json(runner, tiny_pair_dir, "hi", "--max-new-tokens", "4", "--threads", "1,1",
                        "--providers", "cpu,cpu", "--no-verify")
    assert len(out["tokens"]) <= 4


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(("args", "contains"), [
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--min-p", "1"], "min_p"),
    (["--top-k", "-1"], "top_k"),
    (["--num-draft-tokens", "0"], "num_draft_tokens"),
    (["--num-draft-tokens", "65"], "num_draft_tokens"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--max-new-tokens", "-5"], "max_new_tokens"),
    (["--providers", "gpu9"], "gpu9"),
    (["--providers", "cpu,cpu,cpu"], "--providers"),
    (["--threads", "x"], "--threads"),
    (["--threads", "-1"], "--threads"),
    (["--threads", "1,2,3"], "--threads"),
])
def test_generate_bad_options(runner: CliRunner, tiny_pair_dir: Path, args: list[str],
                              contains: str) -> None:
    result = invoke(runner, "generate", tiny_pair_dir, "hi", *args)
    assert_clean_error(result, contains)


def test_missing_pair_folder(runner: CliRunner, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    line = assert_clean_error(invoke(runner, "generate", missing, "hi"), str(missing))
    assert "no such pair folder" in line


def test_folder_without_manifest(runner: CliRunner, tmp_path: Path) -> None:
    line = assert_clean_error(invoke(runner, "generate", tmp_path, "hi"), "specedge.json")
    assert "not a specedge pair folder" in line


def test_tampered_pair(runner: CliRunner, tiny_pair_dir: Path, tmp_path: Path) -> None:
    pair = tmp_path / "pair"
    shutil.copytree(tiny_pair_dir, pair)
    with open(pair / "target" / "model.onnx.data", "ab") as fh:
        fh.write(b"\x00")
    assert_clean_error(invoke(runner, "generate", pair, "hi"), "sha256 does not match")
    # --no-verify skips the check (the appended byte is past every tensor: still loads)
    result = invoke(runner, "generate", pair, "hi", "--max-new-tokens", "2", "--no-verify")
    assert result.exit_code == 0, result.output


def test_empty_prompt(runner: CliRunner, tiny_pair_dir: Path) -> None:
    assert_clean_error(invoke(runner, "generate", tiny_pair_dir, ""), "prompt is empty")


def test_prompt_longer_than_context(runner: CliRunner, tiny_pair_dir: Path) -> None:
    line = assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "word " * 2000),
                              "context is 512")
    assert "shorten it" in line


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="CUDA is available here: --providers cuda would not fail")
@pytest.mark.parametrize("providers", ["cuda", "cpu,cuda", "cuda,cpu"])
def test_unavailable_provider(runner: CliRunner, tiny_pair_dir: Path, providers: str) -> None:
    line = assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "hi",
                                     "--providers", providers), "'cuda'")
    assert "not available" in line


def test_bad_choice_is_a_usage_error(runner: CliRunner, tiny_pair_dir: Path) -> None:
    # click's own usage errors print one line too (not click's usage block), and exit 2
    result = invoke(runner, "generate", tiny_pair_dir, "hi", "--drafter", "oracle")
    line = assert_clean_error(result, "Invalid value for '--drafter'")
    assert result.exit_code == 2
    assert line.endswith(" generate --help'."), line


@pytest.mark.parametrize(("args", "message"), [
    (("generate",), "Missing argument 'PAIR'"),
    # click < 8.3 words it "No such option: --k Did you mean --top-k?"
    (("generate", "p", "--k", "2"), "No such option"),
    (("bench", "p", "--ks", "two"), "Invalid value for '--ks'"),
    (("nosuch",), "No such command 'nosuch'"),
])
def test_usage_errors_are_one_line(runner: CliRunner, args: tuple[str, ...], message: str) -> None:
    result = invoke(runner, *args)
    assert_clean_error(result, message)
    assert result.exit_code == 2
    if "--k" in args:
        assert all(part in result.output for part in ("--k", "Did you mean", "--top-k"))


def test_no_arguments_still_prints_help(runner: CliRunner) -> None:
    result = invoke(runner)
    assert result.exit_code == 2 and "Commands:" in result.output


# ----------------------------------------------------------------------------- inspect


def test_inspect(runner: CliRunner, tiny_pair_dir: Path) -> None:
    result = invoke(runner, "inspect", tiny_pair_dir)
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert "target" in info and "draft" in info
    assert info["vocab_size"] == 320
    assert info["target"]["max_seq_len"] == 512


def test_inspect_renders_the_prompt_generate_sends(runner: CliRunner, tiny_pair: Pair,
                                                   tiny_pair_dir: Path) -> None:
    result = invoke(runner, "inspect", tiny_pair_dir, "--render", "Hello", "--system", "Brief.")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)["chat_template"]
    messages = [{"role": "system", "content": "Brief."}, {"role": "user", "content": "Hello"}]
    assert shown["messages"] == messages
    assert shown["rendered"] == tiny_pair.tokenizer.render_chat(messages)
    assert "Hello" in shown["rendered"] and "Brief." in shown["rendered"]
    assert shown["rendered_tokens"] == len(tiny_pair.encode_prompt(messages))
    result = invoke(runner, "inspect", tiny_pair_dir, "--render", "Hello")
    assert json.loads(result.stdout)["chat_template"]["rendered_tokens"] == len(
        tiny_pair.encode_prompt("Hello", chat=True))
    result = invoke(runner, "inspect", tiny_pair_dir, "--system", "Brief.")
    assert result.exit_code == 2 and "--system goes with --render" in result.stderr


def test_inspect_missing(runner: CliRunner, tmp_path: Path) -> None:
    assert_clean_error(invoke(runner, "inspect", tmp_path / "nope"), "no such pair folder")


# ----------------------------------------------------------------------------- real process


def test_subprocess_clean_error(tiny_pair_dir: Path) -> None:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "specedge.cli", "generate", str(tiny_pair_dir), "hi",
         "--max-new-tokens", "4", "--temperature", "-1"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode != 0
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: temperature")
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == ""


def test_console_script_exists() -> None:
    script = Path(sys.executable).with_name("specedge")
    if not script.exists():
        pytest.skip("no specedge console script next to the interpreter")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "version" in proc.stdout


# ----------------------------------------------------------------------------- export

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs the [export] extra (torch)")


@pytest.mark.export
@needs_torch
def test_export_missing_target(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke(runner, "export", tmp_path / "no-such-model", "-o", out)
    assert_clean_error(result, "no such file or folder")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "export left files behind"


@pytest.mark.export
@needs_torch
def test_export_non_empty_output_needs_force(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = invoke(runner, "export", tmp_path / "no-such-model", "-o", out)
    assert_clean_error(result, "--force")
    assert (out / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


@pytest.mark.export
@needs_torch
def test_export_output_is_a_file(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("x")
    assert_clean_error(invoke(runner, "export", tmp_path / "no-such-model", "-o", out),
                       "not a folder")


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody here can write in: chmod 0o555, or for root (whom modes do not stop)
    sysfs's root, which refuses new files to root too."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    sysfs = Path("/sys")
    try:
        (sysfs / ".specedge-probe").open("x").close()
    except OSError:
        yield sysfs
        return
    (sysfs / ".specedge-probe").unlink()
    pytest.skip("running as root with a writable /sys: no read-only folder to test with")


@pytest.mark.export
@needs_torch
def test_export_read_only_parent(runner: CliRunner, tmp_path: Path,
                                 read_only_folder: Path) -> None:
    # Before the probe write, root passed os.access on a read-only folder and failed later,
    # in the staging folder's mkdtemp, without saying what to do.
    out = read_only_folder / "specedge-out"
    line = assert_clean_error(invoke(runner, "export", tmp_path / "no-such-model", "-o", out),
                              "cannot write in")
    assert "choose another --output" in line
    assert not out.exists()


@pytest.mark.export
@needs_torch
@pytest.mark.parametrize(("args", "contains"), [
    (["--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["--num-draft-tokens", "65"], "--num-draft-tokens"),
])
def test_export_bad_options(runner: CliRunner, tmp_path: Path, args: list[str],
                            contains: str) -> None:
    out = tmp_path / "out"
    assert_clean_error(invoke(runner, "export", tmp_path / "no-such-model", "-o", out, *args),
                       contains)
    assert not out.exists()
