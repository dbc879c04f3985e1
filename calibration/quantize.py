"""`specedge quantize`: quantize one model of a pair into a new pair folder.

The quantizers themselves (one implementation per method name, shared with `specedge export`)
are in `specedge.exporter.quantize`, whose docstring lists the methods. This module adds what a
pair needs around them: calibration feeds for the calibrated methods (`data.model_feeds`:
prefills and steps with a real past), a child process for the quantizer, and a new pair folder in
which the chosen model is replaced, everything else is hard-linked from the source pair, and the
manifest records the method.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specedge.exporter.output import check_output, require_modules, staged_folder
from specedge.exporter.quantize import (
    CALIBRATED,
    HISTOGRAM,
    METHODS,
    QuantSettings,
    check_exclude,
    run_isolated,
)
from specedge.runtime.errors import InputError
from specedge.runtime.files import copy_pair, sha256_file
from specedge.runtime.manifest import load_manifest, write_manifest
from specedge.runtime.pair import Pair

from . import data

__all__ = ["METHODS", "QuantizeOptions", "quantize", "quantize_in_place"]


@dataclass(frozen=True)
class QuantizeOptions:
    """What `specedge quantize` does."""

    pair: Path
    output: Path
    method: str
    model: str = "target"  # which model of the pair
    data_file: Path | None = None
    calibration: data.CalibrationOptions = field(default_factory=data.CalibrationOptions)
    block_size: int = 32
    accuracy_level: int = 4
    exclude: tuple[str, ...] = ()
    symmetric: bool = True  # False: uint8 zero points (asymmetric int4 weights)
    force: bool = False

    def __post_init__(self) -> None:
        _ = self.settings  # validates the method and the block size
        if self.model not in ("target", "draft"):
            raise InputError(f"--model {self.model!r}: use target or draft")

    @property
    def settings(self) -> QuantSettings:
        """The quantizer's settings."""
        return QuantSettings(method=self.method, block_size=self.block_size,
                             accuracy_level=self.accuracy_level, exclude=self.exclude,
                             symmetric=self.symmetric)


def quantize(opts: QuantizeOptions, say: Callable[[str], None] = print) -> Path:
    """Quantize one model of a pair into a new pair folder; returns the folder."""
    source = load_manifest(opts.pair)
    spec = source.target if opts.model == "target" else source.draft
    if spec is None:
        raise InputError(f"{opts.pair} has no draft model")
    if spec.precision not in ("fp32", "fp16"):
        raise InputError(f"{opts.pair}: the {opts.model} is already {spec.precision}; quantize "
                         "from an fp32 model")
    out = check_output(opts.output, force=opts.force, inputs=[opts.pair, opts.data_file])
    require_modules("quantize", ("onnx",))
    check_exclude(opts.pair / spec.path, opts.exclude, opts.method)
    pair = Pair.load(opts.pair, load_draft=opts.model == "draft")
    model = pair.target if opts.model == "target" else pair.draft
    assert model is not None
    texts = data.read_texts(opts.data_file)
    token_lists = data.tokenize(pair, texts, opts.calibration)
    feeds = list(data.model_feeds(opts.pair, model, token_lists, opts.calibration)) \
        if opts.method in CALIBRATED else []
    if opts.method in HISTOGRAM and feeds:
        # Histogram calibrators stack each tensor's values across inputs, so every input must
        # have one shape: cut the texts to a common length and keep the 1-token decode steps
        # after a real past (the shape generation runs most).
        common = min(len(t) for t in token_lists)
        cut = [list(t[:common]) for t in token_lists]
        cal = replace(opts.calibration, max_prefill=common, step_sizes=(1,))
        feeds = [f for f in data.model_feeds(opts.pair, model, cut, cal)
                 if f[spec.input_ids].shape[1] == 1]
    say(f"{len(feeds)} calibration inputs from {len(token_lists)} texts" if feeds else
        "no calibration data needed")
    with staged_folder(out) as tmp:
        copy_pair(opts.pair, tmp)
        folder = tmp / Path(spec.path).parent
        # The token ids a draft's logits cover and the ids it is fed are not the graph's:
        # they stay as they are.
        kept = {rel: (tmp / rel).read_bytes() for rel in (spec.vocab_ids, spec.input_id_map)
                if rel}
        shutil.rmtree(folder)
        folder.mkdir()
        for rel, content in kept.items():
            (tmp / rel).write_bytes(content)
        start = time.perf_counter()
        say(f"quantizing the {opts.model} with {opts.method}")
        run_isolated(opts.settings, opts.pair / spec.path, folder / "model.onnx", feeds, tmp)
        seconds = time.perf_counter() - start
        files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(folder.iterdir())}
        new_spec = replace(spec, files=files, precision=opts.settings.precision, head=None,
                           source={**spec.source, "quantization": {
                               "method": opts.method, "block_size": opts.block_size,
                               "accuracy_level": opts.accuracy_level,
                               "symmetric": opts.symmetric,
                               "exclude": list(opts.exclude), "seconds": round(seconds, 1),
                               "calibration_inputs": len(feeds),
                               "calibration_texts": len(token_lists),
                               "data": str(opts.data_file or "built-in sample")}})
        manifest = replace(source, root=tmp, **{opts.model: new_spec})
        write_manifest(manifest, tmp)
    return out


def quantize_in_place(folder: Path, method: str, data_file: Path | None = None,
                      say: Callable[[str], None] = print) -> dict[str, Any]:
    """Replace the (fp32) target of the pair `folder` by its quantization with `method`.

    What `specedge export --calibrate METHOD` does after the export. The quantized pair is
    written beside `folder` and swapped in only when complete. Returns its quality report.
    """
    from .quality import annotate

    staged = folder.with_name(f".{folder.name}.calibrated")
    shutil.rmtree(staged, ignore_errors=True)  # ours: left by a process killed mid-way
    try:
        quantize(QuantizeOptions(pair=folder, output=staged, method=method, data_file=data_file,
                                 force=True), say=say)
        report = annotate(folder, staged, "target")
        old = folder.with_name(f".{folder.name}.fp32")
        folder.rename(old)
        staged.rename(folder)
        shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return report
