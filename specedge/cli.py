"""The `specedge` command line: a thin click group over the library functions.

Each command parses its options into the library's frozen dataclasses, calls one library
function, and prints with rich. Choices (quantization methods, precisions, graph forms,
drafters) come from the modules that implement them. Package errors become one clean line and a
non-zero exit; malformed option values are click usage errors (exit 2). Ctrl-C exits 130,
SIGTERM 143 and SIGHUP 129 after the same cleanup (temporary folders removed, child processes
ended); a closed stdout pipe (`| head`) exits 141 without a word, like other Unix tools.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from specedge.calibration.draft_search import PRECISIONS as DRAFT_PRECISIONS
from specedge.calibration.draft_search import SELF_DRAFTS
from specedge.exporter.pair import GRAPHS, PRECISIONS, PROVIDERS
from specedge.exporter.quantize import METHODS
from specedge.runtime.errors import InputError, SpecEdgeError
from specedge.runtime.manifest import DRAFTERS, json_dumps, write_atomic
from specedge.runtime.pair import DRAFTER_CHOICES

if TYPE_CHECKING:
    from rich.table import Table

    from specedge.runtime.pair import GenerationConfig, GenerationResult, Pair

F = TypeVar("F", bound=Callable[..., Any])


EXTRA_MODULES = {"torch", "transformers", "onnx", "onnxruntime_genai", "gguf", "onnxscript",
                 "onnx_ir", "safetensors", "accelerate", "sentencepiece", "huggingface_hub"}


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread so that the cleanup of Ctrl-C runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_as_interrupts() -> Iterator[None]:
    """While a command runs, SIGTERM (what `timeout` and `kill` send) and SIGHUP raise
    `Terminated` like Ctrl-C raises KeyboardInterrupt: `finally` blocks remove temporary
    folders, and `subprocess.run` kills its child on the way out. Repeats of the signal are
    ignored until the cleanup is done. Signals ignored on entry (nohup) stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        current = signal.getsignal(sig)
        if current is not signal.SIG_IGN:
            previous[sig] = current
            signal.signal(sig, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _one_line(message: str) -> str:
    """An error message as one printable line (lone surrogates escaped)."""
    text = " ".join(message.split("\n"))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _exit_quietly_on_broken_pipe() -> None:
    # The reader went away (`| head`): nothing more can be said on stdout, and Python would
    # complain when it flushes stdout at exit. Point stdout at /dev/null and leave as a
    # SIGPIPE-killed tool does.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    sys.exit(128 + signal.SIGPIPE)


def clean_errors(fn: F) -> F:
    """Turn package errors into one line on stderr and exit code 1 (2 for usage)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _signals_as_interrupts():
                result = fn(*args, **kwargs)
                sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
            return result
        except BrokenPipeError:
            _exit_quietly_on_broken_pipe()
        except SpecEdgeError as exc:
            click.echo(f"error: {_one_line(str(exc))}", err=True)
            sys.exit(1)
        except KeyboardInterrupt as exc:
            terminated = isinstance(exc, Terminated)
            click.echo("terminated" if terminated else "interrupted", err=True)
            # Cleanup already ran in the `finally` blocks on the way here. Leave now: a normal
            # interpreter shutdown can meet the interrupt again (torch and onnxruntime
            # threads) and then exits by SIGINT instead of 130.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + exc.signum if isinstance(exc, Terminated) else 130)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in EXTRA_MODULES:
                raise
            click.echo(f"error: this command needs the [export] extra (no module named "
                       f"{exc.name!r}): pip install 'specedge[export]'", err=True)
            sys.exit(1)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"error: {_one_line(where + str(exc.strerror or exc))}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


# ----------------------------------------------------------------------------- parameter types


class CommaSeparated(click.ParamType):
    """`1,2,4,8` -> `(1, 2, 4, 8)`; with `choices`, `model,ngram` -> `("model", "ngram")`."""

    def __init__(self, choices: Iterable[str] | None = None, allow_empty: bool = False) -> None:
        self.choices = tuple(choices) if choices is not None else None
        self.allow_empty = allow_empty
        self.name = "NAME,..." if self.choices else "N,N,..."

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> tuple[Any, ...]:
        if isinstance(value, tuple):
            return value
        items = [v.strip() for v in str(value).split(",")]
        if items == [""]:
            items = []
        elif "" in items:  # "1,,2" or "2,": a typo, not a list to guess at
            self.fail(f"{value!r}: an empty item; give comma-separated "
                      + ("names" if self.choices else "integers, e.g. 1,2,4"), param, ctx)
        if self.choices is None:
            try:
                ints = tuple(int(v) for v in items)
            except ValueError:
                ints = ()
            if ints or (self.allow_empty and not items):
                return ints
            self.fail(f"{value!r}: give comma-separated integers, e.g. 1,2,4", param, ctx)
        unknown = [v for v in items if v not in self.choices]
        if unknown or not (items or self.allow_empty):
            self.fail(f"{value!r}: give comma-separated names from {', '.join(self.choices)}",
                      param, ctx)
        return tuple(items)


COMMA_INTS = CommaSeparated()


# ----------------------------------------------------------------------------- shared options


def _apply(fn: F, options: Iterable[Callable[[F], F]]) -> F:
    for option in reversed(list(options)):
        fn = option(fn)
    return fn


def _collect(name: str, cls: type, options: list[Callable[[F], F]]) -> Callable[[F], F]:
    """A decorator adding `options` to a command and handing it their values as one `cls`
    instance in the keyword argument `name` (the option names are `cls`'s fields)."""
    fields = [f.name for f in dataclasses.fields(cls)]

    def decorator(fn: F) -> F:
        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {f: kwargs.pop(f) for f in fields}
            return fn(*args, **kwargs, **{name: cls(**values)})

        return _apply(cast(F, wrapper), options)

    return decorator


def max_new_tokens_option(default: int) -> Callable[[F], F]:
    return click.option("--max-new-tokens", default=default, show_default=True, type=int,
                        help="Tokens to generate per prompt.")


def ks_option(default: str, help: str) -> Callable[[F], F]:
    return click.option("--ks", default=default, show_default=True, type=COMMA_INTS, help=help)


TEMPERATURE = click.option("--temperature", default=0.0, show_default=True, type=float,
                           help="0 = greedy.")
NO_VERIFY = click.option("--no-verify", is_flag=True,
                         help="Skip the sha256 check of the model files (logged).")
FORCE = click.option("--force", is_flag=True, help="Replace an existing output folder.")


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How to load a pair: `--providers`, `--threads`, `--no-verify`."""

    providers: str = "cpu"
    threads: str | None = None
    no_verify: bool = False
    cuda_graph: bool = False
    argmax: str = "auto"
    row_steps: str = "auto"
    head: str = "split"

    def load(self, pair: Path) -> Pair:
        """Load `pair` with these providers and threads.

        Raises:
            InputError: malformed --providers or --threads (or a provider that is missing).
        """
        from specedge.runtime.pair import Pair, plan_threads

        prov = [p.strip() for p in self.providers.split(",")]
        if len(prov) not in (1, 2):
            raise InputError(f"--providers {self.providers!r}: give one provider or "
                             "TARGET,DRAFT")
        target_p, draft_p = prov[0], prov[-1]
        plan = None
        if self.threads:
            try:
                nums = [int(t) for t in self.threads.split(",")]
            except ValueError:
                raise InputError(f"--threads {self.threads!r}: give N or TARGET,DRAFT") from None
            if len(nums) not in (1, 2) or min(nums) < 0:
                raise InputError(f"--threads {self.threads!r}: give N or TARGET,DRAFT (>= 0)")
            from specedge.runtime.sessions import THREADS_PER_CORE, max_threads, physical_cores

            if max(nums) > max_threads():
                raise InputError(
                    f"--threads {self.threads!r}: at most {max_threads()} on this machine "
                    f"({THREADS_PER_CORE} x the {physical_cores()} cores this process may use; "
                    "0 picks for you)")
            plan = plan_threads(target_p, draft_p, nums[0], nums[-1])
        return Pair.load(pair, providers=(target_p, draft_p), plan=plan,
                         verify_hashes=not self.no_verify, cuda_graph=self.cuda_graph,
                         device_argmax={"auto": None, "device": True, "host": False}[self.argmax],
                         two_row_steps={"auto": None, "two": True, "one": False}[self.row_steps],
                         split_head=self.head == "split")


load_options = _collect("load", LoadOptions, [
    click.option("--providers", default="cpu", show_default=True,
                 help="Execution provider, or TARGET,DRAFT (e.g. cuda,cpu)."),
    click.option("--threads", default=None, help="Intra-op threads, or TARGET,DRAFT."),
    NO_VERIFY,
    click.option("--cuda-graph", is_flag=True,
                 help="Capture and replay CUDA graphs for the gqa-shared models on cuda (a "
                      "concat target keeps plain runs beside a gqa-shared draft)."),
    click.option("--argmax", default="auto", show_default=True,
                 type=click.Choice(["auto", "device", "host"]),
                 help="Where greedy verification takes the argmax: auto = on the device for "
                      "GPU providers, on the host for cpu."),
    click.option("--row-steps", default="auto", show_default=True,
                 type=click.Choice(["auto", "two", "one"]),
                 help="How the target runs one-token steps: two = beside the previous token, "
                      "so they compute like verification blocks and speculation is exactly "
                      "target-only decoding; auto = two when a load-time probe finds one-row "
                      "calls compute differently (int4/int8 targets); one = fastest, inexact."),
    click.option("--head", default="split", show_default=True,
                 type=click.Choice(["split", "whole"]),
                 help="split: on the CPU, greedy argmaxes from the int8 shortlist where the "
                      "exporter split the output head off (faster; the same tokens; more "
                      "memory); whole: run the whole graph (less memory)."),
])


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """The generation options shared by `generate` and `chat`."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_draft_tokens: int | None = None
    drafter: str | None = None
    no_speculation: bool = False
    adaptive: bool | None = None
    stop: tuple[str, ...] = ()

    def config(self, chat: bool) -> GenerationConfig:
        """The `GenerationConfig` (validated there: bad values raise InputError)."""
        from specedge.runtime.pair import GenerationConfig
        from specedge.runtime.sampling import SamplingParams

        sampling = SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                  top_p=self.top_p, min_p=self.min_p, seed=self.seed)
        return GenerationConfig(max_new_tokens=self.max_new_tokens, sampling=sampling,
                                num_draft_tokens=self.num_draft_tokens,
                                drafter="none" if self.no_speculation else self.drafter,
                                adaptive=self.adaptive, stop=self.stop, chat=chat)


generation_options = _collect("generation", GenerationOptions, [
    max_new_tokens_option(128),
    TEMPERATURE,
    click.option("--top-k", default=0, show_default=True, type=int, help="0 = off."),
    click.option("--top-p", default=1.0, show_default=True, type=float),
    click.option("--min-p", default=0.0, show_default=True, type=float),
    click.option("--seed", default=None, type=int, help="Seed of the sampler."),
    click.option("--num-draft-tokens", "-k", default=None, type=int,
                 help="Draft length K (default: the pair's)."),
    click.option("--drafter", default=None, type=click.Choice(DRAFTER_CHOICES)),
    click.option("--no-speculation", is_flag=True, help="Target-only decoding."),
    click.option("--adaptive/--fixed-k", default=None,
                 help="Adapt K to measured acceptance and cost (default: the pair's)."),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
])


# ----------------------------------------------------------------------------- output


def print_table(table: Table, stderr: bool = False) -> None:
    """Print a rich table without losing a character of any cell.

    On a terminal the cells fold onto more lines when the screen is narrow; anywhere else (a log,
    a pipe, CI) the table is as wide as its content, however wide that is.
    """
    from rich.console import Console

    for column in table.columns:
        column.overflow = "fold"
    console = Console(stderr=stderr)
    if not console.is_terminal:
        natural = Console(stderr=stderr, width=1 << 16).measure(table).maximum
        console = Console(stderr=stderr, width=max(console.width, natural))
    console.print(table)


def _new_table(title: str, headers: Iterable[str], rows: Iterable[Iterable[str]],
               show_header: bool = True) -> Table:
    from rich.table import Table

    table = Table(title=title, show_header=show_header)
    for header in headers:
        table.add_column(header)
    for row in rows:
        table.add_row(*row)
    return table


def _read_prompts(path: Path | None, default: tuple[str, ...]) -> tuple[str, ...]:
    from specedge.runtime.prompts import read_prompts

    return read_prompts(path) if path is not None else default


@contextmanager
def _status(message: str) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr for the running stage; the context value (a `say` for the library)
    starts the next stage. On success each stage is then listed with its time (on an error
    only the error line is printed)."""
    import time

    from rich.console import Console

    console = Console(stderr=True)
    names, starts = [message], [time.perf_counter()]

    def say(msg: str) -> None:
        names.append(msg)
        starts.append(time.perf_counter())
        spinner.update(msg)

    with console.status(message) as spinner:
        yield say
    starts.append(time.perf_counter())
    for name, start, end in zip(names, starts, starts[1:], strict=False):
        console.print(f"  {name}: {end - start:.1f} s", highlight=False)


# ----------------------------------------------------------------------------- commands


@click.group()
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
@click.option("--draft", default=None, help="Draft source (HF folder, hub id or .gguf); "
              "default: a self-draft of the target when --draft-precision is given.")
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
@click.option("--no-validate", is_flag=True, help="Skip the comparison with torch.")
@click.option("--calibrate", "calibrate_method", default=None, type=click.Choice(METHODS),
              help="Then quantize the (fp32) target with this method, as `specedge quantize`.")
@click.option("--data", "data_file", type=click.Path(path_type=Path), default=None,
              help="Calibration data for --calibrate (default: built-in sample).")
@FORCE
@clean_errors
def export(target: str, output: Path, draft: str | None, precision: str | None,
           draft_precision: str | None, provider: str, num_draft_tokens: int | None,
           chat_template: Path | None, graph: str, draft_graph: str | None, no_validate: bool,
           calibrate_method: str | None, data_file: Path | None, force: bool) -> None:
    """Export TARGET (HF folder, hub id or .gguf) and a draft into a validated pair folder.

    Without --precision, --draft-precision or --draft on cpu, it writes the fast CPU pair: an
    fp32 target, its int8 weight-only self-draft (int8-rtn) and hybrid drafting at K=5.
    """
    from specedge.exporter.pair import ExportOptions, cpu_defaults, export_pair

    picked: dict[str, Any] = {}
    note = None
    if precision is None and draft_precision is None and draft is None and provider == "cpu":
        picked, note = cpu_defaults(num_draft_tokens)
    opts = ExportOptions(**{
        "target": target, "output": output, "draft": draft, "precision": precision or "fp32",
        "draft_precision": draft_precision, "provider": provider,
        "num_draft_tokens": 3 if num_draft_tokens is None else num_draft_tokens, "force": force,
        "validate": not no_validate, "graph": None if graph == "auto" else graph,
        "draft_graph": draft_graph,
        "chat_template": chat_template, **picked})
    if calibrate_method and opts.precision != "fp32":
        raise InputError("--calibrate quantizes an fp32 target: use --precision fp32")
    with _status("exporting" + (" (cpu defaults: fp32 + int8-rtn self-draft)" if note else "")
                 ) as say:
        report = export_pair(opts, progress=say)
    if note:
        click.echo(note)
    _print_export(report)
    if calibrate_method:
        from specedge.calibration.quantize import quantize_in_place

        quality = quantize_in_place(report.folder, calibrate_method, data_file,
                                    say=lambda msg: click.echo(msg, err=True))
        click.echo(json_dumps(quality, indent=2))


def _print_export(report: Any) -> None:
    rows = []
    for name, spec in (("target", report.manifest.target), ("draft", report.manifest.draft)):
        if spec is None:
            continue
        v = spec.validation
        step, pre = v.get("step_with_past", {}), v.get("prefill", {})
        rows.append([name, spec.precision, spec.graph,
                     f"{step.get('max_abs_diff', float('nan')):.2e}",
                     f"{step.get('top1_agreement', float('nan')):.1%}",
                     f"{step.get('kl_mean', float('nan')):.2e}",
                     f"{pre.get('max_abs_diff', float('nan')):.2e}",
                     str(v.get("passed", "not validated"))])
    print_table(_new_table(f"pair written to {report.folder}",
                           ("model", "precision", "graph", "step max|Δ|", "step top-1",
                            "step KL", "prefill max|Δ|", "passed"), rows))
    validations = [s.validation for s in (report.manifest.target, report.manifest.draft)
                   if s is not None and s.validation]
    if validations:
        v = validations[0]
        click.echo(f"validated on {v.get('provider', '?')}"
                   + (f" ({v['note']})" if v.get("note") else ""))
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
@max_new_tokens_option(96)
@FORCE
@clean_errors
def draft(target: str, output: Path, prompts_file: Path, limit: int, precision: str,
          vocab_sizes: tuple[int, ...], ks: tuple[int, ...], self_drafts: tuple[str, ...],
          max_new_tokens: int, force: bool) -> None:
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
                              self_drafts=self_drafts,
                              eval_prompts=read_prompts(prompts_file)[:limit], force=force)
    with _status("draft search") as say:
        table = search(opts, say=say)
    print_table(_new_table(f"draft candidates for {target} (target only "
                           f"{table['target_only_tokens_per_s']:.1f} tok/s)", HEADERS,
                           format_rows(table)))
    w = table["winner"]
    click.echo(f"kept: {w['name']} at K={w['k']} ({w['speedup']:.2f}x) -> {output}")


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
    click.echo(json_dumps(annotate(pair, folder, which), indent=2))


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

    opts = TuneOptions(pair=pair, prompts=_read_prompts(data_file, CALIBRATION_PROMPTS),
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


def _print_stats(result: GenerationResult) -> None:
    s = result.stats
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
    print_table(_new_table("statistics", ("", ""), rows, show_header=False), stderr=True)


def _stream(loaded: Pair, prompt: Any, config: GenerationConfig) -> GenerationResult:
    """Echo the deltas of one generation as they come; returns its result."""
    gen = loaded.stream(prompt, config)
    while True:
        try:
            click.echo(next(gen), nl=False)
        except StopIteration as done:
            click.echo()
            return done.value  # type: ignore[no-any-return]


_ROW_KEYS = {"prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "min_p",
             "seed", "stop", "chat"}
_ROW_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "max_new_tokens": ((int,), "an integer"), "top_k": ((int,), "an integer"),
    "temperature": ((int, float), "a number"), "top_p": ((int, float), "a number"),
    "min_p": ((int, float), "a number"), "seed": ((int, type(None)), "an integer or null"),
    "chat": ((bool,), "true or false"),
}


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """The rows of a batch file: prompts, configs, and where each row is (`file:line`)."""

    prompts: list[Any]
    configs: list[GenerationConfig]
    where: list[str]


def _row_stop(row: dict[str, Any]) -> list[str] | None:
    """A batch row's stop strings (one string or a list, as the server's `stop`); None when
    it is neither."""
    stop = row.get("stop", [])
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        return None
    return stop


def _check_row(row: dict[str, Any], where: str) -> None:
    """Types of a batch row's fields (JSON gives any type; bool is not a number here)."""
    from specedge.runtime.text import check_text

    for key, (kinds, name) in _ROW_TYPES.items():
        if key in row and (not isinstance(row[key], kinds) or
                           (isinstance(row[key], bool) and bool not in kinds)):
            raise InputError(f"{where}: \"{key}\" must be {name}, found {row[key]!r}")
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise InputError(f"{where}: \"prompt\" must be a string")
        if not row["prompt"]:
            raise InputError(f"{where}: \"prompt\" is empty; give some text")
        check_text(row["prompt"], f"{where}: \"prompt\"")
    else:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise InputError(f"{where}: \"messages\" must be a non-empty list of "
                             "{\"role\": ..., \"content\": ...} objects with string values")
        for m in messages:
            check_text(m["content"], f"{where}: a message")
    stop = _row_stop(row)
    if stop is None:
        raise InputError(f"{where}: \"stop\" must be a string or a list of strings")
    for x in stop:
        check_text(x, f"{where}: a stop string")


