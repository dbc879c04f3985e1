"""What the interleaved benchmark scripts share: their command line (a pair, new tokens,
repetitions, a report file) and how a report is printed and written."""

from __future__ import annotations

import argparse
from pathlib import Path


def interleaved_args(doc: str, max_new_tokens: int = 96) -> argparse.Namespace:
    """`PAIR [--max-new-tokens N] [--repeats R] [--out FILE]`, described by the script's
    docstring's first line."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("pair", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


def emit(lines: list[str], out: Path | None) -> None:
    """Print the report, and write it to `out` when given."""
    report = "\n".join(lines) + "\n"
    print(report)
    if out:
        out.write_text(report)
