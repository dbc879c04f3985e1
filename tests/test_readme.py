"""The README's Python API example runs (against the reference pair, or the tiny pair)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README lost its Python API example"
    return match.group(1)


def test_readme_example_runs(reference_pair_dir: Path, capsys) -> None:  # noqa: ANN001
    code = _python_block().replace('"pairs/smollm2-135m"', repr(str(reference_pair_dir)))
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "Paris" in out and "tok/s" in out


def test_readme_starts_with_the_two_commands() -> None:
    head = README.read_text(encoding="utf-8")[:1500]
    assert "bash scripts/main.sh" in head and "bash scripts/test.sh" in head
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci
