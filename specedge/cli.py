"""The `specedge` command line: a thin click group over the library functions.

Each command parses its options into the library's frozen dataclasses, calls one library
function, and prints with rich. Choices (quantization methods, precisions, graph forms,
drafters) come from the modules that implement them. Package errors become one clean line and a
non-zero exit; malformed option values are click usage errors (exit 2). Ctrl-C exits 130,
SIGTERM 143 and SIGHUP 129 after the same cleanup (temporary folders removed, child processes
ended); a closed stdout pipe (`| head`) exits 141 without a word, like other Unix tools.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import click

from specedge.calibration.draft_search import PRECISIONS as DRAFT_PRECISIONS
from specedge.calibration.draft_search import SELF_DRAFTS, SEPARATE_DRAFT_PRECISIONS
from specedge.cli_base import (
    FORCE,
    NO_VERIFY,
    CommaSeparated,
    ks_option,
    max_new_tokens_option,
    new_table,
    print_table,
    read_prompt_file,
    stage_status,
)
from specedge.cli_errors import OneLineErrors, clean_errors
from specedge.exporter.pair import GRAPHS, PRECISIONS, PROVIDERS
from specedge.exporter.quantize import METHODS
from specedge.runtime.errors import InputError, SpecEdgeError
from specedge.runtime.files import json_dumps
from specedge.runtime.manifest import DRAFTERS

# ----------------------------------------------------------------------------- commands


@click.group(cls=OneLineErrors)
@click.version_option(package_name="specedge")
@click.option("-v", "--verbose", count=True,
              help="Show ONNX Runtime's own log (-v warnings and errors, -vv info) and "
                   "specedge's info messages.")
def main(verbose: int) -> None:
    """specedge: speculative decoding for edge devices (export, generate, bench)."""
    # The root handler is set here, so that libraries that call logging.basicConfig(INFO) on
    # import (onnxruntime.quantization's matmul_nbits_quantizer) print nothing without -v.
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    if not verbose:  # nor their progress bars (transformers' GGUF and weight loading)
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        # nor their warnings' own handlers (transformers' LOAD REPORT tables, ...)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        # nor their warnings (torch.onnx's TracerWarning / UserWarning lines in a concat export)
        import warnings

        warnings.filterwarnings("ignore", module=r"(torch|transformers|onnx|onnxruntime|"
                                                 r"onnxscript|onnx_ir)(\.|$)")
    if verbose:
        from specedge.runtime.sessions import set_log_severity

        set_log_severity(max(0, 3 - verbose))


@main.command()
@click.argument("target")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Pair folder to create.")
@click.option("--draft", default=None, help="Draft source (HF folder, hub id or .gguf), with "
              "the target's tokenizer or its own (bridged: it proposes the tokens both hold); "
              "default: a self-draft of the target when --draft-precision is given, or, on cpu "
              "with no --precision, the int8-rtn self-draft of the fast CPU pair.")
@click.option("--precision", default=None, type=click.Choice(PRECISIONS),
              help="Target precision [default: fp32].")
@click.option("--draft-precision", default=None, type=click.Choice(PRECISIONS),
              help="Draft precision (a self-draft of the target unless --draft is given).")
@click.option("--provider", default="cpu", show_default=True, type=click.Choice(PROVIDERS),
              help="Execution provider the graphs are built for.")
@click.option("--num-draft-tokens", default=None, type=int,
              help="Default draft length written to the manifest [default: 3; 5 with the CPU "
                   "defaults].")
@click.option("--chat-template", "chat_template", default=None,
              type=click.Path(path_type=Path),
              help="Jinja chat template file for the pair (replaces the model's own).")
@click.option("--graph", default="auto", show_default=True,
              type=click.Choice(("auto", *GRAPHS)),
              help="Graph form; concat is needed for batched speculative decoding "
                   "(concat-standard: standard ops only, for TensorRT).")
@click.option("--draft-graph", default=None, type=click.Choice(GRAPHS),
              help="The draft's graph form, where it differs from --graph (a gqa-shared draft "
                   "beside a concat target also batches, its steps in place).")
@click.option("--target-from", "target_from", default=None, metavar="PAIR",
              type=click.Path(path_type=Path),
              help="Copy the target of this exported pair instead of exporting it again (to try "
                   "another draft); PAIR must hold TARGET at the same --precision, --provider "
                   "and --graph.")
@click.option("--no-validate", is_flag=True, help="Skip the comparison with torch.")
@click.option("--calibrate", "calibrate_method", default=None, type=click.Choice(METHODS),
              help="Then quantize the (fp32) target with this method, as `specedge quantize`.")
@click.option("--data", "data_file", type=click.Path(path_type=Path), default=None,
              help="Calibration data for --calibrate (default: built-in sample).")
@FORCE
@clean_errors
def export(target: str, output: Path, draft: str | None, precision: str | None,
           draft_precision: str | None, provider: str, num_draft_tokens: int | None,
           chat_template: Path | None, graph: str, draft_graph: str | None,
           target_from: Path | None, no_validate: bool, calibrate_method: str | None,
           data_file: Path | None, force: bool) -> None:
    """Export TARGET (HF folder, hub id or .gguf) and a draft into a validated pair folder.

    Without --precision, --draft-precision or --draft on cpu, it writes the fast CPU pair: an
    fp32 target, its int8 weight-only self-draft (int8-rtn) and hybrid drafting at K=5.
    """
    from specedge.exporter.pair import ExportOptions, cpu_defaults, export_pair

    if data_file is not None and not calibrate_method:
        raise click.UsageError("--data is calibration data for --calibrate; add --calibrate "
                               "METHOD or drop --data")
    if data_file is not None:
        from specedge.calibration.data import read_texts

        read_texts(data_file)  # a bad file fails now, not after the export
    picked: dict[str, Any] = {}
    note = None
    if precision is None and draft_precision is None and draft is None and provider == "cpu":
        picked, note = cpu_defaults(num_draft_tokens)
    opts = ExportOptions(**{
        "target": target, "output": output, "draft": draft, "precision": precision or "fp32",
        "draft_precision": draft_precision, "provider": provider,
        "num_draft_tokens": 3 if num_draft_tokens is None else num_draft_tokens, "force": force,
        "validate": not no_validate, "graph": None if graph == "auto" else graph,
        "draft_graph": draft_graph, "target_from": target_from,
        "chat_template": chat_template, **picked})
    if calibrate_method and opts.precision != "fp32":
        raise InputError("--calibrate quantizes an fp32 target: use --precision fp32")
    with stage_status("exporting" + (" (cpu defaults: fp32 + int8-rtn self-draft)" if note else "")
                 ) as say:
        report = export_pair(opts, progress=say)
    if note:
        click.echo(note)
    _print_export(report)
    if calibrate_method:
        from specedge.calibration.quantize import quantize_in_place

        try:
            quality = quantize_in_place(report.folder, calibrate_method, data_file,
                                        say=lambda msg: click.echo(msg, err=True))
        except SpecEdgeError as exc:
            why = " ".join(str(exc).split())
            raise type(exc)(f"{why} (--calibrate failed; the exported fp32 pair is complete "
                            f"at {report.folder}: quantize it with `specedge quantize "
                            f"{report.folder} -o OUT --method {calibrate_method}`)") from None
        click.echo(json_dumps(quality, indent=2))


def _print_export(report: Any) -> None:
    rows = []
    for name, spec in (("target", report.manifest.target), ("draft", report.manifest.draft)):
        if spec is None:
            continue
        v = spec.validation
        step, pre = v.get("step_with_past", {}), v.get("prefill", {})

        def cell(d: dict[str, Any], key: str, fmt: str) -> str:
            return format(d[key], fmt) if key in d else "–"  # --no-validate: nothing measured

        rows.append([name, spec.precision, spec.graph, cell(step, "max_abs_diff", ".2e"),
                     cell(step, "top1_agreement", ".1%"), cell(step, "kl_mean", ".2e"),
                     cell(pre, "max_abs_diff", ".2e"), str(v.get("passed", "not validated"))])
    print_table(new_table(f"pair written to {report.folder}",
                           ("model", "precision", "graph", "step max|Δ|", "step top-1",
                            "step KL", "prefill max|Δ|", "passed"), rows))
    validations = [s.validation for s in (report.manifest.target, report.manifest.draft)
                   if s is not None and s.validation]
    if validations:
        v = validations[0]
        click.echo(f"validated on {v.get('provider', '?')}"
                   + (f" ({v['note']})" if v.get("note") else ""))
    bridged = report.manifest.draft.source.get("vocab_bridge") if report.manifest.draft else None
    if isinstance(bridged, dict):
        click.echo(f"the draft has its own tokenizer: it proposes {bridged.get('proposes')} of "
                   f"the target's {bridged.get('target_tokens')} tokens (those both hold)")
    template = report.manifest.provenance.get("chat_template", {})
    d = report.manifest.defaults
    click.echo(f"chat template: {_template_source(template)}; defaults: {d.drafter} drafting, "
               f"K={d.num_draft_tokens}{', adaptive' if d.adaptive else ''}")
    sizes = {name: sum(f.stat().st_size for f in (report.folder / name).rglob("*")
                       if f.is_file())
             for name in ("target", "draft") if (report.folder / name).is_dir()}
    click.echo(f"export took {report.seconds:.1f} s, peak RSS {report.peak_rss_mb:.0f} MiB"
               + "".join(f"; {name} {size / 2**20:.1f} MiB" for name, size in sizes.items()))


def _template_source(template: dict[str, Any]) -> str:
    """Where a pair's chat template came from, in words."""
    source = template.get("source", "unknown")
    where = template.get("file") or template.get("origin")
    return {"none": "none (chat prompts will fail; add one with --chat-template FILE)",
            "file": f"from the file {where}", "gguf": "from the GGUF metadata",
            "hf-folder": "from the model folder"}.get(source, source)


