"""The `specedge` command line: a thin click group over the library functions.

Each command parses its options into a frozen dataclass, calls one library function, and prints
with rich. Package errors (and Ctrl-C) become one clean line and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from specedge.runtime.errors import SpecEdgeError

F = TypeVar("F", bound=Callable[..., Any])


def clean_errors(fn: F) -> F:
    """Turn package errors into one line on stderr and exit code 1 (2 for usage)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SpecEdgeError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            # Cleanup already ran in the `finally` blocks on the way here. Leave now: a normal
            # interpreter shutdown can meet the interrupt again (torch and onnxruntime
            # threads) and then exits by SIGINT instead of 130.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        except OSError as exc:
            click.echo(f"error: {exc.filename or ''}: {exc.strerror or exc}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


@click.group()
@click.version_option(package_name="specedge")
def main() -> None:
    """specedge: speculative decoding for edge devices (export, generate, bench)."""


@main.command()
@click.argument("target")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Pair folder to create.")
@click.option("--draft", default=None, help="Draft source (HF folder, hub id or .gguf); "
              "default: a self-draft of the target when --draft-precision is given.")
@click.option("--precision", default="fp32", show_default=True,
              type=click.Choice(["fp32", "fp16", "int8", "int4"]), help="Target precision.")
@click.option("--draft-precision", default=None,
              type=click.Choice(["fp32", "fp16", "int8", "int4"]), help="Draft precision.")
@click.option("--provider", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="Execution provider the graphs are built for.")
@click.option("--num-draft-tokens", default=3, show_default=True, type=int,
              help="Default draft length written to the manifest.")
@click.option("--graph", default="auto", show_default=True,
              type=click.Choice(["auto", "gqa-shared", "concat"]),
              help="Graph form; concat is needed for batched speculative decoding on CPU.")
@click.option("--no-validate", is_flag=True, help="Skip the comparison with torch.")
@click.option("--calibrate", "calibrate_method", default=None,
              type=click.Choice(["fp16", "fp8", "int8-dynamic", "int8-minmax", "int8-entropy",
                                 "int8-percentile", "int4-rtn", "int4-hqq", "int4-kquant",
                                 "int4-gptq"]),
              help="Then quantize the (fp32) target with this method, as `specedge quantize`.")
@click.option("--data", "data_file", type=click.Path(path_type=Path), default=None,
              help="Calibration data for --calibrate (default: built-in sample).")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@clean_errors
def export(target: str, output: Path, draft: str | None, precision: str,
           draft_precision: str | None, provider: str, num_draft_tokens: int, graph: str,
           no_validate: bool, calibrate_method: str | None, data_file: Path | None,
           force: bool) -> None:
    """Export TARGET (HF folder, hub id or .gguf) and a draft into a validated pair folder."""
    from rich.console import Console

    from specedge.exporter.pair import ExportOptions, export_pair

    opts = ExportOptions(target=target, output=output, draft=draft, precision=precision,
                         draft_precision=draft_precision, provider=provider,
                         num_draft_tokens=num_draft_tokens, force=force,
                         validate=not no_validate, graph=None if graph == "auto" else graph)
    console = Console(stderr=True)
    if calibrate_method and precision != "fp32":
        from specedge.runtime.errors import InputError

        raise InputError("--calibrate quantizes an fp32 target: use --precision fp32")
    with console.status("exporting") as status:
        report = export_pair(opts, progress=lambda msg: status.update(msg))
    _print_export(report)
    if calibrate_method:
        import shutil

        from specedge.calibration.quality import annotate
        from specedge.calibration.quantize import QuantizeOptions, quantize

        folder = report.folder
        staged = folder.with_name(f".{folder.name}.calibrated")
        try:
            quantize(QuantizeOptions(pair=folder, output=staged, method=calibrate_method,
                                     data_file=data_file, force=True),
                     say=lambda msg: click.echo(msg, err=True))
            click.echo(json.dumps(annotate(folder, staged, "target"), indent=2))
            old = folder.with_name(f".{folder.name}.fp32")
            folder.rename(old)
            staged.rename(folder)
            shutil.rmtree(old)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise


@main.command()
@click.argument("target")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", required=True, type=click.Path(path_type=Path),
              help="Held-out evaluation prompts (.txt or .jsonl).")
