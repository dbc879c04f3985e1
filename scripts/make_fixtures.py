"""Export the tiny seeded test pairs (and nothing else) into a folder, for the runtime tests.

Usage: python scripts/make_fixtures.py OUT_DIR
Writes OUT_DIR/tiny-llama (fp32 target + int4 self-draft) and OUT_DIR/tiny-llama-int8
(fp32 target + int8 self-draft). Needs the [export] extra (torch); the runtime tests that read
these folders do not.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from specedge.exporter.pair import ExportOptions, export_pair
from specedge.exporter.tiny import make_tiny_model

PAIRS = {"tiny-llama": "int4", "tiny-llama-int8": "int8"}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_model("llama", Path(tmp) / "llama", seed=0)
        for name, draft_precision in PAIRS.items():
            if (out / name / "specedge.json").is_file():
                continue
            export_pair(ExportOptions(target=str(hf), output=out / name,
                                      draft_precision=draft_precision, force=True))
            print(f"wrote {out / name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