@main.command()
@click.argument("target")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", required=True, type=click.Path(path_type=Path),
              help="Held-out evaluation prompts (.txt or .jsonl).")
@click.option("--limit", default=12, show_default=True, type=click.IntRange(min=1),
              help="Use the first N evaluation prompts.")
@click.option("--precision", default="fp32", show_default=True,
              type=click.Choice(DRAFT_PRECISIONS), help="Target precision.")
@click.option("--vocab-sizes", default="16384,8192", show_default=True,
              type=CommaSeparated(allow_empty=True),
              help="Reduced draft-head vocabularies to try; '' for none.")
@ks_option("2,3,4,6", "Draft lengths to score.")
@click.option("--self-drafts", default="int8-rtn,int4-hqq", show_default=True,
              type=CommaSeparated(SELF_DRAFTS, allow_empty=True),
              help=f"Quantized self-drafts to build ({', '.join(SELF_DRAFTS)}); '' for none.")
@click.option("--draft", "drafts", multiple=True, metavar="SRC",
              help="A separate draft model to score too (HF folder, hub id or .gguf; one with "
                   "its own tokenizer is bridged to the target's); repeat for several.")
@click.option("--draft-precision", default="int4", show_default=True,
              type=click.Choice(SEPARATE_DRAFT_PRECISIONS),
              help="Precision the --draft models are exported at.")
