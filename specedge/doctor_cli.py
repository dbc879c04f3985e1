"""`specedge doctor`: the click command over `specedge.runtime.doctor.diagnose`.

Registered in the `specedge` group by `specedge/cli.py`; also runnable on its own as
`python -m specedge.doctor_cli`. It prints rich tables (whole, however wide, when stdout is not a
terminal) or `--json`, and exits 1 with one line on stderr when a provider named in
`--providers` cannot run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence

import click

from specedge.cli_base import rich_console
from specedge.cli_errors import clean_errors
from specedge.runtime.doctor import DoctorReport, diagnose, parse_providers
from specedge.runtime.errors import InputError


def _console(stderr: bool = False):  # noqa: ANN202 - rich is imported lazily
    console = rich_console(stderr=stderr)
    if not console.is_terminal:  # logs and pipes get every character of every cell
        console = rich_console(stderr=stderr, width=1 << 12)
    return console


def _table(title: str, headers: Sequence[str], rows: Iterable[Sequence[str]],
           show_header: bool = True):  # noqa: ANN202
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title), title_justify="left", show_header=show_header)
    for header in headers:
        table.add_column(header, overflow="fold")
    for row in rows:  # Text: no rich markup in cells ("onnxruntime-gpu[cuda,cudnn]" stays whole)
        table.add_row(*(Text(cell) for cell in row))
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def print_report(report: DoctorReport) -> None:
    """The report as rich tables on stdout."""
    console = _console()
    facts = [("python", f"{report.python} ({report.platform})"),
             ("onnxruntime", f"{report.onnxruntime} ({', '.join(report.onnxruntime_packages)}; "
                             f"device {report.device})"),
             ("built for CUDA", report.onnxruntime_cuda or "– (CPU build)"),
             ("providers in the build", ", ".join(report.available_providers)),
             ("huge pages for weights", report.huge_pages.get("status", "?"))]
    if report.jetson:
        j = report.jetson
        facts += [("Jetson", f"{j.model or 'unknown board'}, Jetson Linux {j.l4t or '?'}, "
                             f"JetPack {j.jetpack or '?'}"),
                  ("onnxruntime-gpu for it", j.advice)]
    console.print(_table("specedge doctor", ("", ""), facts, show_header=False))
    gpus = [(str(g.index), g.name, g.compute_capability or "?",
             f"{g.memory_mib} MiB" if g.memory_mib else "?", g.driver or "?", g.source)
            for g in report.gpus]
    console.print(_table("GPUs" + (f" (from {report.gpu_note})" if gpus else ""),
                         ("#", "name", "compute capability", "memory", "driver", "from"),
                         gpus or [("–", f"none found: {report.gpu_note}", "", "", "", "")]))
    console.print(_table("GPU libraries", ("library", "file", "for", "status", "where / fix"),
                         [(lib.component, lib.soname, lib.needed_by, lib.status,
                           (lib.fix if lib.status == "missing" else
                            f"{lib.path or '?'}" + (f" — {lib.fix}" if lib.fix else "")))
                          for lib in report.libraries]))
    console.print(_table("provider self-test (built-in graph vs numpy)",
                         ("provider", "status", "ran on", "seconds", "max |Δ|", "note / fix"),
                         [(t.provider + (" (asked)" if t.provider in report.requested else ""),
                           t.status, ", ".join(t.ran_on) or "–", _fmt(t.seconds, ".2f"),
                           _fmt(t.max_abs_diff, ".1e"),
                           "; ".join(x for x in (t.message, f"fix: {t.fix}" if t.fix else "")
                                     if x))
                          for t in report.self_tests]))
    for warning in report.warnings:
        console.print(f"warning: {warning}", markup=False)


@click.command()
@click.option("--providers", default=None, metavar="cpu|cuda|tensorrt[,..]",
              help="Providers that must run here; exit 1 when one cannot. Default: cpu.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@clean_errors
def doctor(providers: str | None, as_json: bool) -> None:
    """Check what this machine can run: onnxruntime and its providers, the GPU, the CUDA /
    cuDNN / TensorRT libraries, Jetson, and a few-second self-test of each provider."""
    try:
        requested = parse_providers(providers)
    except InputError as exc:
        raise click.BadParameter(str(exc).split(": ", 1)[-1], param_hint="--providers") from None
    report = diagnose(requested)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    if not report.ok:
        click.echo(f"error: {report.failure_line()}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    doctor()
