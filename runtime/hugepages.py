"""Model weights on transparent huge pages (Linux).

Decoding reads every weight once per token, so on a CPU it streams hundreds of megabytes per
step through the TLB. ONNX Runtime keeps its (prepacked) weights in ordinary malloc memory, and
where transparent huge pages are "madvise" (the default of most distributions) that memory gets
4 KiB pages. Measured on the 2-core VM of docs/results/hugepages.md, the same SmolLM2-135M fp32
session decodes 1.4-1.6x faster once its weights sit on 2 MiB pages (nested paging makes each
TLB miss dear in a VM; bare metal gains less).

Two ways to get there, both here:

* `reexec_env`: glibc (>= 2.35) puts malloc's own memory on huge pages from the start with
  ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, read once at process start; the CLI re-executes
  itself with it (free at load time).
* `HugePageLoad`: a library caller's process did not start with it, so the memory that loading
  the models mapped, and the malloc heap, are advised (``MADV_HUGEPAGE``) and collapsed
  (``MADV_COLLAPSE``, Linux >= 6.1) after the fact: a copy, 1-4 s per GiB on that VM, once per
  load.

``SPECEDGE_HUGE_PAGES=0`` turns both off. Nothing here changes what the models compute.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
TUNABLE = "glibc.malloc.hugetlb"
ENV_SWITCH = "SPECEDGE_HUGE_PAGES"
_REEXEC_MARK = "SPECEDGE_HUGE_PAGES_REEXEC"
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def switched_off(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the user turned huge pages off (``SPECEDGE_HUGE_PAGES=0``)."""
    return environ.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "false", "no")