@click.option("--limit", default=12, show_default=True, type=int,
              help="Use the first N evaluation prompts.")
@click.option("--precision", default="fp32", show_default=True,
              type=click.Choice(["fp32", "int8", "int4"]), help="Target precision.")
@click.option("--vocab-sizes", default="16384,8192", show_default=True,
              help="Reduced draft-head vocabularies to try.")
@click.option("--ks", default="2,3,4,6", show_default=True)
@click.option("--self-drafts", default="int8-rtn,int4-hqq", show_default=True,
              help="Quantized self-drafts to build (int8-rtn, int4-hqq, int4-rtn); '' for none.")
@click.option("--max-new-tokens", default=96, show_default=True, type=int)
@click.option("--force", is_flag=True)
@clean_errors
def draft(target: str, output: Path, prompts_file: Path, limit: int, precision: str,
          vocab_sizes: str, ks: str, self_drafts: str, max_new_tokens: int, force: bool) -> None:
    """Build candidate drafters for TARGET, score them on held-out prompts, keep the fastest."""
    from rich.console import Console
    from rich.table import Table

    from specedge.exporter.draft_search import DraftSearchOptions, search
    from specedge.runtime.bench import read_prompts
    from specedge.runtime.errors import InputError

    try:
        sizes = tuple(int(v) for v in vocab_sizes.split(",") if v.strip())
        k_list = tuple(int(k) for k in ks.split(",") if k.strip())
    except ValueError:
        raise InputError("--vocab-sizes and --ks take comma-separated integers") from None
    opts = DraftSearchOptions(target=target, output=output, precision=precision,
                              vocab_sizes=sizes, ks=k_list, max_new_tokens=max_new_tokens,
                              self_drafts=tuple(m for m in self_drafts.split(",") if m.strip()),
                              eval_prompts=read_prompts(prompts_file)[:limit], force=force)
    console = Console(stderr=True)
    with console.status("draft search") as status:
        table = search(opts, say=lambda msg: status.update(msg))
    out = Table(title=f"draft candidates for {target} (target only "
                      f"{table['target_only_tokens_per_s']:.1f} tok/s)")
    for col in ("candidate", "K", "tok/s", "speed-up", "acceptance", "tokens/round",
                "draft cost", "build s", "build peak MiB"):
        out.add_column(col)
    for cand in table["candidates"]:
        for k, row in cand["rows"].items():
            ratio = cand["draft_cost_ratio"]
            out.add_row(cand["name"], k, f"{row['tokens_per_s']:.1f}",
                        f"{row['speedup']:.2f}x", f"{row['acceptance']:.2f}",
                        f"{row['tokens_per_round']:.2f}",
                        f"{ratio:.2f}" if ratio else "–", f"{cand['build_s']:.0f}",
                        f"{cand['build_peak_rss_mib']:.0f}"
                        if cand.get("build_peak_rss_mib") else "in process")
    Console(width=180).print(out)
    w = table["winner"]
    click.echo(f"kept: {w['name']} at K={w['k']} ({w['speedup']:.2f}x) -> {output}")


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="New pair folder (the source pair is left as it is).")
@click.option("--method", required=True,
              type=click.Choice(["fp16", "fp8", "int8-dynamic", "int8-minmax", "int8-entropy",
                                 "int8-percentile", "int4-rtn", "int4-hqq", "int4-kquant",
                                 "int4-gptq"]))
@click.option("--model", "which", default="target", show_default=True,
              type=click.Choice(["target", "draft"]))
@click.option("--data", "data_file", type=click.Path(path_type=Path), default=None,
              help="Calibration text (.txt paragraphs or .jsonl); default: built-in sample.")
@click.option("--samples", default=16, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--block-size", default=32, show_default=True, type=int)
@click.option("--accuracy-level", default=4, show_default=True, type=click.IntRange(0, 4),
              help="MatMulNBits compute: 4 = int8 activations, 1 = fp32 (int4 methods).")
@click.option("--exclude", multiple=True, help="MatMul node to keep in float (repeatable).")
@click.option("--asymmetric", is_flag=True, help="int4 with zero points (RTN/GPTQ/k-quant).")
@click.option("--force", is_flag=True)
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
    report = annotate(pair, folder, which)
    click.echo(json.dumps(report, indent=2))


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("--data", "data_file", type=click.Path(path_type=Path), default=None,
              help="Prompts (.txt or .jsonl); default: the built-in calibration prompts.")
@click.option("--ks", default="1,2,3,4,5,6", show_default=True)
@click.option("--drafters", default="model", show_default=True, help="model,ngram,hybrid")
@click.option("--max-new-tokens", default=96, show_default=True, type=int)
@click.option("--dry-run", is_flag=True, help="Measure only; do not write the manifest.")
@clean_errors
def tune(pair: Path, data_file: Path | None, ks: str, drafters: str, max_new_tokens: int,
         dry_run: bool) -> None:
    """Measure drafters and K on prompts and store the fastest as PAIR's defaults."""
    from specedge.calibration.data import CALIBRATION_PROMPTS
    from specedge.calibration.tune import TuneOptions, read_prompt_file
    from specedge.calibration.tune import tune as run
    from specedge.runtime.errors import InputError

    try:
        k_list = tuple(int(k) for k in ks.split(",") if k.strip())
    except ValueError:
        raise InputError(f"--ks {ks!r}: give comma-separated integers") from None
    opts = TuneOptions(pair=pair, prompts=read_prompt_file(data_file, CALIBRATION_PROMPTS),
                       ks=k_list, drafters=tuple(d.strip() for d in drafters.split(",")),
                       max_new_tokens=max_new_tokens, write=not dry_run)
    table = run(opts, progress=lambda msg: click.echo(msg, err=True))
    for r in table["rows"]:
        acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        click.echo(f"{r['drafter']:>6} K={r['k']}: {r['tokens_per_s']:.1f} tok/s "
                   f"({r['speedup']:.2f}x), acceptance {acc}")
    b = table["best"]
    click.echo(f"best: {b['drafter']} K={b['k']}" + ("" if dry_run else f" -> {pair}"))


def _print_export(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pair written to {report.folder}")
    for col in ("model", "precision", "graph", "step max|Δ|", "step top-1", "step KL",
                "prefill max|Δ|", "passed"):
        table.add_column(col)
    for name, spec in (("target", report.manifest.target), ("draft", report.manifest.draft)):
        if spec is None:
            continue
        v = spec.validation
        step, pre = v.get("step_with_past", {}), v.get("prefill", {})
        table.add_row(name, spec.precision, spec.graph,
                      f"{step.get('max_abs_diff', float('nan')):.2e}",
                      f"{step.get('top1_agreement', float('nan')):.1%}",
                      f"{step.get('kl_mean', float('nan')):.2e}",
                      f"{pre.get('max_abs_diff', float('nan')):.2e}",
                      str(v.get("passed", "not validated")))
    Console().print(table)
    click.echo(f"export took {report.seconds:.1f} s, peak RSS {report.peak_rss_mb:.0f} MiB")


def _generation_config(max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                       min_p: float, seed: int | None, num_draft_tokens: int | None,
                       drafter: str | None, no_speculation: bool, adaptive: bool | None,
                       stop: tuple[str, ...], chat: bool) -> Any:
    from specedge.runtime.pair import GenerationConfig
    from specedge.runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              seed=seed)
    return GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling,
                            num_draft_tokens=num_draft_tokens,
                            drafter="none" if no_speculation else drafter,
                            adaptive=adaptive, stop=stop, chat=chat)


