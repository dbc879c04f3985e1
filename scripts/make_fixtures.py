"""Export the tiny seeded test pairs (and nothing else) into a folder, for the runtime tests.

Usage: python scripts/make_fixtures.py OUT_DIR
Writes OUT_DIR/tiny-llama (fp32 target + int4 self-draft), OUT_DIR/tiny-llama-int8
(fp32 target + int8 self-draft), OUT_DIR/tiny-llama-concat (fp32 target + int4 self-draft, both
in the concat graph form, for batched speculative decoding), OUT_DIR/tiny-llama-mixed (its
target concat, its draft gqa-shared), OUT_DIR/tiny-llama-std (tiny-llama-concat in the
standard-op concat form of the torch export, which TensorRT takes),
OUT_DIR/tiny-llama-int8static and OUT_DIR/tiny-llama-fp8 (its target quantized by `specedge
quantize` with calibrated static int8 QDQ, and with fp8 E4M3 QDQ) and OUT_DIR/tiny-llama-split
(tiny-llama with its target's head split off, as `export` does for heads of a MiB or more).
Pairs already in OUT_DIR are kept. Needs the [export] extra (torch); the runtime tests that
read these folders do not.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from specedge.exporter.pair import ExportOptions, export_pair
from specedge.exporter.tiny import make_tiny_model

# name: (draft precision, graph form (None = the family's default), the draft's where it
# differs: tiny-llama-mixed is the shape of models/smollm2-135m-concat.sh)
PAIRS: dict[str, tuple[str, str | None, str | None]] = {
    "tiny-llama": ("int4", None, None),
    "tiny-llama-int8": ("int8", None, None),
    "tiny-llama-concat": ("int4", "concat", None),
    "tiny-llama-mixed": ("int4", "concat", "gqa-shared"),
    "tiny-llama-std": ("int4", "concat-standard", None),
}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_model("llama", Path(tmp) / "llama", seed=0)
        for name, (draft_precision, graph, draft_graph) in PAIRS.items():
            if (out / name / "specedge.json").is_file():
                continue
            export_pair(ExportOptions(target=str(hf), output=out / name,
                                      draft_precision=draft_precision, graph=graph,
                                      draft_graph=draft_graph, force=True))
            print(f"wrote {out / name}")
        # Calibrated static-int8 and fp8 targets (for the torch-free runtime tests of quantized
        # pairs: onnxruntime before 1.32 loads fp8 QDQ only without its QDQ fusion).
        for method, name in (("int8-minmax", "tiny-llama-int8static"), ("fp8", "tiny-llama-fp8")):
            if not (out / name / "specedge.json").is_file():
                from specedge.calibration.data import CalibrationOptions
                from specedge.calibration.quantize import QuantizeOptions, quantize

                quantize(QuantizeOptions(pair=out / "tiny-llama", output=out / name,
                                         method=method,
                                         calibration=CalibrationOptions(samples=4), force=True),
                         say=lambda _msg: None)
                print(f"wrote {out / name}")
        # The split head (`runtime/shortlist.py`) on a tiny model: its head is far below the
        # size export splits, so split it here.
        split = out / "tiny-llama-split"
        if not (split / "specedge.json").is_file():
            from specedge.exporter.split_head import split_pair_heads
            from specedge.runtime.files import copy_pair

            copy_pair(out / "tiny-llama", split)
            split_pair_heads(split, min_bytes=0)
            print(f"wrote {split}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
