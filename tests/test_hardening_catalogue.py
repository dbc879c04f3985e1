"""The bad-input catalogue: every class of issue 18, run through the CLI, against four bars.

For each case a fresh "world" (a folder with copies of the tiny pairs and whatever inputs the
case needs, and a private TMPDIR) is built, the command runs, and the test checks:

- 0 tracebacks: the expected exit code, and for errors exactly one `error:` line on stderr;
- 0 hangs: each case ends within its time limit (cases that could hang or allocate without
  bound run in a child process with a timeout and an address-space cap);
- 0 data loss: every file of the world that the case does not name as its output is byte for
  byte what it was;
- 0 leftovers: no new file or folder in the world (besides the case's outputs) nor in TMPDIR.

Then hypothesis fuzzes the three input surfaces an attacker controls: text with surrogates,
declared sizes in a manifest, and chat templates. `docs/results/reliability.md` lists the
catalogue by class. Runs in well under two minutes on two cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.cli import main
from specedge.runtime import template_sandbox
from specedge.runtime.errors import InputError, SpecEdgeError
from specedge.runtime.files import sha256_file
from specedge.runtime.manifest import MANIFEST_NAME
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.text import Tokenizer

from .test_hardening import (
    BLOCK_ONNX,
    CLI,
    HOSTILE_TEMPLATES,
    _retarget_external_data,
    edit_manifest,
    rehash,
)

# ----------------------------------------------------------------------------- the world


class World:
    """A case's folder: lazily copied tiny pairs, input files, and a private TMPDIR."""

    def __init__(self, root: Path, fixtures: Path) -> None:
        self.root, self.fixtures = root, fixtures
        self.tmp = root / ".tmpdir"
        self.tmp.mkdir()
        self._pairs: dict[str, Path] = {}

    def pair(self, name: str = "tiny-llama") -> Path:
        if name not in self._pairs:
            self._pairs[name] = Path(shutil.copytree(self.fixtures / name, self.root / name))
        return self._pairs[name]

    def concat(self) -> Path:
        return self.pair("tiny-llama-concat")

    def file(self, rel: str, content: str | bytes) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8", errors="surrogatepass")
        return path

    def snapshot(self) -> dict[str, str]:
        """Every path under the world (and TMPDIR) -> a digest of its bytes or 'dir'/'link'."""
        out: dict[str, str] = {}
        for p in sorted(self.root.rglob("*")):
            rel = str(p.relative_to(self.root))
            if p.is_symlink():
                out[rel] = f"link:{os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_file():
                out[rel] = sha256_file(p)
        return out


@dataclass(frozen=True)
class Case:
    """One bad input: how to build it, how to run it, what must come out."""

    cls: str
    name: str
    setup: Callable[[World], list[Any]]  # returns the CLI arguments
    expect: str = "error"  # "error" (exit 1), "usage" (exit 2), "ok" (exit 0), or a number
    contains: str = ""  # in the error line (or in stderr for "ok")
    child: bool = False  # run in a child process (timeout, memory cap, real signals)
    stdin: bytes | str | None = None
    fsize: int | None = None  # file-size limit of the child (EFBIG: a full disk)
    outputs: tuple[str, ...] = ()  # world paths the case may create or change
    check: Callable[[World, str, str], None] | None = None  # (world, stdout, stderr)
    limit_s: float = 30.0
    prefix: list[str] = field(default_factory=list)  # interpreter code run before the CLI
    signal: int | None = None  # sent once `marker` shows on stderr (the work is under way)
    marker: str = ""


def _code_for(case: Case) -> list[str]:
    return [sys.executable, "-c", BLOCK_ONNX] if case.prefix == ["block-onnx"] else CLI


# ----------------------------------------------------------------------------- case builders


def _unlisted_template_symlink(w: World) -> list[Any]:
    p = w.pair()
    secret = w.file("secret/passwd", "root:x:0:0:SECRET\n")
    edit_manifest(p, lambda d: d["tokenizer"]["files"].pop("chat_template.jinja"))
    (p / "chat_template.jinja").unlink()
    (p / "chat_template.jinja").symlink_to(secret)
    return ["generate", p, "hi", "--chat", "--max-new-tokens", "2"]