def _read_batch(path: Path, base: GenerationConfig) -> BatchRows:
    """Prompts and per-row configs from a JSONL batch file (CLI options are the defaults).

    Raises:
        InputError: naming `file:line` for a malformed row.
    """
    from specedge.runtime.prompts import read_text_file
    from specedge.runtime.sampling import SamplingParams

    lines = read_text_file(path, "the batch file", "batch file").splitlines()
    rows = BatchRows([], [], [])
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise InputError(f"{where}: not a JSON object") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise InputError(f"{where}: give exactly one of \"prompt\" or \"messages\"")
        unknown = set(row) - _ROW_KEYS
        if unknown:
            raise InputError(f"{where}: unknown key(s) {sorted(unknown)}; use "
                             f"{', '.join(sorted(_ROW_KEYS))}")
        _check_row(row, where)
        s = base.sampling
        try:
            sampling = SamplingParams(
                temperature=row.get("temperature", s.temperature),
                top_k=row.get("top_k", s.top_k), top_p=row.get("top_p", s.top_p),
                min_p=row.get("min_p", s.min_p), seed=row.get("seed", s.seed))
            rows.configs.append(dataclasses.replace(
                base, sampling=sampling,
                stop=tuple(_row_stop(row) or ()) if "stop" in row else base.stop,
                max_new_tokens=row.get("max_new_tokens", base.max_new_tokens),
                chat=row.get("chat", base.chat or "messages" in row)))
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None
        rows.prompts.append(row.get("prompt", row.get("messages")))
        rows.where.append(where)
    if not rows.prompts:
        raise InputError(f"{path}: no rows in the batch file")
    return rows


