"""What the `specedge` commands share: one-line errors and exit codes, signal handling,
parameter types, the option groups parsed into frozen dataclasses (`LoadOptions`; the
generation options are `generation_options`), and rich output (tables, stage spinners).

Package errors become one clean line on stderr and exit 1; malformed option values are click
usage errors (exit 2). Ctrl-C exits 130, SIGTERM 143 and SIGHUP 129 after the same cleanup
(temporary folders removed, child processes ended); a closed stdout pipe (`| head`) exits 141
without a word, like other Unix tools.
"""

from __future__ import annotations

import dataclasses
import json
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

from specedge.runtime.errors import InputError, SpecEdgeError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from specedge.runtime.pair import Pair

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


def one_line(message: str) -> str:
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
                if sys.stdout is not None:  # None: started with stdout closed (`>&-`)
                    sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
            return result
        except BrokenPipeError:
            _exit_quietly_on_broken_pipe()
        except SpecEdgeError as exc:
            click.echo(f"error: {one_line(str(exc))}", err=True)
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
            click.echo(f"error: {one_line(where + str(exc.strerror or exc))}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


class _OneLineUsageError(click.UsageError):
    """A usage error shown as one `error:` line with the help hint, like every other error."""

    def show(self, file: Any = None) -> None:
        hint = f" Try '{self.ctx.command_path} --help'." if self.ctx is not None else ""
        click.echo(f"error: {one_line(' '.join(self.message.split()))}{hint}", err=True)


@contextmanager
def _one_line_usage() -> Iterator[None]:
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise  # `specedge` alone prints the help
    except click.UsageError as exc:
        if isinstance(exc, _OneLineUsageError):
            raise
        raise _OneLineUsageError(exc.format_message(), exc.ctx) from None


class OneLineErrors(click.Group):
    """The CLI's group: click's own usage errors (a missing argument, an unknown option, a bad
    choice) print one `error:` line and exit 2, instead of click's usage block."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().main(*args, **kwargs)
        except OSError as exc:  # click's --help or --version on a full disk or a closed stdout
            click.echo(f"error: cannot write the output ({one_line(str(exc.strerror or exc))})",
                       err=True)
            sys.exit(1)

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        with _one_line_usage():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _one_line_usage():
            return super().invoke(ctx)


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


def collect_options(name: str, cls: type, options: list[Callable[[F], F]]) -> Callable[[F], F]:
    """A decorator adding `options` to a command and handing it their values as one `cls`
    instance in the keyword argument `name` (the option names are `cls`'s fields; a field no
    option of the command sets keeps its default, and a command may add an option for one)."""
    fields = [f.name for f in dataclasses.fields(cls)]

    def decorator(fn: F) -> F:
        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {f: kwargs.pop(f) for f in fields if f in kwargs}
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
TOP_K = click.option("--top-k", default=0, show_default=True, type=int,
                     help="0 = off (with --temperature > 0).")
TOP_P = click.option("--top-p", default=1.0, show_default=True, type=float,
                     help="Nucleus; 1 = off (with --temperature > 0).")
MIN_P = click.option("--min-p", default=0.0, show_default=True, type=float,
                     help="0 = off (with --temperature > 0).")
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
    prefix_cache: int = 0  # `chat` and `serve`: finished generations whose caches are kept
    chat_template_kwargs: str | None = None  # JSON: the chat template's extra variables

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
        variables = template_kwargs_option(self.chat_template_kwargs)  # before the load
        loaded = Pair.load(pair, providers=(target_p, draft_p), plan=plan,
                           verify_hashes=not self.no_verify, cuda_graph=self.cuda_graph,
                           device_argmax={"auto": None, "device": True,
                                          "host": False}[self.argmax],
                           two_row_steps={"auto": None, "two": True, "one": False}[self.row_steps],
                           split_head=self.head == "split", prefix_cache=self.prefix_cache)
        loaded.template_variables = variables
        return loaded


CHAT_TEMPLATE_KWARGS_HELP = ("Chat template variables as a JSON object, e.g. "
                             "'{\"enable_thinking\": false}' (Qwen3 and SmolLM3 then answer "
                             "without thinking).")


def template_kwargs_option(text: str | None) -> dict[str, Any]:
    """--chat-template-kwargs as checked template variables ({} when not given).

    Raises:
        InputError: not a JSON object of template variables.
    """
    from specedge.runtime.chat_template import template_variables
    from specedge.runtime.errors import FieldError

    if text is None:
        return {}
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise InputError("--chat-template-kwargs: not JSON; give an object, e.g. "
                         "'{\"enable_thinking\": false}'") from None
    try:
        return template_variables(value, "--chat-template-kwargs")
    except FieldError as exc:
        raise InputError(f"{exc.param}: {exc}") from None


PREFIX_CACHE_HELP = ("Keep the KV caches of this many finished generations, so that a prompt "
                     "that starts like an earlier one (the next turn of a conversation) "
                     "prefills only the new tokens; the output is the same token for token "
                     "(0: keep none; each costs its caches' memory).")

load_options = collect_options("load", LoadOptions, [
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
    click.option("--chat-template-kwargs", default=None, metavar="JSON",
                 help=CHAT_TEMPLATE_KWARGS_HELP),
])


# ----------------------------------------------------------------------------- output


def print_table(table: Table, stderr: bool = False) -> None:
    """Print a rich table without losing a character of any cell.

    On a terminal the cells fold onto more lines when the screen is narrow; anywhere else (a log,
    a pipe, CI) the table is as wide as its content, however wide that is.
    """
    for column in table.columns:
        column.overflow = "fold"
    console = rich_console(stderr=stderr)
    if not console.is_terminal:
        natural = rich_console(stderr=stderr, width=1 << 16).measure(table).maximum
        console = rich_console(stderr=stderr, width=max(console.width, natural))
    console.print(table)


def rich_console(**kwargs: Any) -> Console:
    """A rich Console whose closed pipe (`| head`) ends the command as `clean_errors` ends any
    other (quietly, exit 141), not with rich's own exit code 1."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return _Console(**kwargs)


def new_table(title: str, headers: Iterable[str], rows: Iterable[Iterable[str]],
               show_header: bool = True) -> Table:
    from rich.table import Table

    table = Table(title=title, show_header=show_header)
    for header in headers:
        table.add_column(header)
    for row in rows:
        table.add_row(*row)
    return table


def read_prompt_file(path: Path | None, default: tuple[str, ...]) -> tuple[str, ...]:
    from specedge.runtime.prompts import read_prompts

    return read_prompts(path) if path is not None else default


@contextmanager
def stage_status(message: str) -> Iterator[Callable[[str], None]]:
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