@max_new_tokens_option(96)
@FORCE
@clean_errors
def draft(target: str, output: Path, prompts_file: Path, limit: int, precision: str,
          vocab_sizes: tuple[int, ...], ks: tuple[int, ...], self_drafts: tuple[str, ...],
          drafts: tuple[str, ...], draft_precision: str, max_new_tokens: int,
          force: bool) -> None:
    """Build candidate drafters for TARGET, score them on held-out prompts, keep the fastest."""
    from specedge.calibration.draft_search import (
        HEADERS,
        DraftSearchOptions,
        format_rows,
        search,
    )
    from specedge.runtime.prompts import read_prompts

    opts = DraftSearchOptions(target=target, output=output, precision=precision,
                              vocab_sizes=vocab_sizes, ks=ks, max_new_tokens=max_new_tokens,
                              self_drafts=self_drafts, drafts=drafts,
                              drafts_precision=draft_precision,
                              eval_prompts=read_prompts(prompts_file)[:limit], force=force)
    with stage_status("draft search") as say:
        table = search(opts, say=say)
    print_table(new_table(f"draft candidates for {target} (target only "
                           f"{table['target_only_tokens_per_s']:.1f} tok/s)", HEADERS,
                           format_rows(table)))
    w = table["winner"]
    click.echo(f"kept: {w['name']} at K={w['k']} ({w['speedup']:.2f}x) -> {output}")
    if w["speedup"] < 1.0:
        click.echo("no candidate was faster than target-only here: decode this pair with "
                   "--no-speculation, or score other drafts (--draft SRC)")


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="New pair folder (the source pair is left as it is).")
@click.option("--method", required=True, type=click.Choice(METHODS))
@click.option("--model", "which", default="target", show_default=True,
              type=click.Choice(["target", "draft"]))
