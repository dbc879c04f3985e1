"""Write the quality report of a quantized model into its pair's manifest (and return it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from specedge.runtime.manifest import read_manifest, write_manifest
from specedge.runtime.pair import Pair

from . import data, report


def annotate(source: Path, quantized: Path, which: str, prompts: int = 8) -> dict[str, Any]:
    """Compare `which` model of `quantized` with the same model of `source`; store the report."""
    ref = Pair.load(source, load_draft=which == "draft")
    new = Pair.load(quantized, load_draft=which == "draft")
    ref_model = ref.target if which == "target" else ref.draft
    new_model = new.target if which == "target" else new.draft
    assert ref_model is not None and new_model is not None
    held_out = [ref.tokenizer.encode(t) for t in data.HELDOUT_TEXTS]
    quality: dict[str, Any] = {"held_out_texts": len(held_out),
                               **report.language_quality(ref_model, new_model, held_out)}
    eval_prompts = list(data.CALIBRATION_PROMPTS[:prompts])
    if which == "target":
        quality["greedy_vs_reference"] = report.greedy_difference(ref, new, eval_prompts)
    else:
        quality["acceptance"] = report.draft_acceptance(new, eval_prompts)
        quality["reference_acceptance"] = report.draft_acceptance(ref, eval_prompts)
    manifest = read_manifest(quantized)
    spec = manifest.target if which == "target" else manifest.draft
    assert spec is not None
    spec = replace(spec, validation={**spec.validation, "quality": quality})
    write_manifest(replace(manifest, **{which: spec}), quantized)
    return quality
