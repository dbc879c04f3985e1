"""Export the tiny seeded test pairs (and nothing else) into a folder, for the runtime tests.

Usage: python scripts/make_fixtures.py OUT_DIR
Writes OUT_DIR/tiny-llama (fp32 target + int4 self-draft), OUT_DIR/tiny-llama-int8
(fp32 target + int8 self-draft) and OUT_DIR/tiny-llama-int8static (its target quantized with
calibrated static int8 QDQ by `specedge quantize`). Needs the [export] extra (torch); the
runtime tests that read these folders do not.
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
        # A calibrated static-int8 target (for the torch-free runtime tests of quantized pairs).
        quantized = out / "tiny-llama-int8static"
        if not (quantized / "specedge.json").is_file():
            from specedge.calibration.data import CalibrationOptions
            from specedge.calibration.quantize import QuantizeOptions, quantize

            quantize(QuantizeOptions(pair=out / "tiny-llama", output=quantized,
                                     method="int8-minmax",
                                     calibration=CalibrationOptions(samples=4), force=True),
                     say=lambda _msg: None)
            print(f"wrote {quantized}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