@click.option("--data", "data_file", type=click.Path(path_type=Path), default=None,
              help="Calibration text (.txt paragraphs or .jsonl); default: built-in sample.")
@click.option("--samples", default=16, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--block-size", default=32, show_default=True, type=int)
@click.option("--accuracy-level", default=4, show_default=True, type=click.IntRange(0, 4),
              help="MatMulNBits compute: 4 = int8 activations, 1 = fp32 (weight-only methods).")
@click.option("--exclude", multiple=True, help="MatMul node to keep in float (repeatable).")
@click.option("--asymmetric", is_flag=True, help="Weight-only grids with zero points.")
@FORCE
@clean_errors
def quantize(pair: Path, output: Path, method: str, which: str, data_file: Path | None,
             samples: int, seed: int, block_size: int, accuracy_level: int,
             exclude: tuple[str, ...], asymmetric: bool, force: bool) -> None:
    """Quantize the target (or draft) of PAIR with calibration data; print its quality."""
    from specedge.calibration.data import CalibrationOptions
    from specedge.calibration.quality import annotate
    from specedge.calibration.quantize import QuantizeOptions
    from specedge.calibration.quantize import quantize as run

    opts = QuantizeOptions(pair=pair, output=output, method=method, model=which,
                           data_file=data_file,
                           calibration=CalibrationOptions(samples=samples, seed=seed),
                           block_size=block_size, accuracy_level=accuracy_level,
                           exclude=exclude, symmetric=not asymmetric, force=force)
    folder = run(opts, say=lambda msg: click.echo(msg, err=True))
    try:
        quality = annotate(pair, folder, which)
    except BaseException:  # no output without its quality report (the pair was just written)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    click.echo(json_dumps(quality, indent=2))


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("--data", "data_file", type=click.Path(path_type=Path), default=None,
              help="Prompts (.txt or .jsonl); default: the built-in calibration prompts.")
@ks_option("1,2,3,4,5,6", "Draft lengths to measure.")
@click.option("--drafters", default="model", show_default=True, type=CommaSeparated(DRAFTERS),
              help=f"Drafters to measure, from {','.join(DRAFTERS)}.")
@max_new_tokens_option(96)
@click.option("--dry-run", is_flag=True, help="Measure only; do not write the manifest.")
@clean_errors
def tune(pair: Path, data_file: Path | None, ks: tuple[int, ...], drafters: tuple[str, ...],
         max_new_tokens: int, dry_run: bool) -> None:
    """Measure drafters and K on prompts and store the fastest as PAIR's defaults."""
    from specedge.calibration.data import CALIBRATION_PROMPTS
    from specedge.calibration.tune import TuneOptions
    from specedge.calibration.tune import tune as run

    opts = TuneOptions(pair=pair, prompts=read_prompt_file(data_file, CALIBRATION_PROMPTS),
                       ks=ks, drafters=drafters, max_new_tokens=max_new_tokens,
                       write=not dry_run)
    table = run(opts, progress=lambda msg: click.echo(msg, err=True))
    def setting(r: dict[str, Any]) -> str:
        return f"{r['drafter']} " + (f"adaptive K<={r['k']}" if r["adaptive"] else f"K={r['k']}")

    for r in table["rows"]:
        acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        click.echo(f"{setting(r):>22}: {r['tokens_per_s']:.1f} tok/s "
                   f"({r['speedup']:.2f}x), acceptance {acc}")
    click.echo(f"best: {setting(table['best'])}" + ("" if dry_run else f" -> {pair}"))


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@NO_VERIFY
@click.option("--render", "message", default=None, metavar="MESSAGE",
              help="Also render MESSAGE as a user turn through the chat template: the exact "
                   "prompt text and its token count, as generate --chat and serve send it.")
@click.option("--system", default=None, help="A system message before --render's message.")
@clean_errors
def inspect(pair: Path, no_verify: bool, message: str | None, system: str | None) -> None:
    """Validate the pair folder PAIR and print its manifest summary as JSON."""
    from specedge.runtime.manifest import describe, load_manifest

    if system is not None and message is None:
        raise click.UsageError("--system goes with --render MESSAGE")
    manifest = load_manifest(pair, verify_hashes=not no_verify)
    summary = dict(describe(manifest))
    template = manifest.provenance.get("chat_template")
    if not isinstance(template, dict):  # a pair written before the exporter recorded it
        template = {"source": "unknown" if "chat_template.jinja" in manifest.tokenizer_files
                    else "none"}
    summary["chat_template"] = template
    if message is not None:
        summary["chat_template"] = {**template, **_render(manifest, message, system)}
    click.echo(json_dumps(summary, indent=2))


def _render(manifest: Any, message: str, system: str | None) -> dict[str, Any]:
    """The messages, the prompt the chat template renders for them, and its token count."""
    from specedge.runtime.text import Tokenizer, check_text

    turns = ([{"role": "system", "content": check_text(system, "--system")}] if system else [])
    turns.append({"role": "user", "content": check_text(message, "--render")})
    tokenizer = Tokenizer.from_folder(manifest.root, bos_token_id=manifest.bos_token_id,
                                      eos_token_ids=manifest.eos_token_ids, manifest=manifest)
    return {"messages": turns, "rendered": tokenizer.render_chat(turns),
            "rendered_tokens": len(tokenizer.encode_chat(turns))}


@main.command("split-head")
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Write the head files again where PAIR has them.")
@clean_errors
def split_head(pair: Path, force: bool) -> None:
    """Split the output head off each model of PAIR, in place (`export` does it already).

    Greedy decoding on the CPU then reads an int8 copy of the head and computes only the few
    tokens its error bound leaves in float: the same argmax, a quarter of the head's bytes.
    Adds body.onnx, head.onnx and shortlist.onnx(.data) beside each float model and lists them
    in the manifest; model.onnx stays (ONNX Runtime GenAI and other paths use it).
    """
    from specedge.exporter.output import require_modules
    from specedge.exporter.split_head import split_pair_heads

    require_modules("split-head", ("onnx",))
    done = split_pair_heads(pair, force=force, say=lambda msg: click.echo(msg, err=True))
    for name, split in done.items():
        click.echo(f"{name}: {'head split' if split else 'head kept in the graph'}")


def _register_commands() -> None:
    """Commands that live in their own modules (they import this one lazily)."""
    from specedge.bench_cli import bench
    from specedge.doctor_cli import doctor
    from specedge.engine_cli import build_engine
    from specedge.generate_cli import chat, generate
    from specedge.serve_cli import serve

    for command in (generate, chat, bench, doctor, build_engine, serve):
        main.add_command(command)


_register_commands()


if __name__ == "__main__":  # pragma: no cover
    main()
