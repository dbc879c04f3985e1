"""Where a command that writes a pair writes it: the output folder checked before any work
(never an input, nor a folder holding one; replaced only with --force and only when it is a
previous pair), a staged sibling folder renamed into place at the end (so an error or a Ctrl-C
never leaves half a pair), files made readable by all, and a full or read-only disk reported in
one line. Shared by `export`, `quantize`, `draft` and `build-engine`."""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from specedge.runtime.errors import InputError, OutputError
from specedge.runtime.files import check_writable
from specedge.runtime.manifest import MANIFEST_NAME

EXPORT_MODULES = ("torch", "transformers", "onnx")
# What a full or read-only disk looks like (EFBIG: a file-size limit).
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def require_modules(command: str, modules: Sequence[str] = EXPORT_MODULES) -> None:
    """Refuse to start `command` without the [export] extra, naming what is missing.

    Raises:
        InputError: a module of `modules` cannot be imported.
    """
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    if missing:
        raise InputError(f"{command} needs the [export] extra (missing: {', '.join(missing)}): "
                         "pip install 'specedge[export]'")


def _inputs(values: Iterable[str | Path | None]) -> list[Path]:
    """The local paths among command inputs (hub ids and missing paths are not folders)."""
    out = []
    for value in values:
        if value is None:
            continue
        path = Path(value).expanduser()
        if path.exists():
            out.append(path.resolve())
    return out


def check_output(output: Path, *, force: bool, inputs: Iterable[str | Path | None]) -> Path:
    """The absolute output folder of a command that writes a pair, once it is safe to write.

    An existing non-empty folder is replaced only with `force`, only if it is a previous
    specedge output (it holds `specedge.json`), and never if it is an input or holds one (a
    parent of the source would go with it). The parent must be writable.

    Raises:
        InputError: naming the folder and what to do.
    """
    out = output.expanduser().absolute()
    real = out.resolve()
    for src in _inputs(inputs):
        if real == src or real in src.parents:
            what = "the input" if real == src else f"a folder holding the input {src}"
            raise InputError(f"{out}: is {what}; writing the output there would delete it: "
                             "choose another --output")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder; choose another --output")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise InputError(f"{out}: folder exists and is not empty; pass --force to replace "
                             "it")
        if not (out / MANIFEST_NAME).is_file():
            raise InputError(f"{out}: not a specedge output (no {MANIFEST_NAME}); --force only "
                             "replaces a previous pair folder: choose another --output or remove "
                             "the folder yourself")
    parent = out.parent
    blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise InputError(f"{out}: {blocking} is a file, not a folder; choose another --output")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{parent}: cannot create the output folder ({exc.strerror})") from None
    try:  # a probe write, not os.access: root passes that check on a read-only folder
        check_writable(parent, 0)
    except OutputError as exc:
        raise InputError(f"{exc}; choose another --output") from None
    return out


def make_readable(folder: Path) -> None:
    """Files 0644 and folders 0755 under `folder`, itself included: a pair is read by other
    users of the device (mkdtemp makes the staging folder 0700, and some writers, onnx's
    external data among them, make their files 0600). Links are left alone."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def replace_folder(staged: Path, out: Path) -> None:
    """Move the complete folder `staged` to `out`, readable by all (`make_readable`),
    replacing a previous `out` (renamed aside first, removed last: a failure in between never
    leaves `out` missing and `staged` lost)."""
    make_readable(staged)
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        try:
            staged.rename(out)
        except BaseException:
            old.rename(out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        staged.rename(out)


def disk_error(exc: OSError, out: Path) -> OutputError | None:
    """The error to show for a full or read-only disk while writing `out` (None: another
    OSError, left as it is)."""
    if exc.errno not in DISK_ERRNOS:
        return None
    return OutputError(f"{out}: cannot write the pair ({exc.strerror}); nothing was left "
                       "behind: free some space or choose another --output")


@contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A new folder beside `out` for a pair being written; it replaces `out` (`replace_folder`)
    when the block ends and is removed when it raises, so `out` is either complete or as it was.

    Raises:
        OutputError: the disk is full or read-only (nothing is left behind).
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        replace_folder(tmp, out)
    except OSError as exc:
        error = disk_error(exc, out)
        if error is None:
            raise
        raise error from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