def generation_options(fn: F) -> F:
    """Options shared by `generate` and `chat`."""
    options = [
        click.option("--max-new-tokens", default=128, show_default=True, type=int),
        click.option("--temperature", default=0.0, show_default=True, type=float,
                     help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, type=int, help="0 = off."),
        click.option("--top-p", default=1.0, show_default=True, type=float),
        click.option("--min-p", default=0.0, show_default=True, type=float),
        click.option("--seed", default=None, type=int, help="Seed of the sampler."),
        click.option("--num-draft-tokens", "-k", default=None, type=int,
                     help="Draft length K (default: the pair's)."),
        click.option("--drafter", default=None,
                     type=click.Choice(["model", "ngram", "hybrid", "none"])),
        click.option("--no-speculation", is_flag=True, help="Target-only decoding."),
        click.option("--adaptive/--fixed-k", default=None,
                     help="Adapt K to measured acceptance and cost (default: the pair's)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--providers", default="cpu", show_default=True,
                     help="Execution provider, or TARGET,DRAFT (e.g. cuda,cpu)."),
        click.option("--threads", default=None, help="Intra-op threads, or TARGET,DRAFT."),
        click.option("--no-verify", is_flag=True,
                     help="Skip the sha256 check of the model files (logged)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load_pair(pair: Path, providers: str, threads: str | None, no_verify: bool) -> Any:
    from specedge.runtime.errors import InputError
    from specedge.runtime.pair import Pair, plan_threads

    prov = [p.strip() for p in providers.split(",")]
    if len(prov) not in (1, 2):
        raise InputError(f"--providers {providers!r}: give one provider or TARGET,DRAFT")
    target_p, draft_p = (prov[0], prov[0]) if len(prov) == 1 else (prov[0], prov[1])
    plan = None
    if threads:
        try:
            nums = [int(t) for t in threads.split(",")]
        except ValueError:
            raise InputError(f"--threads {threads!r}: give N or TARGET,DRAFT") from None
        if len(nums) not in (1, 2) or min(nums) < 0:
            raise InputError(f"--threads {threads!r}: give N or TARGET,DRAFT (>= 0)")
        plan = plan_threads(target_p, draft_p, nums[0], nums[-1])
    return Pair.load(pair, providers=(target_p, draft_p), plan=plan, verify_hashes=not no_verify)


def _print_stats(result: Any, as_json: bool) -> None:
    s = result.stats
    if as_json:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="statistics", show_header=False)
    rows = [
        ("stop reason", result.stop_reason),
        ("prompt / new tokens", f"{s.prompt_tokens} / {s.new_tokens}"),
        ("rounds", str(s.rounds)),
        ("proposed / accepted drafts", f"{s.proposed} / {s.accepted}"),
        ("acceptance rate", f"{s.acceptance_rate:.1%}"),
        ("mean tokens per round", f"{s.mean_accepted_length:.2f}"),
        ("draft / target calls", f"{s.draft_calls} / {s.target_calls}"),
        ("prefill / draft / verify / host (s)",
         f"{s.prefill_s:.3f} / {s.draft_s:.3f} / {s.verify_s:.3f} / {s.host_s:.3f}"),
        ("decode tokens/s", f"{s.tokens_per_s:.1f}"),
        ("end-to-end tokens/s", f"{s.end_to_end_tokens_per_s:.1f}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console(stderr=True).print(table)


_ROW_KEYS = {"prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "min_p",
             "seed", "stop", "chat"}


def _read_batch(path: Path, base: Any) -> tuple[list[Any], list[Any]]:
    """Prompts and per-row configs from a JSONL batch file (CLI options are the defaults)."""
    from dataclasses import replace

    from specedge.runtime.errors import InputError
    from specedge.runtime.sampling import SamplingParams

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the batch file ({exc})") from None
    prompts, configs = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise InputError(f"{path}:{n}: not a JSON object") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise InputError(f"{path}:{n}: give exactly one of \"prompt\" or \"messages\"")
        unknown = set(row) - _ROW_KEYS
        if unknown:
            raise InputError(f"{path}:{n}: unknown key(s) {sorted(unknown)}; use "
                             f"{', '.join(sorted(_ROW_KEYS))}")
        s = base.sampling
        sampling = SamplingParams(
            temperature=row.get("temperature", s.temperature), top_k=row.get("top_k", s.top_k),
            top_p=row.get("top_p", s.top_p), min_p=row.get("min_p", s.min_p),
            seed=row.get("seed", s.seed))
        stop = row.get("stop", list(base.stop))
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise InputError(f"{path}:{n}: \"stop\" must be a list of strings")
        configs.append(replace(base, sampling=sampling, stop=tuple(stop),
                               max_new_tokens=row.get("max_new_tokens", base.max_new_tokens),
                               chat=bool(row.get("chat", base.chat or "messages" in row))))
        prompts.append(row.get("prompt", row.get("messages")))
    if not prompts:
        raise InputError(f"{path}: no rows in the batch file")
    return prompts, configs


def _generate_batch(loaded: Any, batch_file: Path, config: Any, show_stats: bool,
                    as_json: bool) -> None:
    prompts, configs = _read_batch(batch_file, config)
    result = loaded.generate_batch(prompts, configs)
    for i, row in enumerate(result.results):
        if as_json:
            click.echo(json.dumps({"row": i, "text": row.text, "tokens": row.tokens,
                                   "stop_reason": row.stop_reason,
                                   "stats": row.stats.to_dict()}))
        else:
            click.echo(f"[{i}] {row.text}")
    st = result.stats
    if show_stats or as_json:
        summary = {"rows": st.rows, "rounds": st.rounds, "new_tokens": st.new_tokens,
                   "acceptance_rate": st.acceptance_rate, "decode_s": st.decode_s,
                   "aggregate_tokens_per_s": st.tokens_per_s}
        if as_json:
            click.echo(json.dumps({"batch": summary}))
        else:
            click.echo(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in summary.items()), err=True)


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.argument("prompt", required=False)
@generation_options
@click.option("--chat", is_flag=True, help="Wrap PROMPT in the chat template as a user turn.")
@click.option("--batch", "batch_file", type=click.Path(path_type=Path), default=None,
              help="JSONL file, one row per line: {\"prompt\": ...} or {\"messages\": [...]}, "
                   "with optional max_new_tokens, temperature, top_k, top_p, min_p, seed, "
                   "stop. Generates all rows as one batch (needs a --graph concat pair).")
@click.option("--stats", "show_stats", is_flag=True, help="Print statistics (to stderr).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text + stats).")
@clean_errors
def generate(pair: Path, prompt: str | None, max_new_tokens: int, temperature: float,
             top_k: int, top_p: float, min_p: float, seed: int | None,
             num_draft_tokens: int | None, drafter: str | None, no_speculation: bool,
             adaptive: bool | None, stop: tuple[str, ...], providers: str, threads: str | None,
             no_verify: bool, chat: bool, batch_file: Path | None, show_stats: bool,
             as_json: bool) -> None:
    """Generate a completion of PROMPT (or of every row of --batch) with the pair PAIR."""
    from specedge.runtime.errors import InputError

    if (prompt is None) == (batch_file is None):
        raise InputError("give a PROMPT or --batch FILE (one of the two)")
    config = _generation_config(max_new_tokens, temperature, top_k, top_p, min_p, seed,
                                num_draft_tokens, drafter, no_speculation, adaptive, stop, chat)
    loaded = _load_pair(pair, providers, threads, no_verify)
    if batch_file is not None:
        _generate_batch(loaded, batch_file, config, show_stats, as_json)
        return
    assert prompt is not None
    if as_json:
        result = loaded.generate(prompt, config)
        click.echo(json.dumps({"text": result.text, "tokens": result.tokens,
                               "stop_reason": result.stop_reason,
                               "stats": result.stats.to_dict()}))
        return
    gen = loaded.stream(prompt, config)
    while True:
        try:
            click.echo(next(gen), nl=False)
        except StopIteration as done:
            result = done.value
            break
    click.echo()
    if show_stats:
        _print_stats(result, False)


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@generation_options
@click.option("--system", default=None, help="System message.")
@click.option("--stats", "show_stats", is_flag=True, help="Print statistics after each reply.")
@clean_errors
def chat(pair: Path, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
         min_p: float, seed: int | None, num_draft_tokens: int | None, drafter: str | None,
         no_speculation: bool, adaptive: bool | None, stop: tuple[str, ...], providers: str,
         threads: str | None, no_verify: bool, system: str | None, show_stats: bool) -> None:
    """Chat with the pair in folder PAIR (empty line or Ctrl-D to quit)."""
    config = _generation_config(max_new_tokens, temperature, top_k, top_p, min_p, seed,
                                num_draft_tokens, drafter, no_speculation, adaptive, stop, False)
    loaded = _load_pair(pair, providers, threads, no_verify)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        gen = loaded.stream(messages, config)
        while True:
            try:
                click.echo(next(gen), nl=False)
            except StopIteration as done:
                result = done.value
                break
        click.echo()
        messages.append({"role": "assistant", "content": result.text})
        if show_stats:
            _print_stats(result, False)


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
              help="Prompt file: .txt (one per line) or .jsonl ({\"prompt\": ...}).")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--ks", default="1,2,3,4,5,6,7,8", show_default=True, help="Draft lengths to sweep.")
@click.option("--no-adaptive", is_flag=True, help="Skip the adaptive-K setting.")
@click.option("--drafter", default="model", show_default=True,
              type=click.Choice(["model", "ngram", "hybrid"]))
@click.option("--repeats", default=3, show_default=True, type=int)
@click.option("--warmup", default=1, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--plain", is_flag=True, help="Plain prompts (no chat template).")
@click.option("--providers", default="cpu", show_default=True)
@click.option("--threads", default=None, help="Intra-op threads, or TARGET,DRAFT.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None,
              help="Write the full report as JSON.")
@click.option("--plot", "plot_out", type=click.Path(path_type=Path), default=None,
              help="Write a PNG of tokens/s and acceptance against K (needs matplotlib).")
@click.option("--batch", "batches", default=None,
              help="Batch sizes, e.g. 1,2,4,8: aggregate tokens/s of batched target-only and "
                   "speculative decoding (greedy; needs a --graph concat pair).")
@clean_errors
def bench(pair: Path, prompts_file: Path | None, max_new_tokens: int, ks: str, no_adaptive: bool,
          drafter: str, repeats: int, warmup: int, temperature: float, plain: bool,
          providers: str, threads: str | None, json_out: Path | None,
          plot_out: Path | None, batches: str | None) -> None:
    """Measure PAIR: target only, K sweep and adaptive K, with predicted speed-ups."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from specedge.runtime import bench as b
    from specedge.runtime.errors import InputError

    try:
        k_list = tuple(int(k) for k in ks.split(",") if k.strip())
    except ValueError:
        raise InputError(f"--ks {ks!r}: give comma-separated integers") from None
    if batches is not None:
        _bench_batches(pair, prompts_file, batches, k_list, max_new_tokens, not no_adaptive,
                       not plain, providers, threads, json_out)
        return
    options = b.BenchOptions(
        prompts=b.read_prompts(prompts_file) if prompts_file else b.DEFAULT_PROMPTS,
        max_new_tokens=max_new_tokens, ks=k_list, adaptive=not no_adaptive, drafter=drafter,
        repeats=repeats, warmup=warmup, chat=not plain, temperature=temperature)
    loaded = _load_pair(pair, providers, threads, False)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("bench", total=b.total_generations(loaded, options))
        report = b.run_bench(loaded, options,
                             lambda label, n: progress.update(task, advance=n,
                                                              description=label))
    table = Table(title=f"specedge bench {pair} ({len(options.prompts)} prompts x "
                        f"{options.max_new_tokens} tokens, {options.repeats} repeats)")
    for h in b.HEADERS:
        table.add_column(h)
    for row in b.format_rows(report):
        table.add_row(*row)
    Console(width=200).print(table)
    c = report.costs
    click.echo(f"target call: {1000 * c.target[1]:.2f} ms for 1 token at a past of "
               f"{c.past_len}; draft step: "
               + (f"{1000 * c.draft_step:.2f} ms ({c.draft_step / c.target[1]:.2f} of the "
                  "target)" if c.draft_step else "no draft model"))
    if json_out:
        json_out.write_text(json.dumps(report.to_json(), indent=2))
        click.echo(f"wrote {json_out}")
    if plot_out:
        written = b.plot(report, plot_out)
        click.echo(f"wrote {written}" if written else "matplotlib is not installed: no plot")


def _bench_batches(pair: Path, prompts_file: Path | None, batches: str, ks: tuple[int, ...],
                   max_new_tokens: int, adaptive: bool, chat: bool, providers: str,
                   threads: str | None, json_out: Path | None) -> None:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from specedge.runtime import batch_bench as bb
    from specedge.runtime.bench import read_prompts
    from specedge.runtime.errors import InputError

    try:
        sizes = tuple(int(v) for v in batches.split(",") if v.strip())
    except ValueError:
        raise InputError(f"--batch {batches!r}: give comma-separated integers") from None
    default_prompts = Path(__file__).resolve().parent.parent / "benchmarks" / "prompts20.txt"
    prompts = read_prompts(prompts_file) if prompts_file else (
        read_prompts(default_prompts) if default_prompts.is_file() else ())
    options = bb.BatchBenchOptions(prompts=prompts, batches=sizes, ks=ks, adaptive=adaptive,
                                   max_new_tokens=max_new_tokens, chat=chat)
    loaded = _load_pair(pair, providers, threads, False)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("bench --batch", total=None)
        report = bb.run_batch_bench(loaded, options,
                                    lambda label: progress.update(task, description=label))
    rows = bb.rows_as_dicts(report)
    table = Table(title=f"specedge bench --batch {batches} {pair} ({len(prompts)} prompts x "
                        f"{max_new_tokens} tokens, greedy)")
    for h in ("batch", "setting", "aggregate tok/s", "vs target-only (same batch)",
              "vs batch-1 target-only", "acceptance", "mean K", "verify(B,K+1)/verify(B,1)",
              "draft step/verify(B,1)"):
        table.add_column(h)
    for r in rows:
        table.add_row(str(r["batch"]), r["setting"], f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup_vs_target_only']:.2f}x", f"{r['vs_batch1_target_only']:.2f}x",
                      f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "–",
                      f"{r['mean_k']:.2f}",
                      f"{r['verify_ratio']:.2f}" if "verify_ratio" in r else "–",
                      f"{r['draft_ratio']:.2f}" if "draft_ratio" in r else "–")
    Console(width=220).print(table)
    if json_out:
        json_out.write_text(json.dumps({"rows": rows, "costs": {
            str(r.batch): r.costs for r in report}}, indent=2))
        click.echo(f"wrote {json_out}")


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check.")
@clean_errors
def inspect(pair: Path, no_verify: bool) -> None:
    """Validate the pair folder PAIR and print its manifest summary as JSON."""
    from specedge.runtime.manifest import describe, load_manifest

    click.echo(json.dumps(describe(load_manifest(pair, verify_hashes=not no_verify)), indent=2))


if __name__ == "__main__":  # pragma: no cover
    main()
