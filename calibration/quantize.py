"""Calibrated quantization of a pair's model, through onnxruntime.quantization (no hand-written
quantizers).

Methods (`--method`):
- int8 dynamic (`quantize_dynamic`, `int8-dynamic`): the uncalibrated int8 baseline.
- int8 static QDQ (`quantize_static`): `int8-minmax`, `int8-entropy`, `int8-percentile`. This
  explicit-quantization form is what TensorRT consumes. Activations are calibrated on
  `data.model_feeds` (prefills and steps with a real past).
- fp16 (`fp16`) with an op block list (attention and norms stay fp32; `--exclude` adds nodes).
- FP8 E4M3 QDQ (`fp8`; distribution calibration, ORT's only method for float types), for
  GPUs with FP8 (Hopper, Ada) through TensorRT.
- int4 weight-only MatMulNBits (`MatMulNBitsQuantizer`): `int4-rtn` (uncalibrated),
  `int4-hqq`, `int4-kquant`, `int4-gptq` (calibrated on the same feeds). HQQ's float zero
  points are rewritten exactly into the fast uint8 layout plus a small correction
  (`zero_points.py`), because ORT's CPU kernel for float zero points is about 15x slower.
- int8 weight-only MatMulNBits (`int8-rtn`, 8 bits, block-wise scales, int8 compute at
  accuracy level 4): near-lossless, about half the cost of an fp32 step on a 2-core CPU.
Mixed precision: `--exclude NODE` (repeatable) keeps those MatMuls in float, e.g. the LM head
(`/lm_head/MatMul`).

The result is a new pair folder: the chosen model is replaced, everything else is hard-linked
from the source pair, and the manifest records the method and a quality report.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from specedge.runtime.errors import ExportError, InputError
from specedge.runtime.manifest import (
    copy_pair,
    load_manifest,
    sha256_file,
    write_manifest,
)
from specedge.runtime.pair import Pair

from . import data, zero_points

METHODS = ("fp16", "fp8", "int8-dynamic", "int8-minmax", "int8-entropy", "int8-percentile",
           "int4-rtn", "int4-hqq", "int4-kquant", "int4-gptq", "int8-rtn")


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
        if self.method not in METHODS:
            raise InputError(f"--method {self.method!r}: use one of {', '.join(METHODS)}")
        if self.model not in ("target", "draft"):
            raise InputError(f"--model {self.model!r}: use target or draft")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise InputError(f"--block-size {self.block_size}: use 16, 32, 64, 128 or 256")


# Ops kept in fp32 by `fp16`: attention (its KV buffers stay fp32 and shared in place) and the
# RMS norms (reductions that lose precision in fp16).
FP16_BLOCK_LIST = ("GroupQueryAttention", "SimplifiedLayerNormalization",
                   "SkipSimplifiedLayerNormalization", "RotaryEmbedding")


class _Reader:
    """onnxruntime.quantization.CalibrationDataReader over a list of feeds (re-iterable)."""

    def __init__(self, feeds: list[dict[str, Any]]) -> None:
        self.feeds = feeds
        self.index = 0

    def get_next(self) -> dict[str, Any] | None:
        if self.index >= len(self.feeds):
            return None
        self.index += 1
        return self.feeds[self.index - 1]

    def rewind(self) -> None:
        self.index = 0

    def __iter__(self) -> Any:
        return iter(self.feeds)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Reader:
        return _Reader(self.feeds)


def quantize(opts: QuantizeOptions, say: Callable[[str], None] = print) -> Path:
    """Quantize one model of a pair into a new pair folder; returns the folder."""
    source = load_manifest(opts.pair)
    spec = source.target if opts.model == "target" else source.draft
    if spec is None:
        raise InputError(f"{opts.pair} has no draft model")
    if spec.precision not in ("fp32", "fp16"):
        raise InputError(f"{opts.pair}: the {opts.model} is already {spec.precision}; quantize "
                         "from an fp32 model")
    out = opts.output.expanduser().absolute()
    if out.exists() and any(out.iterdir()) and not opts.force:
        raise InputError(f"{out}: folder exists and is not empty; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    pair = Pair.load(opts.pair, load_draft=opts.model == "draft")
    model = pair.target if opts.model == "target" else pair.draft
    assert model is not None
    texts = data.read_texts(opts.data_file)
    token_lists = data.tokenize(pair, texts, opts.calibration)
    needs_data = opts.method in ("fp8", "int8-minmax", "int8-entropy", "int8-percentile",
                                 "int4-gptq")
    feeds = list(data.model_feeds(opts.pair, model, token_lists, opts.calibration)) \
        if needs_data else []
    if opts.method in ("int8-entropy", "int8-percentile", "fp8") and feeds:
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        copy_pair(opts.pair, tmp)
        folder = tmp / Path(spec.path).parent
        shutil.rmtree(folder)
        folder.mkdir()
        start = time.perf_counter()
        say(f"quantizing the {opts.model} with {opts.method}")
        run_isolated(opts, opts.pair / spec.path, folder / "model.onnx", feeds, tmp)
        seconds = time.perf_counter() - start
        files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(folder.iterdir())}
        precision = opts.method.split("-")[0]
        new_spec = replace(spec, files=files, precision=precision,
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
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


_PEAK_MARKER = "SPECEDGE_PEAK_RSS_MIB="


def run_isolated(opts: QuantizeOptions, src: Path, dst: Path, feeds: list[dict[str, Any]],
                 scratch: Path) -> float | None:
    """Run the quantizer in a child process.

    onnxruntime.quantization creates its own InferenceSessions with per-session thread pools,
    which ONNX Runtime refuses once a process runs on the shared global pool (the runtime's
    default thread plan). The child has no such pool. Feeds travel as an .npz file read with
    allow_pickle=False. Returns the child's peak RSS in MiB (None if it did not report one).
    """
    import json
    import subprocess
    import sys

    feeds_file = scratch / "calibration_feeds.npz"
    np.savez(feeds_file, **{f"{i}|{k}": v for i, feed in enumerate(feeds)
                            for k, v in feed.items()})
    args = {"src": str(src), "dst": str(dst), "method": opts.method,
            "block_size": opts.block_size, "accuracy_level": opts.accuracy_level,
            "exclude": list(opts.exclude), "feeds": str(feeds_file),
            "symmetric": opts.symmetric}
    proc = subprocess.run([sys.executable, "-m", "specedge.calibration.quantize",
                           json.dumps(args)], capture_output=True, text=True, check=False)
    feeds_file.unlink(missing_ok=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        raise ExportError(lines[-1][:400] if lines else f"{src}: {opts.method} failed")
    peaks = [ln.split("=", 1)[1] for ln in proc.stdout.splitlines()
             if ln.startswith(_PEAK_MARKER)]
    return float(peaks[-1]) if peaks else None


def _load_feeds(path: Path) -> list[dict[str, Any]]:
    feeds: dict[int, dict[str, Any]] = {}
    with np.load(path, allow_pickle=False) as z:
        for key in z.files:
            index, name = key.split("|", 1)
            feeds.setdefault(int(index), {})[name] = z[key]
    return [feeds[i] for i in sorted(feeds)]


def _main(argv: list[str]) -> int:
    import json

    a = json.loads(argv[0])
    opts = QuantizeOptions(pair=Path("."), output=Path("."), method=a["method"],
                           block_size=a["block_size"], accuracy_level=a["accuracy_level"],
                           exclude=tuple(a["exclude"]), symmetric=a["symmetric"])
    try:
        _run_method(opts, Path(a["src"]), Path(a["dst"]), _load_feeds(Path(a["feeds"])))
    except ExportError as exc:
        print(f"{exc}", file=__import__("sys").stderr)
        return 1
    import resource

    print(f"{_PEAK_MARKER}{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")
    return 0


def _run_method(opts: QuantizeOptions, src: Path, dst: Path, feeds: list[dict[str, Any]]
                ) -> None:
    import onnx
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    method = opts.method
    try:
        if method == "int8-dynamic":  # the uncalibrated int8 baseline
            from onnxruntime.quantization import quantize_dynamic

            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"], use_external_data_format=True,
                             nodes_to_exclude=list(opts.exclude),
                             extra_options={"MatMulConstBOnly": True})
            return
        if method == "fp16":
            from onnxruntime.transformers.float16 import convert_float_to_float16

            model16 = convert_float_to_float16(
                onnx.load(str(src)), keep_io_types=True, op_block_list=list(FP16_BLOCK_LIST),
                node_block_list=list(opts.exclude), disable_shape_infer=True)
            onnx.save(model16, str(dst), save_as_external_data=True,
                      location=dst.name + ".data")
            return
        if method == "fp8":  # FP8 E4M3 QDQ, for GPUs that have FP8 (TensorRT)
            quantize_static(str(src), str(dst), _Reader(feeds), quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=["MatMul"],
                            activation_type=QuantType.QFLOAT8E4M3FN,
                            weight_type=QuantType.QFLOAT8E4M3FN,
                            calibrate_method=CalibrationMethod.Distribution,
                            nodes_to_exclude=list(opts.exclude), use_external_data_format=True,
                            extra_options={"ActivationSymmetric": True,
                                           "WeightSymmetric": True, "MatMulConstBOnly": True})
            return
        if method.startswith("int8") and method != "int8-rtn":
            calibrate = {"int8-minmax": CalibrationMethod.MinMax,
                         "int8-entropy": CalibrationMethod.Entropy,
                         "int8-percentile": CalibrationMethod.Percentile}[method]
            quantize_static(str(src), str(dst), _Reader(feeds), quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=["MatMul"], per_channel=True,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                            calibrate_method=calibrate, nodes_to_exclude=list(opts.exclude),
                            use_external_data_format=True,
                            extra_options={"ActivationSymmetric": True,
                                           "MatMulConstBOnly": True})
            return
        model = onnx.load(str(src))
        if method == "int8-rtn":
            config: Any = nbits.DefaultWeightOnlyQuantConfig(
                block_size=opts.block_size, is_symmetric=opts.symmetric,
                accuracy_level=opts.accuracy_level, bits=8)
        elif method == "int4-rtn":
            config = nbits.RTNWeightOnlyQuantConfig()
        elif method == "int4-hqq":
            config = nbits.HQQWeightOnlyQuantConfig(block_size=opts.block_size)
        elif method == "int4-kquant":
            config = nbits.KQuantWeightOnlyQuantConfig()
        else:
            config = nbits.GPTQWeightOnlyQuantConfig(
                calibration_data_reader=_Reader(feeds), block_size=opts.block_size)
        quant = nbits.MatMulNBitsQuantizer(
            model, block_size=opts.block_size, is_symmetric=opts.symmetric,
            accuracy_level=opts.accuracy_level, nodes_to_exclude=list(opts.exclude),
            algo_config=config)
        quant.process()
        if method != "int4-hqq":
            quant.model.save_model_to_file(str(dst), use_external_data_format=True)
            return
        raw = dst.with_name(dst.stem + ".float-zp.onnx")
        quant.model.save_model_to_file(str(raw), use_external_data_format=True)
        zero_points.rewrite(raw, dst, accuracy_level=opts.accuracy_level)
        raw.unlink()
        Path(str(raw) + ".data").unlink(missing_ok=True)
    except (InputError, ExportError):
        raise
    except Exception as exc:  # the quantizers raise plain exceptions
        msg = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ExportError(f"{src}: {method} quantization failed ({msg})") from None




if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
