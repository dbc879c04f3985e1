"""How every `specedge` command fails and stops: one-line errors and exit codes, and signals.

Package errors become one clean line on stderr and exit 1; malformed option values are click
usage errors (exit 2). Ctrl-C exits 130, SIGTERM 143 and SIGHUP 129 after the same cleanup
(temporary folders removed, child processes ended); a closed stdout pipe (`| head`) exits 141
without a word, like other Unix tools.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar

import click

from specedge.runtime.errors import SpecEdgeError

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
