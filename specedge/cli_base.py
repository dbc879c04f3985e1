"""What the `specedge` commands share: parameter types, the option groups parsed into frozen
dataclasses (`LoadOptions`; the generation options are `generation_options`), and rich output
(tables, stage spinners). How commands fail (one-line errors, exit codes, signals) is
`cli_errors`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from specedge.runtime.errors import InputError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from specedge.runtime.pair import Pair

F = TypeVar("F", bound=Callable[..., Any])


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
