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
    from specedge.cli import main as cli

    cli()