def thp_mode(path: Path = _THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or None where
    there is no such setting (not Linux, or a kernel without THP)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def tunable_set(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether ``GLIBC_TUNABLES`` already asks malloc for huge pages."""
    for item in environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name == TUNABLE and value.strip() not in ("", "0"):
            return True
    return False


def _glibc_version() -> tuple[int, int] | None:
    try:
        libc = ctypes.CDLL(None)
        fn = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS)
    fn.restype = ctypes.c_char_p
    major, _, minor = fn().decode().partition(".")
    try:
        return int(major), int(minor.split(".")[0])
    except ValueError:
        return None


def reexec_env(environ: dict[str, str] | os._Environ[str] = os.environ,
               mode: str | None = None, glibc: tuple[int, int] | None = None
               ) -> dict[str, str] | None:
    """The environment to re-execute this process with so that malloc uses huge pages, or None
    when that is not needed or not possible (switched off, already set, re-executed once, THP
    "always" or "never" or absent, or not glibc >= 2.35)."""
    if switched_off(environ) or tunable_set(environ) or environ.get(_REEXEC_MARK):
        return None
    if (mode or thp_mode()) != "madvise":
        return None
    version = glibc or _glibc_version()
    if version is None or version < (2, 35):
        return None
    env = dict(environ)
    current = env.get("GLIBC_TUNABLES", "")
    env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"
    env[_REEXEC_MARK] = "1"
    return env


# ----------------------------------------------------------------------- after-the-fact collapse


def anonymous_regions(maps: str, *, heap_only: bool = False) -> dict[int, int]:
    """Start → end of the writable private anonymous mappings (and the heap; only the heap with
    `heap_only`) in the text of /proc/self/maps: where malloc puts ONNX Runtime's weights."""
    regions: dict[int, int] = {}
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3:4] != "p":
            continue
        name = fields[5] if len(fields) > 5 else ""
        if name not in ("", "[heap]") or (heap_only and name != "[heap]"):
            continue
        start, _, end = fields[0].partition("-")
        regions[int(start, 16)] = int(end, 16)
    return regions


def added_ranges(before: dict[int, int], after: dict[int, int], page: int = HUGE_PAGE
                 ) -> list[tuple[int, int]]:
    """The huge-page-aligned parts of `after` that were not mapped in `before`: new mappings
    whole, grown ones (the heap) from their old end. Ranges shorter than a page are dropped."""
    ranges = []
    for start, end in sorted(after.items()):
        low = before.get(start, start)
        low = (low + page - 1) // page * page
        high = end // page * page
        if high - low >= page:
            ranges.append((low, high))
    return ranges


@dataclass(frozen=True)
class HugePageReport:
    """What a load did about huge pages (`Pair.huge_pages`)."""

    method: str  # "tunable" | "collapse" | "kernel" (THP "always") | "off" | "unavailable"
    bytes: int = 0  # memory advised and collapsed
    seconds: float = 0.0
    detail: str = ""

    def describe(self) -> str:
        if self.method == "collapse":
            return (f"{self.bytes / (1 << 20):.0f} MiB of model memory moved to huge pages in "
                    f"{self.seconds:.1f} s")
        return {"tunable": f"malloc on huge pages ({TUNABLE}=1)",
                "kernel": "transparent huge pages always on",
                "off": "4 KiB pages (huge pages off)"}.get(self.method, self.detail or self.method)


def _madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def collapse(ranges: list[tuple[int, int]]) -> tuple[int, str]:
    """Advise and collapse `ranges` onto huge pages; (bytes collapsed, first error or "")."""
    madvise = _madvise()
    if madvise is None:
        return 0, "no madvise in this C library"
    done, error = 0, ""
    for low, high in ranges:
        if madvise(low, high - low, _MADV_HUGEPAGE) != 0:
            error = error or os.strerror(ctypes.get_errno())
            continue
        if madvise(low, high - low, _MADV_COLLAPSE) == 0:
            done += high - low
        else:  # EINVAL before Linux 6.1; EAGAIN/ENOMEM when no huge page could be had
            error = error or os.strerror(ctypes.get_errno())
    return done, error


class HugePageLoad:
    """Context manager around loading models: on exit, the memory the load added goes onto
    huge pages where the process did not get them already (see the module docstring).

    ``enabled``: True / False, or None for the default (on unless ``SPECEDGE_HUGE_PAGES=0``).
    The outcome is in ``report``."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = not switched_off() if enabled is None else enabled
        self.report = HugePageReport("off")
        self._before: dict[int, int] | None = None
        self._after: dict[int, int] | None = None
        self._mode = thp_mode()

    def _maps(self) -> dict[int, int] | None:
        try:
            return anonymous_regions(Path("/proc/self/maps").read_text())
        except OSError:
            return None

    def __enter__(self) -> HugePageLoad:
        if self.enabled and self._mode == "madvise" and not tunable_set():
            self._before = self._maps()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None or not self.enabled:
            return
        if self._mode == "always":
            self.report = HugePageReport("kernel")
        elif self._mode != "madvise":
            self.report = HugePageReport("unavailable", detail=f"transparent huge pages "
                                         f"{self._mode or 'not available'}")
        elif tunable_set():
            self.report = HugePageReport("tunable")
        elif self._before is not None and (after := self._maps()) is not None:
            t0 = time.perf_counter()
            done, error = self._collapse_since(self._before, after)
            self.report = HugePageReport("collapse" if done else "unavailable", done,
                                         time.perf_counter() - t0, error)
            self._after = after if done else None
            if error:
                log.info("huge pages: %s (%s)", self.report.describe(), error)

    @staticmethod
    def _collapse_since(before: dict[int, int], after: dict[int, int]) -> tuple[int, str]:
        # What was mapped since `before`, and the whole brk heap: malloc reuses the heap's free
        # holes for weights (measured: a third of an int4 model's memory), and nothing tells
        # which of its pages were written.
        heap = anonymous_regions(Path("/proc/self/maps").read_text(), heap_only=True)
        return collapse(added_ranges({k: v for k, v in before.items() if k not in heap}, after))

    def settle(self) -> int:
        """Once, after the first generation: collapse what it mapped (ONNX Runtime's arena for
        activations, the first KV cache), measured 5% faster decoding again. Bytes collapsed."""
        before, self._after = self._after, None
        if before is None or (now := self._maps()) is None:
            return 0
        return self._collapse_since(before, now)[0]


def status(environ: dict[str, str] | os._Environ[str] = os.environ,
           mode: str | None = None) -> dict[str, Any]:
    """What this process does about huge pages, for `specedge doctor`: the kernel's mode,
    whether malloc has the tunable, and one line saying what that means and what to do."""
    mode = mode or thp_mode()
    tunable = tunable_set(environ)
    if mode is None:
        line = "no transparent huge pages here: model weights use the system's pages"
    elif mode == "always":
        line = "transparent huge pages always on: model weights use them"
    elif mode == "never":
        line = ("transparent huge pages off ('never'): weights on 4 KiB pages; as root, "
                "`echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` speeds decoding")
    elif switched_off(environ):
        line = f"off ({ENV_SWITCH}=0): weights on 4 KiB pages"
    elif tunable:
        line = f"on: malloc puts the model weights on huge pages ({TUNABLE}=1)"
    else:
        line = (f"not in this process: the specedge command re-executes itself with "
                f"GLIBC_TUNABLES={TUNABLE}=1; Python callers get the weights collapsed at load "
                "(seconds per GiB) unless they start Python with it")
    return {"thp": mode, "tunable": tunable, "status": line}