def _generate_batch(loaded: Pair, batch_file: Path, config: GenerationConfig, show_stats: bool,
                    as_json: bool) -> None:
    rows = _read_batch(batch_file, config)
    for prompt, cfg, where in zip(rows.prompts, rows.configs, rows.where, strict=True):
        try:  # the row's own errors (template, length, context) name its line
            loaded.plan(cfg).check_prompt(len(loaded.encode_prompt(prompt, chat=cfg.chat)))
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None
    result = loaded.generate_batch(rows.prompts, rows.configs)
    for i, row in enumerate(result.results):
        if as_json:
            click.echo(json_dumps({"row": i, "text": row.text, "tokens": row.tokens,
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
            click.echo(json_dumps({"batch": summary}))
        else:
            click.echo(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in summary.items()), err=True)


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.argument("prompt", required=False)
@generation_options
@load_options
@click.option("--chat", is_flag=True, help="Wrap PROMPT in the chat template as a user turn.")
@click.option("--batch", "batch_file", type=click.Path(path_type=Path), default=None,
              help="JSONL file, one row per line: {\"prompt\": ...} or {\"messages\": [...]}, "
                   "with optional max_new_tokens, temperature, top_k, top_p, min_p, seed, "
                   "stop. Generates all rows as one batch (needs a --graph concat pair).")
@click.option("--stats", "show_stats", is_flag=True, help="Print statistics (to stderr).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text + stats).")
@clean_errors
def generate(pair: Path, prompt: str | None, generation: GenerationOptions, load: LoadOptions,
             chat: bool, batch_file: Path | None, show_stats: bool, as_json: bool) -> None:
    """Generate a completion of PROMPT (or of every row of --batch) with the pair PAIR."""
    if (prompt is None) == (batch_file is None):
        raise InputError("give a PROMPT or --batch FILE (one of the two)")
    config = generation.config(chat)
    loaded = load.load(pair)
    if batch_file is not None:
        _generate_batch(loaded, batch_file, config, show_stats, as_json)
        return
    assert prompt is not None
    if as_json:
        result = loaded.generate(prompt, config)
        click.echo(json_dumps({"text": result.text, "tokens": result.tokens,
                               "stop_reason": result.stop_reason,
                               "stats": result.stats.to_dict()}))
        return
    result = _stream(loaded, prompt, config)
    if show_stats:
        _print_stats(result)


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@generation_options
@load_options
@click.option("--system", default=None, help="System message.")
@click.option("--stats", "show_stats", is_flag=True, help="Print statistics after each reply.")
@clean_errors
def chat(pair: Path, generation: GenerationOptions, load: LoadOptions, system: str | None,
         show_stats: bool) -> None:
    """Chat with the pair in folder PAIR (empty line or Ctrl-D to quit).

    When the conversation outgrows the context, the oldest exchanges are dropped (and named on
    stderr); a turn that fails prints its error and the conversation goes on.
    """
    config = generation.config(False)
    loaded = load.load(pair)
    if hasattr(sys.stdin, "reconfigure"):
        # Undecodable input becomes lone surrogates, refused per turn, instead of ending the
        # chat with a UnicodeDecodeError.
        sys.stdin.reconfigure(errors="surrogateescape")
    head: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    turns: list[dict[str, str]] = []  # user, assistant, user, assistant, ...
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        try:
            kept, dropped = _fit_context(loaded, head, turns + [
                {"role": "user", "content": line}], config)
            if dropped:
                click.echo(_dropped_note(dropped, loaded.plan(config).limit), err=True)
            result = _stream(loaded, head + kept, config)
        except SpecEdgeError as exc:
            click.echo(f"error: {_one_line(str(exc))}", err=True)
            continue  # the conversation is as it was before this turn
        turns = kept + [{"role": "assistant", "content": result.text}]
        if show_stats:
            _print_stats(result)


def _fit_context(loaded: Pair, head: list[dict[str, str]], turns: list[dict[str, str]],
                 config: GenerationConfig) -> tuple[list[dict[str, str]], list[str]]:
    """The turns that fit the context with room to answer: the oldest exchanges (a user
    message and its reply) go first, the last message always stays. Returns (kept, the first
    words of each dropped exchange)."""
    limit = loaded.plan(config).limit
    room = min(config.max_new_tokens, max(1, limit // 4))
    dropped: list[str] = []
    while len(turns) > 1 and len(loaded.encode_prompt(head + turns)) + room > limit:
        dropped.append(turns[0]["content"])
        turns = turns[2:]
    return turns, dropped


def _dropped_note(dropped: list[str], limit: int) -> str:
    shown = ", ".join(repr(text[:30] + ("..." if len(text) > 30 else "")) for text in dropped)
    return _one_line(f"note: the conversation outgrew the context of {limit} tokens: dropped "
                     f"the oldest {len(dropped)} exchange(s), starting {shown}")


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
              help="Prompt file: .txt (one per line) or .jsonl ({\"prompt\": ...}); default: "
                   "three built-in prompts, or twenty with --batch.")
@max_new_tokens_option(128)
@ks_option("1,2,3,4,5,6,7,8", "Draft lengths to sweep.")
@click.option("--no-adaptive", is_flag=True, help="Skip the adaptive-K setting.")
@click.option("--drafter", default="model", show_default=True, type=click.Choice(DRAFTERS))
@click.option("--repeats", default=3, show_default=True, type=int)
@click.option("--warmup", default=1, show_default=True, type=int)
@TEMPERATURE
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
          no_adaptive: bool, drafter: str, repeats: int, warmup: int, temperature: float,
          plain: bool, load: LoadOptions, json_out: Path | None, plot_out: Path | None,
          batches: tuple[int, ...] | None) -> None:
    """Measure PAIR: target only, K sweep and adaptive K, with predicted speed-ups."""
    from rich.console import Console
    from rich.progress import Progress

    from specedge.runtime import bench as b

    for out in (json_out, plot_out):
        if out is not None:  # a full or read-only disk fails now, not after the measurements
            _check_output_file(out, pair)
    if batches is not None:
        if temperature:
            raise InputError("bench --batch measures greedy decoding (its rows are checked "
                             "token for token); drop --temperature")
        _bench_batches(pair, prompts_file, batches, ks, max_new_tokens, not no_adaptive,
                       not plain, load, json_out, drafter)
        return
    from specedge.runtime.prompts import read_categories

    options = b.BenchOptions(
        prompts=_read_prompts(prompts_file, b.DEFAULT_PROMPTS), max_new_tokens=max_new_tokens,
        ks=ks, adaptive=not no_adaptive, drafter=drafter, repeats=repeats, warmup=warmup,
        chat=not plain, temperature=temperature,
        categories=read_categories(prompts_file) if prompts_file is not None else None)
    loaded = load.load(pair)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("bench", total=b.total_generations(loaded, options))
        report = b.run_bench(loaded, options,
                             lambda label, n: progress.update(task, advance=n,
                                                              description=label))
    print_table(_new_table(f"specedge bench {pair} ({len(options.prompts)} prompts x "
                           f"{options.max_new_tokens} tokens, {options.repeats} repeats)",
                           b.HEADERS, b.format_rows(report)))
    if options.categories is not None:
        headers, rows = b.format_category_rows(report)
        print_table(_new_table("speed-up over target only, by prompt category", headers, rows))
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


def _check_output_file(path: Path, pair: Path) -> None:
    """Refuse an output file that would replace a file of the pair, is a folder, or whose
    folder is missing or cannot take a report."""
    from specedge.runtime.manifest import check_writable

    real = path.expanduser().resolve()
    if real.exists() and pair.resolve() in real.parents:
        raise InputError(f"{path}: is a file of the pair {pair}; write the report elsewhere")
    if real.is_dir():
        raise InputError(f"{path}: is a folder; give a file name")
    check_writable(path.expanduser().absolute().parent, what=str(path))


def _bench_batches(pair: Path, prompts_file: Path | None, batches: tuple[int, ...],
                   ks: tuple[int, ...], max_new_tokens: int, adaptive: bool, chat: bool,
                   load: LoadOptions, json_out: Path | None, drafter: str) -> None:
    from rich.console import Console
    from rich.progress import Progress

    from specedge.runtime import batch_bench as bb
    from specedge.runtime.prompts import default_prompts

    prompts = _read_prompts(prompts_file, default_prompts())
    options = bb.BatchBenchOptions(prompts=prompts, batches=batches, ks=ks, adaptive=adaptive,
                                   max_new_tokens=max_new_tokens, chat=chat, drafter=drafter)
    loaded = load.load(pair)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("bench --batch", total=None)
        report = bb.run_batch_bench(loaded, options,
                                    lambda label: progress.update(task, description=label))
    rows = bb.rows_as_dicts(report)
    sizes = ",".join(map(str, batches))
    print_table(_new_table(f"specedge bench --batch {sizes} {pair} ({len(prompts)} prompts x "
                           f"{max_new_tokens} tokens, greedy, {drafter} drafts)", bb.HEADERS,
                           bb.format_rows(rows)))
    if json_out:
        write_atomic(json_out, json_dumps({"drafter": drafter, "rows": rows, "costs": {
            str(r.batch): r.costs for r in report}}, indent=2) + "\n")
        click.echo(f"wrote {json_out}")


@main.command()
@click.argument("pair", type=click.Path(path_type=Path))
@NO_VERIFY
@clean_errors
def inspect(pair: Path, no_verify: bool) -> None:
    """Validate the pair folder PAIR and print its manifest summary as JSON."""
    from specedge.runtime.manifest import describe, load_manifest

    manifest = load_manifest(pair, verify_hashes=not no_verify)
    summary = dict(describe(manifest))
    template = manifest.provenance.get("chat_template")
    if not isinstance(template, dict):  # a pair written before the exporter recorded it
        template = {"source": "unknown" if "chat_template.jinja" in manifest.tokenizer_files
                    else "none"}
    summary["chat_template"] = template
    click.echo(json_dumps(summary, indent=2))


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
    from specedge.exporter.pair import require_modules
    from specedge.exporter.split_head import split_pair_heads

    require_modules("split-head", ("onnx",))
    done = split_pair_heads(pair, force=force, say=lambda msg: click.echo(msg, err=True))
    for name, split in done.items():
        click.echo(f"{name}: {'head split' if split else 'head kept in the graph'}")


def _register_commands() -> None:
    """Commands that live in their own modules (they import this one lazily)."""
    from specedge.doctor_cli import doctor
    from specedge.engine_cli import build_engine
    from specedge.serve_cli import serve

    main.add_command(doctor)
    main.add_command(build_engine)
    main.add_command(serve)


_register_commands()


if __name__ == "__main__":  # pragma: no cover
    main()
