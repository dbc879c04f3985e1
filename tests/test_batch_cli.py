"""`specedge generate --batch FILE` and `specedge bench --batch 1,2,4`, on the tiny concat pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams, logit_bias_from_json
from specedge.runtime.structured_api import grammar_field

from .test_cli import assert_clean_error, invoke


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_generate_batch_file(runner: CliRunner, concat_dir: Path, tmp_path: Path) -> None:
    document = "def add(a, b): return a + b " * 12  # rows 1 and 3 share it: computed once
    rows = [{"prompt": "Hi there", "max_new_tokens": 5, "repetition_penalty": 1.4,
             "logit_bias": {"7": -100, "12": 1.5}},
            {"prompt": document + "# what does add do?", "max_new_tokens": 17},
            {"messages": [{"role": "user", "content": "Hello"}], "max_new_tokens": 12,
             "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                 "type": "object", "required": ["n"], "additionalProperties": False,
                 "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}},
            {"prompt": document + "# write a test", "max_new_tokens": 7}]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = invoke(runner, "generate", concat_dir, "--batch", batch, "--json", "-k", "3",
                    "--fixed-k", "--drafter", "model")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["row"] for line in lines[:-1]] == [0, 1, 2, 3]
    summary = lines[-1]["batch"]
    assert summary["rows"] == 4 and summary["cached_tokens"] >= 128
    assert summary["cached_tokens"] == lines[3]["stats"]["cached_tokens"]
    assert summary["prompt_tokens"] == sum(line["stats"]["prompt_tokens"] for line in lines[:-1])
    pair = Pair.load(concat_dir)
    assert json.loads(lines[2]["text"])["n"] <= 9
    for row, got in zip(rows, lines, strict=False):
        sampling = SamplingParams(repetition_penalty=row.get("repetition_penalty", 1.0),
                                  logit_bias=logit_bias_from_json(row.get("logit_bias")))
        cfg = GenerationConfig(max_new_tokens=row["max_new_tokens"], drafter="none",
                               chat="messages" in row, sampling=sampling,
                               grammar=grammar_field(row))
        want = pair.generate(row.get("prompt") or row["messages"], cfg)
        assert got["tokens"] == want.tokens and got["text"] == want.text


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a", "foo": 1}', "unknown key"),
    ('{"max_new_tokens": 3}', "exactly one of"),
    ("not json", "not a JSON object"),
    ('{"prompt": "a", "stop": 3}', "a string or a list of strings"),
    ('{"prompt": "a", "logit_bias": {"x": 1}}', "logit_bias keys must be token ids"),
    ('{"prompt": "a", "logit_bias": [1]}', "an object of token ids"),
    ('{"prompt": "a", "structured_outputs": {"regex": "[a-"}}',
     "structured_outputs: the regex does not compile"),
    ("", "no rows"),
])
def test_bad_batch_files(runner: CliRunner, concat_dir: Path, tmp_path: Path, content: str,
                         message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    assert_clean_error(invoke(runner, "generate", concat_dir, "--batch", bad), message)


def test_generate_needs_prompt_or_batch(runner: CliRunner, concat_dir: Path) -> None:
    assert_clean_error(invoke(runner, "generate", concat_dir), "PROMPT or --batch")


def test_batch_on_a_gqa_pair_is_a_clean_error(runner: CliRunner, tiny_pair_dir: Path,
                                               tmp_path: Path) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"prompt": "a"}\n{"prompt": "bb"}\n')
    assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "--batch", batch,
                              "--drafter", "model"), "--graph concat")


def test_bench_batch_reports_every_batch_and_setting(runner: CliRunner, concat_dir: Path,
                                                     tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"prompt number {i} " * (i + 1) for i in range(4)))
    out = tmp_path / "bench.json"
    result = invoke(runner, "bench", concat_dir, "--batch", "1,2,4", "--ks", "1,2",
                    "--prompts", prompts, "--max-new-tokens", "8", "--plain", "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    settings = {(r["batch"], r["setting"]) for r in report["rows"]}
    for b in (1, 2, 4):
        for name in ("target only", "K=1", "K=2", "adaptive", "K=1 masked"):
            assert (b, name) in settings
        # Greedy and exact: every setting emits the same number of tokens at a batch size.
        assert len({r["tokens"] for r in report["rows"] if r["batch"] == b}) == 1
        assert set(report["costs"][str(b)]) >= {"verify_1", "verify_2", "verify_3",
                                                 "draft_step"}
    assert_clean_error(invoke(runner, "bench", concat_dir, "--batch", "8", "--prompts",
                              prompts), "needs at least")


def test_bench_batch_takes_the_drafter(runner: CliRunner, concat_dir: Path,
                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: `bench --batch` ignored `--drafter` and always drafted with the model. With
    n-gram drafts the draft model is never called (no draft-step cost) and repeated prompts
    get free drafts; the rows are still exact."""
    from specedge.runtime.backend import OrtModel

    models: list[OrtModel] = []
    init = OrtModel.__init__

    def recording(self: OrtModel, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        models.append(self)

    monkeypatch.setattr(OrtModel, "__init__", recording)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join("one two three four one two three four one two three " * 2
                                 for _ in range(2)))
    out = tmp_path / "bench.json"
    result = invoke(runner, "bench", concat_dir, "--batch", "1,2", "--ks", "2",
                    "--drafter", "ngram", "--no-adaptive", "--prompts", prompts,
                    "--max-new-tokens", "8", "--plain", "--json", out)
    assert result.exit_code == 0, result.output
    # What decoding ran, not what the option said: the draft model never ran.
    assert [m.calls for m in models if m.name == "draft"] in ([], [0])
    assert sum(m.calls for m in models if m.name == "target") > 0
    report = json.loads(out.read_text())
    assert report["drafter"] == "ngram"
    for b in ("1", "2"):
        assert "draft_step" not in report["costs"][b]
    rows = {(r["batch"], r["setting"]): r for r in report["rows"]}
    for b in (1, 2):
        assert rows[(b, "K=2")]["tokens"] == rows[(b, "target only")]["tokens"]
        assert "draft_ratio" not in rows[(b, "K=2")]
    assert_clean_error(invoke(runner, "bench", concat_dir, "--batch", "1", "--temperature",
                              "0.7", "--prompts", prompts), "greedy")