def _listed_symlink_outside(w: World) -> list[Any]:
    p = w.pair()
    secret = w.file("secret/passwd", "root:x:0:0:SECRET\n")
    (p / "chat_template.jinja").unlink()
    (p / "chat_template.jinja").symlink_to(secret)
    edit_manifest(p, lambda d: d["tokenizer"]["files"].update(
        {"chat_template.jinja": sha256_file(secret)}))
    return ["generate", p, "hi", "--chat", "--max-new-tokens", "2"]


def _unlisted_config(w: World) -> list[Any]:
    p = w.pair()
    edit_manifest(p, lambda d: d["tokenizer"]["files"].pop("tokenizer_config.json"))
    (p / "tokenizer_config.json").write_text('{"chat_template": "EVIL", "add_bos_token": true}')
    return ["generate", p, "hi", "--max-new-tokens", "2"]


def _tampered_tokenizer_no_verify(w: World) -> list[Any]:
    p = w.pair()
    doc = json.loads((p / "tokenizer.json").read_text())
    doc["added_tokens"] = doc.get("added_tokens", [])[:1]
    (p / "tokenizer.json").write_text(json.dumps(doc))
    return ["generate", p, "hi", "--max-new-tokens", "2", "--no-verify"]


def _manifest_symlink(w: World) -> list[Any]:
    p = w.pair()
    outside = w.root / "elsewhere.json"
    shutil.move(p / MANIFEST_NAME, outside)
    (p / MANIFEST_NAME).symlink_to(outside)
    return ["inspect", p]


def _manifest_dev_zero(w: World) -> list[Any]:
    p = w.pair()
    (p / MANIFEST_NAME).unlink()
    (p / MANIFEST_NAME).symlink_to("/dev/zero")
    return ["inspect", p, "--no-verify"]


def _manifest_huge(w: World) -> list[Any]:
    p = w.pair()
    with open(p / MANIFEST_NAME, "r+b") as fh:
        fh.truncate(100 << 20)  # sparse: 100 MiB of NULs after the JSON
    return ["inspect", p, "--no-verify"]


def _external_unlisted(w: World) -> list[Any]:
    p = w.pair()
    shutil.copy(p / "target" / "model.onnx.data", p / "target" / "model.onnx.dat2")
    _retarget_external_data(p, "model.onnx.dat2")
    return ["generate", p, "hi", "--max-new-tokens", "2"]


def _external_escaping(w: World) -> list[Any]:
    p = w.pair()
    shutil.copy(p / "target" / "model.onnx.data", w.root / "secret.da")
    _retarget_external_data(p, "../../secret.da")
    return ["generate", p, "hi", "--max-new-tokens", "2"]


def _absolute_model_path(w: World) -> list[Any]:
    p = w.pair()
    edit_manifest(p, lambda d: d["models"]["target"].update(path="/etc/passwd"))
    return ["generate", p, "hi"]


def _template(name: str) -> Callable[[World], list[Any]]:
    def setup(w: World) -> list[Any]:
        p = w.pair()
        (p / "chat_template.jinja").write_text(HOSTILE_TEMPLATES[name])
        rehash(p, "chat_template.jinja")
        return ["generate", p, "hi", "--chat", "--max-new-tokens", "2"]

    return setup


def _sandbox_escape(w: World) -> list[Any]:
    p = w.pair()
    (p / "chat_template.jinja").write_text(
        "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ cycler.__init__.__globals__ }}")
    rehash(p, "chat_template.jinja")
    return ["generate", p, "hi", "--chat", "--max-new-tokens", "2"]


def _pickled_vocab_ids(w: World) -> list[Any]:
    p = w.pair()
    path = p / "draft" / "vocab_ids.npy"
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)

    def change(d: dict[str, Any]) -> None:
        d["models"]["draft"]["vocab_ids"] = "draft/vocab_ids.npy"
        d["models"]["draft"]["files"]["draft/vocab_ids.npy"] = sha256_file(path)

    edit_manifest(p, change)
    return ["generate", p, "hi", "--max-new-tokens", "2", "--drafter", "model"]


def _huge_vocab_ids_header(w: World) -> list[Any]:
    p = w.pair()
    path = p / "draft" / "vocab_ids.npy"
    header = "{'descr': '<i8', 'fortran_order': False, 'shape': (1099511627776,), }"
    header = header + " " * (117 - len(header)) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
                     + np.arange(8, dtype="<i8").tobytes())

    def change(d: dict[str, Any]) -> None:
        d["models"]["draft"]["vocab_ids"] = "draft/vocab_ids.npy"
        d["models"]["draft"]["files"]["draft/vocab_ids.npy"] = sha256_file(path)

    edit_manifest(p, change)
    return ["generate", p, "hi", "--max-new-tokens", "2"]


def _manifest_threads(w: World) -> list[Any]:
    p = w.pair()
    edit_manifest(p, lambda d: d["defaults"].update(target_threads=1000, draft_threads=1000))
    return ["generate", p, "hi", "--max-new-tokens", "2"]


def _fake_hf(w: World, rel: str) -> Path:
    w.file(f"{rel}/config.json", '{"model_type": "llama"}')
    w.file(f"{rel}/model.safetensors", b"\0" * 64)
    return w.root / rel


def _export_onto_source(w: World) -> list[Any]:
    src = _fake_hf(w, "work/model")
    return ["export", src, "-o", src, "--force"]


def _export_onto_parent(w: World) -> list[Any]:
    src = _fake_hf(w, "work/model")
    w.file("work/notes.txt", "unrelated")
    return ["export", src, "-o", w.root / "work", "--force"]


def _export_onto_other(w: World) -> list[Any]:
    src = _fake_hf(w, "work/model")
    w.file("other/keep.txt", "precious")
    return ["export", src, "-o", w.root / "other", "--force"]


def _draft_onto_source(w: World) -> list[Any]:
    src = _fake_hf(w, "work/model")
    prompts = w.file("prompts.txt", "a held-out prompt\n")
    return ["draft", src, "-o", src, "--prompts", prompts, "--force"]


def _quantize_onto(where: str) -> Callable[[World], list[Any]]:
    def setup(w: World) -> list[Any]:
        p = w.pair()
        w.file("notes.txt", "unrelated")
        out = {"pair": p, "parent": w.root, "inside": p / "target"}[where]
        return ["quantize", p, "-o", out, "--method", "int8-dynamic", "--force"]

    return setup


def _quantize_data_inside_output(w: World) -> list[Any]:
    p = w.pair()
    previous = w.pair("tiny-llama-int8")
    data = w.file("tiny-llama-int8/calibration.txt", "Some text.\n")
    return ["quantize", p, "-o", previous, "--method", "int8-minmax", "--data", data, "--force"]


def _bench_json_over_manifest(w: World) -> list[Any]:
    p = w.pair()
    return ["bench", p, "--ks", "1", "--repeats", "1", "--warmup", "0", "--max-new-tokens", "2",
            "--json", p / MANIFEST_NAME]


def _tune_full_disk(w: World) -> list[Any]:
    p = w.pair()
    prompts = w.file("prompts.txt", "Hello there\n")
    return ["tune", p, "--data", prompts, "--ks", "1", "--max-new-tokens", "4"]


def _tune_long(w: World) -> list[Any]:
    prompts = w.file("prompts.txt", "".join(f"Tell me about topic {i}.\n" for i in range(40)))
    return ["tune", w.pair(), "--data", prompts, "--ks", "1,2", "--max-new-tokens", "48"]


def _bench_full_disk(w: World) -> list[Any]:
    w.file("reports/.keep", "")
    return ["bench", w.pair(), "--ks", "1", "--repeats", "1", "--warmup", "0",
            "--max-new-tokens", "4", "--no-adaptive", "--json", w.root / "reports" / "r.json"]


def _surrogate_manifest_path(w: World) -> list[Any]:
    p = w.pair()
    text = (p / MANIFEST_NAME).read_text().replace('"target/model.onnx"', '"target/\\ud800x"', 1)
    (p / MANIFEST_NAME).write_text(text)
    return ["inspect", p]


def _huge_kv(w: World) -> list[Any]:
    p = w.pair()

    def change(d: dict[str, Any]) -> None:
        for m in d["models"].values():
            m.update(num_kv_heads=1024, head_dim=4096, max_seq_len=1 << 22)

    edit_manifest(p, change)
    return ["generate", p, "hi", "--max-new-tokens", "2"]


def _too_many_layers(w: World) -> list[Any]:
    p = w.pair()
    edit_manifest(p, lambda d: d["models"]["target"].update(num_layers=1024))
    return ["generate", p, "hi", "--max-new-tokens", "2"]


def _nested_manifest(w: World) -> list[Any]:
    p = w.pair()

    def change(d: dict[str, Any]) -> None:
        value: Any = 1
        for _ in range(600):
            value = [value]
        d["provenance"]["deep"] = value

    edit_manifest(p, change)
    return ["tune", p, "--ks", "1", "--max-new-tokens", "2"]


def _batch_rows(content: str) -> Callable[[World], list[Any]]:
    def setup(w: World) -> list[Any]:
        rows = w.file("rows.jsonl", '{"prompt": "fine"}\n' + content + "\n")
        return ["generate", w.concat(), "--batch", rows]

    return setup


def _batch_huge_prompt(w: World) -> list[Any]:
    rows = w.file("rows.jsonl", json.dumps({"prompt": "ab" * (10 << 20)}) + "\n")
    return ["generate", w.concat(), "--batch", rows]


def _inspect_nan(w: World) -> list[Any]:
    p = w.pair()
    doc = json.loads((p / MANIFEST_NAME).read_text())
    doc["models"]["target"]["validation"] = {"kl": "__NAN__", "x": "__INF__"}
    (p / MANIFEST_NAME).write_text(
        json.dumps(doc).replace('"__NAN__"', "NaN").replace('"__INF__"', "-Infinity"))
    return ["inspect", p]


def _strict_json(w: World, out: str, err: str) -> None:
    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant}")

    for line in (out.splitlines() if out.lstrip().startswith('{"') else [out]):
        json.loads(line, parse_constant=refuse)


def _wrong_head_dim(w: World) -> list[Any]:
    p = w.pair()

    def change(d: dict[str, Any]) -> None:
        for m in d["models"].values():
            m["head_dim"] = 8

    edit_manifest(p, change)
    return ["generate", p, "hi", "--max-new-tokens", "2"]


def _chat_overflow(w: World) -> list[Any]:
    return ["chat", w.pair(), "--max-new-tokens", "60"]


def _chat_answers_every_turn(w: World, out: str, err: str) -> None:
    assert out.count("> ") == 9 and "dropped the oldest" in err and "error:" not in err


def _plain(*args: Any) -> Callable[[World], list[Any]]:
    def setup(w: World) -> list[Any]:
        def arg(a: Any) -> Any:
            if isinstance(a, str) and a.startswith("PAIR/"):
                return w.pair() / a[len("PAIR/"):]
            return w.pair() if a == "PAIR" else w.concat() if a == "CONCAT" else a

        return [arg(a) for a in args]

    return setup


