"""The README's Python API example runs (against the reference pair, or the tiny pair)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API"):text.index("## Architecture")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3, ("the README's Python API lost an example (one row, batches, a "
                              "conversation)")
    return blocks


def test_readme_example_runs(reference_pair_dir: Path, capsys) -> None:  # noqa: ANN001
    code = _python_blocks()[0].replace('"pairs/smollm2-135m"', repr(str(reference_pair_dir)))
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "Paris" in out and "tok/s" in out and "ToolCall(name='get_weather'" in out


def test_readme_batch_example_runs(concat_dir: Path, capsys) -> None:  # noqa: ANN001
    code = _python_blocks()[1]
    assert '"pairs/smollm2-135m-concat"' in code
    namespace: dict = {}
    exec(compile(code.replace('"pairs/smollm2-135m-concat"', repr(str(concat_dir))),
                 "README.md", "exec"), namespace)
    batch, results, rid = namespace["batch"], namespace["results"], namespace["rid"]
    assert len(batch.results) == 2 and batch.stats.tokens_per_s > 0
    assert all(0 < r.stats.new_tokens <= n for r, n in zip(batch.results, (16, 48), strict=True))
    assert 0 < results[rid].stats.new_tokens <= 32
    assert capsys.readouterr().out.rstrip().endswith(results[rid].stop_reason)


def test_readme_conversation_example_runs(reference_pair_dir: Path, capsys) -> None:  # noqa: ANN001
    """The conversation example reuses its prefixes, and decodes what a pair keeping none
    decodes."""
    from specedge.runtime.pair import Pair

    code = _python_blocks()[2]
    assert '"pairs/smollm2-135m"' in code
    namespace: dict = {}
    exec(compile(code.replace('"pairs/smollm2-135m"', repr(str(reference_pair_dir))),
                 "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    reused = [int(n) for n in re.findall(r"\[(\d+) prompt tokens reused\]", out)]
    assert len(reused) == 4 and reused[0] == 0 and reused[-1] >= 128, out
    messages, config = namespace["messages"], namespace["config"]
    cold = Pair.load(reference_pair_dir)
    assert cold.generate(messages[:-1], config).text == messages[-1]["content"]


def test_readme_starts_with_the_two_commands() -> None:
    head = README.read_text(encoding="utf-8")[:1500]
    assert "bash scripts/main.sh" in head and "bash scripts/test.sh" in head
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci
