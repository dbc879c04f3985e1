"""`specedge bench`: measure a pair (target-only, a K sweep and adaptive K, with predicted
speed-ups), or with `--batch` its batched decoding. Registered in the `specedge` group by
`specedge/cli.py`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from specedge.cli_base import (
    COMMA_INTS,
    MIN_P,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    LoadOptions,
    ks_option,
    load_options,
    max_new_tokens_option,
    new_table,
    print_table,
    read_prompt_file,
)
from specedge.cli_errors import clean_errors
from specedge.runtime.errors import InputError
from specedge.runtime.files import json_dumps, write_atomic
from specedge.runtime.manifest import DRAFTERS

if TYPE_CHECKING:
    from specedge.runtime.sampling import SamplingParams


@click.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
              help="Prompt file: .txt (one per line) or .jsonl ({\"prompt\": ...}); default: "
                   "three built-in prompts, or twenty with --batch.")
@max_new_tokens_option(128)
@ks_option("1,2,3,4,5,6,7,8", "Draft lengths to sweep.")
@click.option("--no-adaptive", is_flag=True, help="Skip the adaptive-K setting.")
@click.option("--drafter", default=None, type=click.Choice(DRAFTERS),
              help="What drafts: the draft model, n-gram prompt lookup or both (default: the "
                   "pair's draft model, or n-gram lookup for a pair without one).")
@click.option("--repeats", default=3, show_default=True, type=int)
@click.option("--warmup", default=1, show_default=True, type=int)
@TEMPERATURE
@TOP_K
@TOP_P
@MIN_P
@click.option("--plain", is_flag=True, help="Plain prompts (no chat template).")
@load_options
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None,
              help="Write the full report as JSON.")
@click.option("--plot", "plot_out", type=click.Path(path_type=Path), default=None,
              help="Write a PNG of tokens/s and acceptance against K (needs matplotlib).")
@click.option("--batch", "batches", default=None, type=COMMA_INTS,
              help="Batch sizes, e.g. 1,2,4,8: aggregate tokens/s of batched target-only and "
                   "speculative decoding (greedy; needs a --graph concat pair).")
@clean_errors
def bench(pair: Path, prompts_file: Path | None, max_new_tokens: int, ks: tuple[int, ...],
          no_adaptive: bool, drafter: str | None, repeats: int, warmup: int, temperature: float,
          top_k: int, top_p: float, min_p: float, plain: bool, load: LoadOptions,
          json_out: Path | None, plot_out: Path | None,
          batches: tuple[int, ...] | None) -> None:
    """Measure PAIR: target only, K sweep and adaptive K, with predicted speed-ups."""
    from rich.console import Console
    from rich.progress import Progress

    from specedge.runtime import bench as b

    outputs = [out for out in (json_out, plot_out) if out is not None]
    for out in outputs:  # a full or read-only disk fails now, not after the measurements
        _check_output_file(out, pair, prompts_file)
    if len(outputs) == 2 and _same_file(json_out, plot_out):
        raise InputError(f"--json and --plot both name {json_out}; give two files")
    if batches is not None:
        if temperature or top_k or top_p != 1.0 or min_p:
            raise InputError("bench --batch measures greedy decoding (its rows are checked "
                             "token for token); drop --temperature, --top-k, --top-p and "
                             "--min-p")
        _bench_batches(pair, prompts_file, batches, ks, max_new_tokens, not no_adaptive,
                       not plain, load, json_out, drafter)
        return
    from specedge.runtime.prompts import read_categories

    options = b.BenchOptions(
        prompts=read_prompt_file(prompts_file, b.DEFAULT_PROMPTS), max_new_tokens=max_new_tokens,
        ks=ks, adaptive=not no_adaptive, drafter=drafter, repeats=repeats, warmup=warmup,
        chat=not plain, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        categories=read_categories(prompts_file) if prompts_file is not None else None)
    loaded = load.load(pair)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("bench", total=b.total_generations(loaded, options))
        report = b.run_bench(loaded, options,
                             lambda label, n: progress.update(task, advance=n,
                                                              description=label))
    print_table(new_table(f"specedge bench {pair} ({len(options.prompts)} prompts x "
                          f"{options.max_new_tokens} tokens, {options.repeats} repeats, "
                          f"{_sampling_note(options.sampling())})",
                          b.HEADERS, b.format_rows(report)))
    if options.categories is not None:
        headers, rows = b.format_category_rows(report)
        print_table(new_table("speed-up over target only, by prompt category", headers, rows))
    c = report.costs
    click.echo(f"weights: {loaded.huge_pages.describe()}")
    click.echo(f"target: {loaded.target.steps_note()}")
    click.echo(f"target call: {1000 * c.target[1]:.2f} ms for 1 token at a past of "
               f"{c.past_len}; draft step: "
               + (f"{1000 * c.draft_step:.2f} ms ({c.draft_step / c.target[1]:.2f} of the "
                  "target)" if c.draft_step else "no draft model"))
    if json_out:
        write_atomic(json_out, json_dumps(report.to_json(), indent=2) + "\n")
        click.echo(f"wrote {json_out}")
    if plot_out:
        written = b.plot(report, plot_out)
        click.echo(f"wrote {written}" if written else "matplotlib is not installed: no plot")


def _sampling_note(params: SamplingParams) -> str:
    """How the settings decode, for the table's title: greedy, or the sampling knobs set."""
    if params.greedy:
        return "greedy"
    knobs = [f"temperature {params.temperature:g}"]
    knobs += [f"top-k {params.top_k}"] if params.top_k else []
    knobs += [f"top-p {params.top_p:g}"] if params.top_p < 1 else []
    knobs += [f"min-p {params.min_p:g}"] if params.min_p else []
    return ", ".join(knobs) + f", seed {params.seed}"