CASES = [
    # -- security: only listed, confined, hashed files are read; templates and threads bounded
    Case("security", "unlisted chat template symlinked to a secret", _unlisted_template_symlink,
         contains="not listed"),
    Case("security", "listed chat template symlinked outside the pair", _listed_symlink_outside,
         contains="outside the pair folder"),
    Case("security", "unlisted tokenizer_config.json", _unlisted_config, contains="not listed"),
    Case("security", "tampered tokenizer.json with --no-verify", _tampered_tokenizer_no_verify,
         contains="sha256"),
    Case("security", "manifest symlinked outside the pair", _manifest_symlink,
         contains="outside the pair folder"),
    Case("security", "manifest symlinked to /dev/zero", _manifest_dev_zero, contains="outside"),
    Case("security", "100 MiB manifest", _manifest_huge, contains="larger than", child=True),
    Case("security", "external data not listed", _external_unlisted, contains="does not list"),
    Case("security", "external data outside the pair", _external_escaping, contains="secret.da"),
    Case("security", "absolute model path", _absolute_model_path, contains="models.target.path"),
    Case("security", "template sandbox escape", _sandbox_escape, contains="chat template"),
    *[Case("security", f"hostile template: {name}", _template(name), contains="chat template",
           child=True)
      for name in ("nested ranges", "doubling", "repeat", "power", "format width", "output loop",
                   "center", "percent width")],
    Case("security", "pickled vocab_ids.npy", _pickled_vocab_ids, contains="vocab_ids.npy"),
    Case("security", "--threads 100000000", _plain("generate", "PAIR", "hi", "--threads",
                                                   "100000000"), contains="at most"),
    Case("security", "--threads 4,999", _plain("generate", "PAIR", "hi", "--threads", "4,999"),
         contains="at most"),
    Case("security", "manifest threads 1000 (clamped)", _manifest_threads, expect="ok"),
    # -- data loss: --force replaces only a previous output that is no input and holds none
    Case("data loss", "export -o the source --force", _export_onto_source, contains="input"),
    Case("data loss", "export -o a parent of the source --force", _export_onto_parent,
         contains="input"),
    Case("data loss", "export -o a folder that is no pair --force", _export_onto_other,
         contains="not a specedge output"),
    Case("data loss", "draft -o the source --force", _draft_onto_source, contains="input"),
    Case("data loss", "quantize -o the pair --force", _quantize_onto("pair"), contains="input"),
    Case("data loss", "quantize -o a parent of the pair --force", _quantize_onto("parent"),
         contains="input"),
    Case("data loss", "quantize -o a folder inside the pair --force", _quantize_onto("inside"),
         contains="not a specedge output"),
    Case("data loss", "quantize --data inside the output --force", _quantize_data_inside_output,
         contains="input"),
    Case("data loss", "bench --json over the manifest", _bench_json_over_manifest,
         contains="a file of the pair"),
    # -- leftovers: destinations checked first, writes atomic
    Case("leftovers", "tune on a full disk", _tune_full_disk, contains="cannot write",
         child=True, fsize=1024),
    Case("leftovers", "bench --json on a full disk", _bench_full_disk, contains="cannot write",
         child=True, fsize=200),
    *[Case("leftovers", f"{name} during tune", _tune_long, expect=128 + sig, child=True,
           signal=sig, marker="prompt 1/", contains=word, limit_s=60)
      for name, sig, word in (("SIGTERM", signal.SIGTERM, "terminated"),
                              ("SIGINT", signal.SIGINT, "interrupted"),
                              ("SIGHUP", signal.SIGHUP, "terminated"))],
    Case("leftovers", "bench --json into a missing folder",
         _plain("bench", "PAIR", "--json", "/nonexistent/dir/r.json"), contains="does not exist"),
    # -- crashes: invalid text, huge declared sizes, unbounded inputs
    Case("crashes", "invalid UTF-8 prompt argument",
         _plain("generate", "PAIR", b"caf\xe9 \xff", "--max-new-tokens", "2"), contains="UTF-8",
         child=True),
    Case("crashes", "invalid UTF-8 on chat's stdin", _plain("chat", "PAIR", "--max-new-tokens",
                                                            "2"),
         expect="ok", stdin=b"\xff\xfe\n", contains="UTF-8", child=True),
    Case("crashes", "lone surrogate in a batch row", _batch_rows('{"prompt": "a\\ud800"}'),
         contains="rows.jsonl:2"),
    Case("crashes", "lone surrogate in a manifest path", _surrogate_manifest_path,
         contains="UTF-8"),
    Case("crashes", "KV sizes beyond the model", _huge_kv, contains="num_kv_heads"),
    Case("crashes", "more layers than the model", _too_many_layers, contains="lacks"),
    Case("crashes", "vocab_ids.npy declaring 2^40 ids", _huge_vocab_ids_header,
         contains="vocab_ids.npy", child=True),
    Case("crashes", "manifest nested 600 deep", _nested_manifest, contains="nested"),
    Case("crashes", "--max-new-tokens 0", _plain("generate", "PAIR", "hi", "--max-new-tokens",
                                                 "0"), contains="max_new_tokens"),
    Case("crashes", "--max-new-tokens 10**12", _plain("generate", "PAIR", "hi",
                                                      "--max-new-tokens", "1000000000000"),
         contains="max_new_tokens"),
    Case("crashes", "bench --ks ''", _plain("bench", "PAIR", "--ks", ""), expect="usage"),
    Case("crashes", "bench --ks ' , '", _plain("bench", "PAIR", "--ks", " , "), expect="usage"),
    Case("crashes", "--batch /dev/zero", _plain("generate", "CONCAT", "--batch", "/dev/zero"),
         contains="/dev/zero", child=True),
    Case("crashes", "--prompts /dev/zero", _plain("bench", "PAIR", "--prompts", "/dev/zero"),
         contains="/dev/zero", child=True),
    Case("crashes", "tune --data /dev/zero", _plain("tune", "PAIR", "--data", "/dev/zero",
                                                    "--dry-run"),
         contains="/dev/zero", child=True),
    Case("crashes", "batch row with a 20 MB prompt", _batch_huge_prompt, contains="characters",
         child=True),
    Case("crashes", "prompt longer than the context",
         _plain("generate", "PAIR", "word " * 3000), contains="context"),
    Case("crashes", "chat outgrowing the context", _chat_overflow, expect="ok",
         stdin="\n".join(["Tell me a story about a robot " * 6] * 8) + "\n",
         check=_chat_answers_every_turn),
    # -- unclear or silently wrong
    Case("unclear", "batch row \"chat\": \"no\"", _batch_rows('{"prompt": "a", "chat": "no"}'),
         contains="rows.jsonl:2"),
    Case("unclear", "batch row with a string budget",
         _batch_rows('{"prompt": "a", "max_new_tokens": "5"}'), contains="rows.jsonl:2"),
    Case("unclear", "batch row too long for the context",
         _batch_rows(json.dumps({"prompt": "word " * 3000})), contains="rows.jsonl:2"),
    Case("unclear", "tune --ks ''", _plain("tune", "PAIR", "--ks", ""), expect="usage"),
    Case("unclear", "inspect with NaN validation figures", _inspect_nan, expect="ok",
         check=_strict_json),
    Case("unclear", "generate --json is strict JSON",
         _plain("generate", "PAIR", "hi", "--max-new-tokens", "3", "--json"), expect="ok",
         check=_strict_json),
    Case("unclear", "ONNX Runtime's log stays quiet", _wrong_head_dim, contains="failed to run",
         child=True),
    Case("unclear", "quantize without the [export] extra",
         _plain("quantize", "PAIR", "-o", "NEWPAIR", "--method", "int8-dynamic"),
         contains="[export]", child=True, prefix=["block-onnx"]),
    Case("unclear", "bench --ks 1,,2 (an empty item)", _plain("bench", "PAIR", "--ks", "1,,2"),
         expect="usage", contains="empty item"),
    Case("unclear", "bench --ks 0 names the value as typed", _plain("bench", "PAIR", "--ks", "0"),
         contains="got 0"),
    Case("unclear", "bench --batch 0 names the value as typed",
         _plain("bench", "CONCAT", "--batch", "0,2"), contains="got 0,2"),
    Case("unclear", "bench --max-new-tokens -3, before any progress bar",
         _plain("bench", "PAIR", "--max-new-tokens", "-3"), contains="max_new_tokens",
         child=True),  # a real stderr: rich's progress bar wrote a blank line there
    Case("unclear", "bench --batch --max-new-tokens -3",
         _plain("bench", "CONCAT", "--batch", "1", "--max-new-tokens", "-3"),
         contains="max_new_tokens"),
    Case("unclear", "--seed -1 in CLI words", _plain("generate", "PAIR", "hi", "--seed", "-1"),
         contains="or unset"),
    Case("unclear", "a file given as the pair", _plain("generate", "PAIR/specedge.json", "hi"),
         contains="is a file"),
    Case("unclear", "draft --limit 0", _plain("draft", "PAIR", "-o", "NEWPAIR", "--prompts",
                                              "PAIR/chat_template.jinja", "--limit", "0"),
         expect="usage", contains="--limit"),
    Case("unclear", "batch row \"stop\": a string, as the server takes",
         _batch_rows('{"prompt": "a", "stop": ".", "max_new_tokens": 2}'), expect="ok"),
    Case("unclear", "broken pipe", _plain("generate", "PAIR", "The quick", "--max-new-tokens",
                                          "40"),
         expect=141, child=True),
]


