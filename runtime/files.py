"""Files of a pair, read and written safely: paths confined to the pair folder, reads bounded
in size, sha256 of files, strict JSON out, and writes that are whole or absent.

A pair folder is untrusted input (`runtime/manifest`): `confine` refuses a relative path that
leaves it (absolute, `..`, a symlink pointing out) and `read_bounded` a file larger than its
limit. Outputs (manifests, reports) go through `write_atomic`, a temporary sibling renamed into
place, and long runs call `check_writable` first so that a full disk fails before the work.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .errors import ManifestError, OutputError


def confine(root: Path, relative: str, *, file: Path, key: str) -> Path:
    """Resolve `relative` under `root`, refusing anything that leaves the folder.

    Raises:
        ManifestError: for absolute paths, `..` components, or symlinks pointing outside.
    """
    try:
        relative.encode("utf-8")  # a lone surrogate cannot name a file
    except UnicodeEncodeError:
        raise ManifestError(
            f"{file}: key '{key}' must be a valid UTF-8 path, found {relative!r}"
        ) from None
    rel = Path(relative)
    if (not relative or "\x00" in relative or rel.is_absolute() or ".." in rel.parts
            or "\\" in relative):
        raise ManifestError(
            f"{file}: key '{key}' must be a relative path inside the pair folder, found "
            f"{relative!r}"
        )
    try:
        real_root = root.resolve()
        target = (root / rel).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, names too long
        raise ManifestError(f"{file}: key '{key}' ({relative!r}) cannot be resolved ({exc})"
                            ) from None
    if real_root != target and real_root not in target.parents:
        raise ManifestError(
            f"{file}: key '{key}' points outside the pair folder ({relative!r} resolves to "
            f"{target}); copy the file into the pair instead of linking it"
        )
    return target


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_bounded(path: Path, limit: int, error: type[Exception] = ManifestError) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (never reads more than that).

    Raises:
        `error`: the file cannot be read, is not a regular file, or is larger than `limit`.
    """
    try:
        with open(path, "rb") as fh:
            if not os.path.isfile(path):
                raise error(f"{path}: not a regular file")
            data = fh.read(limit + 1)
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{path}: larger than the {limit >> 20} MiB this file may have")
    return data


def _plain_json(value: Any) -> Any:
    """`value` with non-finite floats replaced by None: what strict JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_json(v) for v in value]
    return value


def json_dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON text (NaN and infinities become null), for files and for stdout."""
    return json.dumps(_plain_json(value), allow_nan=False, **kwargs)


def output_file(path: Path) -> Path:
    """Where a report written to `path` goes: `path` itself, or the file a symbolic link at
    `path` points to (written through, as the shell's `>` does, not replaced by a file).

    Raises:
        OutputError: `path` exists and is not a regular file (a folder, a device such as
            /dev/null, a pipe): a rename would replace it.
    """
    path = Path(path).expanduser()
    if path.is_symlink():
        path = path.resolve()
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file (a device or a pipe?)"
        raise OutputError(f"{path}: is {kind}; give the name of a file to write")
    return path


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write `path` through a temporary sibling renamed into place: the file is whole or
    absent, and a failure (full disk, read-only folder) leaves nothing behind. A link is written
    through; a folder, device or pipe is refused (`output_file`).

    Raises:
        OutputError: naming `path` and the reason.
    """
    path = output_file(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp: Path | None = None
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc}); nothing was "
                          "written") from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return path


def check_writable(folder: Path, size: int = 1 << 16, *, what: str | None = None) -> None:
    """Check, before a long run, that `size` bytes can be written in `folder` (a probe file is
    written, synced and removed), so a full or read-only disk fails first, not last.

    Raises:
        OutputError: naming `what` (default: the folder) and the reason.
    """
    name = what or str(folder)
    if not folder.is_dir():
        raise OutputError(f"{name}: the folder {folder} does not exist")
    try:
        with tempfile.TemporaryFile(dir=folder) as fh:
            block = b"\0" * min(size, 1 << 20)
            left = size
            while left > 0:
                left -= fh.write(block[:left])
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise OutputError(f"{name}: cannot write in {folder} ({exc.strerror or exc})") from None


def copy_pair(src: Path, dst: Path, *, hardlink: bool = False) -> None:
    """Copy a pair folder; `hardlink` links files instead (fast, for short-lived folders).

    Hard links are not the default: the onnx library refuses to read external data from a
    file with several links (its guard against hard-link attacks).
    """
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_dir():
            (dst / rel).mkdir(parents=True, exist_ok=True)
        elif path.is_file() and not path.is_symlink():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            if hardlink:
                try:
                    os.link(path, dst / rel)
                    continue
                except OSError:
                    pass
            shutil.copy2(path, dst / rel)
