"""The `specedge` executable: re-executes itself once so that malloc puts the model weights on
huge pages (see `specedge.runtime.hugepages`), then runs the click CLI.

Kept apart from `specedge.cli` so that the re-exec happens before the CLI's imports."""

from __future__ import annotations

import os
import sys


def main() -> None:
    from specedge.runtime.hugepages import reexec_env

    env = reexec_env()
    if env is not None and getattr(sys, "orig_argv", None):
        try:
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
        except OSError:
            pass  # run as we are: only slower
    try:
        from specedge.cli import main as cli
    except KeyboardInterrupt:
        # Ctrl-C while the CLI's libraries load (seconds on a busy machine): nothing has run
        # yet, so there is nothing to clean up; say so in one line, as a running command does.
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
        os._exit(130)
    cli()