# ----------------------------------------------------------------------------- the runner


def _run(case: Case, world: World, args: list[Any], monkeypatch: pytest.MonkeyPatch
         ) -> tuple[int, str, str]:
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    argv = [str(world.root / "newpair") if a == "NEWPAIR" else a for a in argv]
    if not case.child:
        monkeypatch.setenv("TMPDIR", str(world.tmp))
        monkeypatch.setattr(tempfile, "tempdir", str(world.tmp))
        stdin = case.stdin.decode() if isinstance(case.stdin, bytes) else case.stdin
        result = CliRunner().invoke(main, argv, input=stdin)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise AssertionError(f"traceback: {result.exception!r}") from result.exception
        return result.exit_code, result.stdout, result.stderr

    import resource

    def limits() -> None:
        # A terminal's child starts with SIGHUP and SIGINT at their defaults; a suite run under
        # nohup, or as a background job of a script, would otherwise pass SIG_IGN on, which the
        # CLI keeps by design (nohup'ed work survives).
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        if case.fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, case.fsize))

    env = {**os.environ, "TMPDIR": str(world.tmp), "PYTHONDONTWRITEBYTECODE": "1"}
    stdin = case.stdin.encode() if isinstance(case.stdin, str) else case.stdin
    proc = subprocess.Popen([*_code_for(case), *argv], cwd=world.root, env=env,
                            preexec_fn=limits, stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL if case.signal else subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        if case.signal is not None:
            assert proc.stderr is not None
            seen = b""
            while case.marker.encode() not in seen and proc.poll() is None:
                seen += proc.stderr.read1(4096) if hasattr(proc.stderr, "read1") else b""
            proc.send_signal(case.signal)
            out, rest = proc.communicate(timeout=case.limit_s)
            err = seen + rest
        elif case.expect == 141:
            assert proc.stdout and proc.stdin and proc.stderr
            proc.stdout.close()  # the reader is gone before the first write
            proc.stdin.close()
            out, err = b"", proc.stderr.read()
            proc.wait(timeout=case.limit_s)
        else:
            out, err = proc.communicate(stdin, timeout=case.limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"hang: no exit within {case.limit_s} s") from None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


@pytest.mark.parametrize("case", CASES, ids=[f"{c.cls}: {c.name}" for c in CASES])
def test_catalogue(case: Case, fixtures_dir: Path, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "world").mkdir()
    world = World(tmp_path / "world", fixtures_dir)
    args = case.setup(world)
    before = world.snapshot()
    start = time.monotonic()
    code, out, err = _run(case, world, args, monkeypatch)
    elapsed = time.monotonic() - start
    # 0 tracebacks
    assert "Traceback" not in err and "Traceback" not in out, err
    expected = {"error": 1, "usage": 2, "ok": 0}.get(str(case.expect), case.expect)
    assert code == expected, (code, out[-500:], err[-2000:])
    if case.expect == "error":
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), err
        assert err.rstrip("\n") == lines[0], repr(err)  # no blank line before it either
        assert case.contains in lines[0], lines[0]
    elif case.expect == 141:
        assert err == "", err
    elif case.signal is not None:
        assert err.rstrip().endswith(case.contains), err[-500:]
    elif case.contains:
        assert case.contains in err, err
    if case.check is not None:
        case.check(world, out, err)
    # 0 hangs
    assert elapsed < case.limit_s, elapsed
    # 0 data loss and 0 leftovers
    after = world.snapshot()
    allowed = {str(Path(o)) for o in case.outputs}
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    changed -= {k for k in changed if any(k == a or k.startswith(a + "/") for a in allowed)}
    tmp_rel = str(world.tmp.relative_to(world.root))
    library_files = {f"{tmp_rel}/.ses"}  # a session-id file some libraries keep in TMPDIR
    assert not (changed - library_files), sorted(changed)


