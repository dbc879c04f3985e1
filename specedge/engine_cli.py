"""`specedge build-engine`: the click command over `specedge.exporter.engine.build_engines`.

Registered in the `specedge` group by `specedge/cli.py`; also runnable on its own as
`python -m specedge.engine_cli`. Needs only the runtime install plus onnxruntime-gpu with the
TensorRT execution provider (no torch): it runs on the Jetson that will use the engines.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specedge.runtime.engines import ENGINE_PRECISIONS


@click.command("build-engine")
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("-o", "--output", default=None, type=click.Path(path_type=Path),
              help="Write a copy of PAIR with the engines there (default: add them to PAIR).")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1, 4096),
              help="Largest batch the engines take (profile batch 1..B).")
@click.option("--fp16", "precision", flag_value="fp16", default=True,
              help="TensorRT FP16 kernels (default).")
@click.option("--fp32", "precision", flag_value="fp32", help="TensorRT FP32 kernels only.")
@click.option("--int8", "precision", flag_value="int8",
              help="TensorRT INT8 mode (+FP16); only Q/DQ nodes run in INT8.")
@click.option("--force", is_flag=True,
              help="Rebuild engines PAIR already lists; replace a non-empty --output pair.")
@click.option("--device", "device_id", default=0, show_default=True, type=click.IntRange(0, 64),
              help="CUDA device to build on.")
def build_engine(pair: Path, output: Path | None, batch: int, precision: str, force: bool,
                 device_id: int) -> None:
    """Compile each model of PAIR into a TensorRT engine (an EPContext model with the engine
    beside it, via ONNX Runtime's TensorRT EP) for this GPU, and list them in the manifest.

    One optimization profile per model: batch 1..B, new tokens 1..max length (K+1 optimal),
    past 0..max length. `specedge generate --providers tensorrt` then loads the engines when
    the GPU, TensorRT and onnxruntime versions match the build, and the ONNX models otherwise.
    Needs a pair of float models in standard ops (`export --graph concat-standard`).
    """
    from specedge.cli_errors import clean_errors

    clean_errors(_build)(pair, output, batch, precision, force, device_id)


def _build(pair: Path, output: Path | None, batch: int, precision: str, force: bool,
           device_id: int) -> None:
    from specedge.exporter.engine import EngineOptions, build_engines

    assert precision in ENGINE_PRECISIONS
    opts = EngineOptions(pair=pair, output=output, batch=batch, precision=precision,
                         force=force, device_id=device_id)
    report = build_engines(opts, progress=lambda msg: click.echo(msg, err=True))
    if report.skipped:
        click.echo(f"{report.folder}: engines {report.skipped}; --force rebuilds them")
        return
    for name, engine in report.engines.items():
        seconds = report.seconds.get(name)
        took = f" in {seconds:.0f} s" if seconds is not None else ""
        click.echo(f"{name}: {engine.path} ({engine.precision}, batch 1..{engine.max_batch})"
                   f"{took}")
    click.echo(f"{report.folder}: engines listed in specedge.json; run with "
               f"`specedge generate {report.folder} PROMPT --providers tensorrt`")
    sys.stdout.flush()


if __name__ == "__main__":
    build_engine()
