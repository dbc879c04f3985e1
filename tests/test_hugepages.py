"""Model weights on transparent huge pages: the parsers, the re-exec decision, the collapse of a
load's memory in a fresh process, and the CLI re-executing itself with the glibc tunable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specedge.runtime import hugepages as hp
from specedge.runtime.pair import Pair

MAPS = textwrap.dedent("""\
    55d0c0000000-55d0c0400000 rw-p 00000000 00:00 0                          [heap]
    7f0000000000-7f0004000000 rw-p 00000000 00:00 0
    7f0004000000-7f0004100000 r--p 00000000 00:00 0
    7f0005000000-7f0006000000 rw-s 00000000 00:05 12                         /dev/shm/x
    7f0006000000-7f0007000000 rw-p 00001000 fe:01 99                         /lib/libfoo.so
    7f0008000000-7f0008001000 rw-p 00000000 00:00 0                          [stack]
""")

ENV_NO_TUNABLE = {k: v for k, v in os.environ.items()
                  if k not in ("GLIBC_TUNABLES", hp.ENV_SWITCH, hp._REEXEC_MARK)}


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hp.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hp.thp_mode(f) == "always"
    assert hp.thp_mode(tmp_path / "absent") is None


@pytest.mark.parametrize("value, expected", [
    ("", False), ("glibc.malloc.hugetlb=1", True), ("glibc.malloc.hugetlb=2", True),
    ("glibc.malloc.hugetlb=0", False), ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", True),
    ("glibc.malloc.arena_max=2", False)])
def test_tunable_set(value: str, expected: bool) -> None:
    assert hp.tunable_set({"GLIBC_TUNABLES": value}) is expected


def test_reexec_env_adds_the_tunable_once() -> None:
    env = hp.reexec_env({"PATH": "/bin"}, mode="madvise", glibc=(2, 36))
    assert env is not None and env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert env["PATH"] == "/bin"
    # the re-executed process does not re-execute again
    assert hp.reexec_env(env, mode="madvise", glibc=(2, 36)) is None
    kept = hp.reexec_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, mode="madvise",
                         glibc=(2, 36))
    assert kept is not None
    assert kept["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("environ, mode, glibc", [
    ({hp.ENV_SWITCH: "0"}, "madvise", (2, 36)),           # switched off
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise", (2, 36)),  # already there
    ({}, "always", (2, 36)),                                # the kernel does it anyway
    ({}, "never", (2, 36)),                                 # cannot
    ({}, None, (2, 36)),                                    # no THP
    ({}, "madvise", (2, 31)),                               # glibc without the tunable
])
def test_reexec_env_none(environ: dict[str, str], mode: str | None,
                         glibc: tuple[int, int]) -> None:
    assert hp.reexec_env(environ, mode=mode or "absent", glibc=glibc) is None


def test_anonymous_regions_keeps_private_writable_anonymous_and_heap() -> None:
    regions = hp.anonymous_regions(MAPS)
    assert regions == {0x55d0c0000000: 0x55d0c0400000, 0x7f0000000000: 0x7f0004000000}
    assert hp.anonymous_regions(MAPS, heap_only=True) == {0x55d0c0000000: 0x55d0c0400000}


def test_added_ranges_new_whole_grown_from_old_end_small_dropped() -> None:
    page = hp.HUGE_PAGE
    before = {0x1000_0000: 0x1000_0000 + 3 * page + 4096}          # the heap, then grown
    after = {0x1000_0000: 0x1000_0000 + 9 * page,                   # grown by ~6 pages
             0x2000_1000: 0x2000_1000 + 4 * page,                   # new, unaligned start
             0x3000_0000: 0x3000_0000 + page // 2}                  # new but too small
    ranges = hp.added_ranges(before, after)
    assert ranges == [(0x1000_0000 + 4 * page, 0x1000_0000 + 9 * page),
                      (0x2000_0000 + page, 0x2000_0000 + 4 * page)]
    assert all(low % page == 0 and high % page == 0 for low, high in ranges)


def test_status_lines() -> None:
    assert hp.status({}, mode="always")["status"].startswith("transparent huge pages always")
    assert "echo madvise" in hp.status({}, mode="never")["status"]
    assert hp.status({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, mode="madvise")["tunable"]
    assert hp.status({hp.ENV_SWITCH: "0"}, mode="madvise")["status"].startswith("off")


def test_pair_load_reports_what_it_did(tiny_pair_dir: Path) -> None:
    assert Pair.load(tiny_pair_dir, huge_pages=False).huge_pages.method == "off"
    report = Pair.load(tiny_pair_dir).huge_pages
    assert report.method in ("tunable", "collapse", "kernel", "unavailable")
    assert report.describe()


COLLAPSE_SCRIPT = """
import json, numpy as np
from specedge.runtime import hugepages as hp
def anon_huge():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
with hp.HugePageLoad(True) as load:
    weights = np.ones(48 << 20, dtype=np.uint8)  # 48 MiB of "weights", touched
print(json.dumps({"method": load.report.method, "bytes": load.report.bytes,
                  "detail": load.report.detail, "anon_huge": anon_huge(),
                  "sum": int(weights[::4096].sum())}))
"""


@pytest.mark.skipif(hp.thp_mode() != "madvise", reason="transparent huge pages not 'madvise'")
def test_a_load_without_the_tunable_collapses_its_memory() -> None:
    out = subprocess.run([sys.executable, "-c", COLLAPSE_SCRIPT], env=ENV_NO_TUNABLE,
                         capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["sum"] == (48 << 20) // 4096  # the contents survive the move
    if r["method"] == "unavailable":
        pytest.skip(f"MADV_COLLAPSE not available here: {r['detail']}")
    assert r["method"] == "collapse"
    assert r["bytes"] >= 40 << 20
    assert r["anon_huge"] >= 40 << 20


def test_the_cli_reexecutes_with_the_tunable() -> None:
    exe = Path(sys.executable).parent / "specedge"
    if not exe.exists():
        pytest.skip("no specedge executable beside this Python")
    expected = hp.reexec_env(ENV_NO_TUNABLE) is not None
    out = subprocess.run([str(exe), "doctor", "--json"], env=ENV_NO_TUNABLE,
                         capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout)
    assert report["huge_pages"]["tunable"] is expected
    off = subprocess.run([str(exe), "doctor", "--json"], env={**ENV_NO_TUNABLE,
                                                              hp.ENV_SWITCH: "0"},
                         capture_output=True, text=True, timeout=300)
    assert json.loads(off.stdout)["huge_pages"]["tunable"] is False