def test_catalogue_covers_every_class() -> None:
    classes = {c.cls for c in CASES}
    assert classes == {"security", "data loss", "leftovers", "crashes", "unclear"}
    assert len(CASES) >= 50
    # The docs count the cases: the README's total and reliability.md's total and per class.
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert f"`tests/test_hardening_catalogue.py`, {len(CASES)} bad inputs" in readme
    reliability = (root / "docs" / "results" / "reliability.md").read_text()
    assert f"the catalogue ({len(CASES)} cases in five classes" in reliability
    headings = {"security": "Security", "data loss": "Data loss", "leftovers": "Leftovers",
                "crashes": "Crashes", "unclear": "Unclear or silently wrong"}
    for cls, heading in headings.items():
        count = sum(c.cls == cls for c in CASES)
        assert re.search(rf"^### {heading}\b.*\({count}\b", reliability, re.M), (cls, count)


# ----------------------------------------------------------------------------- fuzzing

FUZZ = settings(max_examples=int(os.environ.get("SPECEDGE_FUZZ_EXAMPLES", "40")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# Text of any code point, with lone surrogates (category Cs: what undecodable bytes become)
# drawn often: hypothesis alone draws them about once in 400 strings.
_any_text = st.lists(st.one_of(st.characters(codec=None),
                               st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
                     max_size=30).map("".join)


@FUZZ
@given(prompt=_any_text, stop=st.lists(_any_text.filter(bool), max_size=2),
       chat=st.booleans())
def test_fuzz_text_with_surrogates(tiny_pair: Pair, prompt: str, stop: list[str],
                                   chat: bool) -> None:
    try:
        config = GenerationConfig(max_new_tokens=2, stop=tuple(stop), chat=chat,
                                  sampling=SamplingParams(temperature=0.7, seed=1))
        result = tiny_pair.generate(prompt, config)
    except InputError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert isinstance(result.text, str)
    result.text.encode("utf-8")  # what comes out is valid text


_SIZE_FIELDS = ["num_layers", "num_kv_heads", "head_dim", "max_seq_len", "vocab_size",
                "min_cache_len"]
_huge = st.sampled_from([0, 1, 2, 3, 15, 16, 17, 320, 1 << 12, 1 << 20, 1 << 22, (1 << 22) + 1,
                         1 << 24, 1 << 31, 1 << 40, 1 << 63, -1, 2.5, "16", None, True])


@pytest.fixture(scope="module")
def fuzz_pair(fixtures_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(shutil.copytree(fixtures_dir / "tiny-llama",
                                tmp_path_factory.mktemp("fuzz") / "pair"))


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(["target", "draft", "pair", "defaults"]),
                                  st.sampled_from(_SIZE_FIELDS + ["num_draft_tokens",
                                                                  "target_threads"]),
                                  _huge), min_size=1, max_size=3),
       new_tokens=st.integers(1, 6))
def test_fuzz_declared_sizes(fixtures_dir: Path, fuzz_pair: Path,
                             changes: list[tuple[str, str, Any]], new_tokens: int) -> None:
    doc = json.loads((fixtures_dir / "tiny-llama" / MANIFEST_NAME).read_text())
    for where, key, value in changes:
        node = (doc["models"][where] if where in ("target", "draft") else
                doc if where == "pair" else doc["defaults"])
        node[key] = value
    (fuzz_pair / MANIFEST_NAME).write_text(json.dumps(doc))
    start = time.monotonic()
    try:
        pair = Pair.load(fuzz_pair)
        pair.generate("The quick", GenerationConfig(max_new_tokens=new_tokens))
    except SpecEdgeError as exc:
        assert str(exc) and "\n" not in str(exc)
    assert time.monotonic() - start < 20


_PIECES = st.sampled_from([
    "{% for i in range(N) %}", "{% endfor %}", "{{ 'ab' * N }}", "{{ x ~ x }}",
    "{% set ns = namespace(s='xy') %}", "{% set ns.s = ns.s ~ ns.s %}", "{{ ns.s }}",
    "{{ ns.s | length }}", "{{ 2 ** N }}", "{{ N * N * N * N }}", "{{ '{:>N}'.format(1) }}",
    "{{ '%Ns' % 'a' }}", "{{ 'a' | center(N) }}", "{{ x | indent(N) }}",
    "{{ (x * 100) | replace('a', x * 100) }}", "{{ ([x] * 100) | join(x) }}",
    "{{ messages | tojson }}", "{{ messages[0]['content'] }}", "{% if true %}", "{% endif %}",
    "{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}", "{{ range(N) | list | length }}",
    "{{ lipsum(N) }}", "{{ x.__class__ }}", "{{ raise_exception('no') }}", "{{ x.upper() }}",
    "{{ x.ljust(N) }}", "{{ x.replace('a', x) }}", "{{ x.join([x] * 50) }}",
])


@FUZZ
@given(pieces=st.lists(_PIECES, min_size=1, max_size=6),
       n=st.sampled_from([1, 7, 100, 10**4, 10**5, 10**9]),
       content=_any_text)
def test_fuzz_hostile_templates(fuzz_pair: Path, monkeypatch: pytest.MonkeyPatch,
                                pieces: list[str], n: int, content: str) -> None:
    # Smaller limits than the defaults keep the run short; the same checks stop a render.
    monkeypatch.setattr(template_sandbox, "RENDER_STEPS", 50_000)
    monkeypatch.setattr(template_sandbox, "RENDER_SECONDS", 0.5)
    tok = Tokenizer.from_folder(_template_folder(fuzz_pair))
    tok._chat_template = "{% set x = 'a' * 50 %}" + "".join(pieces).replace("N", str(n))
    tok._compiled_template = None
    start = time.monotonic()
    try:
        out = tok.render_chat([{"role": "user", "content": content}])
        assert len(out) <= tok.max_chars
    except InputError as exc:
        assert str(exc) and "\n" not in str(exc)
    assert time.monotonic() - start < 3


def _template_folder(pair: Path) -> Path:
    """A plain tokenizer folder (no manifest) next to the fuzz pair, made once."""
    folder = pair.parent / "tokenizer"
    if not folder.is_dir():
        folder.mkdir()
        shutil.copy(pair / "tokenizer.json", folder / "tokenizer.json")
    return folder