def _same_file(a: Path | None, b: Path | None) -> bool:
    return a is not None and b is not None and (
        a.expanduser().resolve() == b.expanduser().resolve())


def _check_output_file(path: Path, pair: Path, prompts_file: Path | None) -> None:
    """Refuse an output file that would replace a file of the pair or the prompts, is not a
    regular file (a folder, /dev/null, a pipe), or whose folder is missing or cannot take a
    report."""
    from specedge.runtime.files import check_writable, output_file

    real = output_file(path).resolve()
    if real.exists() and pair.resolve() in real.parents:
        raise InputError(f"{path}: is a file of the pair {pair}; write the report elsewhere")
    if _same_file(path, prompts_file):
        raise InputError(f"{path}: is the --prompts file; write the report elsewhere")
    check_writable(real.parent, what=str(path))


def _bench_batches(pair: Path, prompts_file: Path | None, batches: tuple[int, ...],
                   ks: tuple[int, ...], max_new_tokens: int, adaptive: bool, chat: bool,
                   load: LoadOptions, json_out: Path | None, drafter: str | None) -> None:
    from rich.console import Console
    from rich.progress import Progress

    from specedge.runtime import batch_bench as bb
    from specedge.runtime.bench import bench_drafter
    from specedge.runtime.prompts import default_prompts

    prompts = read_prompt_file(prompts_file, default_prompts())
    options = bb.BatchBenchOptions(prompts=prompts, batches=batches, ks=ks, adaptive=adaptive,
                                   max_new_tokens=max_new_tokens, chat=chat, drafter=drafter)
    loaded = load.load(pair)
    drafter = bench_drafter(loaded, drafter)  # fails before measuring anything
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("bench --batch", total=None)
        report = bb.run_batch_bench(loaded, options,
                                    lambda label: progress.update(task, description=label))
    rows = bb.rows_as_dicts(report)
    sizes = ",".join(map(str, batches))
    print_table(new_table(f"specedge bench --batch {sizes} {pair} ({len(prompts)} prompts x "
                           f"{max_new_tokens} tokens, greedy, {drafter} drafts)", bb.HEADERS,
                           bb.format_rows(rows)))
    if json_out:
        write_atomic(json_out, json_dumps({"drafter": drafter, "rows": rows, "costs": {
            str(r.batch): r.costs for r in report}}, indent=2) + "\n")
        click.echo(f"wrote {json_out}")
