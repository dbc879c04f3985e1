"""Issue 18 ("Hardening, round two"): one regression test (or a few) per item.

Each test names its item. Cases that could hang, abort or eat memory before their fix run in a
child process with a timeout and resource limits, so a regression fails the test instead of the
test run. The bad-input catalogue over every class is in `test_hardening_catalogue.py`.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

from specedge.cli import main
from specedge.runtime.errors import InputError, ManifestError, ModelError, SpecEdgeError
from specedge.runtime.files import sha256_file
from specedge.runtime.manifest import MANIFEST_NAME, load_manifest, parse_manifest
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.text import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "specedge.cli"]
HAS_ONNX = importlib.util.find_spec("onnx") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def invoke(runner: CliRunner, *args: Any, input: str | None = None) -> Result:
    return runner.invoke(main, [str(a) for a in args], input=input)


def clean_error(result: Result, contains: str = "") -> str:
    """Non-zero exit, one 'error:' line on stderr, no traceback; returns that line."""
    assert result.exit_code not in (0, None), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception))
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert contains in lines[0], lines[0]
    return lines[0]


def run_cli(args: Sequence[Any], *, timeout: float = 60, input: bytes | None = None,
            cwd: Path | None = None, env: dict[str, str] | None = None,
            fsize: int | None = None, memory: int = 3 << 30) -> subprocess.CompletedProcess[str]:
    """`specedge ARGS` in a child process with an address-space cap (a bug that allocates
    without limit fails fast) and optionally a file-size cap (EFBIG stands for a full disk)."""

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes fail with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    argv = [*CLI, *(a if isinstance(a, bytes) else str(a) for a in args)]
    full_env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    proc = subprocess.run(argv, input=input, capture_output=True, timeout=timeout, cwd=cwd,
                          env=full_env, preexec_fn=limits, check=False)
    return subprocess.CompletedProcess(argv, proc.returncode, proc.stdout.decode(errors="replace"),
                                       proc.stderr.decode(errors="replace"))


def one_error_line(proc: subprocess.CompletedProcess[str], contains: str = "") -> str:
    assert proc.returncode not in (0, None), (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    assert contains in errors[0], errors[0]
    return errors[0]


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256): for 'nothing was lost' checks."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def copy_pair(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_manifest(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = root / MANIFEST_NAME
    doc = json.loads(path.read_text(encoding="utf-8"))
    change(doc)
    path.write_text(json.dumps(doc), encoding="utf-8")


def rehash(root: Path, rel: str) -> None:
    """Update the manifest's sha256 of `rel` (wherever it is listed) after editing the file."""

    def change(doc: dict[str, Any]) -> None:
        for files in [doc["tokenizer"]["files"]] + [m["files"] for m in doc["models"].values()]:
            if rel in files:
                files[rel] = sha256_file(root / rel)

    edit_manifest(root, change)


@pytest.fixture
def pair_copy(tiny_pair_dir: Path, tmp_path: Path) -> Path:
    return copy_pair(tiny_pair_dir, tmp_path / "pair")


# ============================================================================= security


def test_item01_unlisted_chat_template_symlink_is_not_read(pair_copy: Path,
                                                           tmp_path: Path) -> None:
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:SECRET:/root:/bin/sh\n")
    edit_manifest(pair_copy, lambda d: d["tokenizer"]["files"].pop("chat_template.jinja"))
    (pair_copy / "chat_template.jinja").unlink()
    (pair_copy / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(ManifestError, match="chat_template.jinja.*not listed"):
        Pair.load(pair_copy)


def test_item01_unlisted_tokenizer_config_is_not_read(pair_copy: Path) -> None:
    edit_manifest(pair_copy, lambda d: d["tokenizer"]["files"].pop("tokenizer_config.json"))
    (pair_copy / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_end|>", "add_bos_token": True, "chat_template": "EVIL"}))
    with pytest.raises(ManifestError, match="tokenizer_config.json.*not listed"):
        Pair.load(pair_copy)


def test_item01_tokenizer_files_are_hashed_as_read(pair_copy: Path) -> None:
    # Even with --no-verify (which skips hashing the model files) a tokenizer file is only
    # used if the bytes read match the manifest: it is read once, hashed and parsed from memory.
    (pair_copy / "chat_template.jinja").write_text("{{ 'tampered' }}")
    with pytest.raises(ManifestError, match="chat_template.jinja.*sha256"):
        Pair.load(pair_copy, verify_hashes=False)


def test_item01_listed_files_load_without_a_manifest_reread(tiny_pair_dir: Path) -> None:
    tok = Tokenizer.from_folder(tiny_pair_dir)  # a pair folder: reads only what is listed
    assert tok.has_chat_template
    assert tok.render_chat([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user")


def test_item01_manifest_symlink_leaving_the_folder(pair_copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.json"
    shutil.move(pair_copy / MANIFEST_NAME, outside)
    (pair_copy / MANIFEST_NAME).symlink_to(outside)
    with pytest.raises(ManifestError, match="outside the pair folder"):
        load_manifest(pair_copy)


def _retarget_external_data(pair: Path, new_location: str) -> None:
    """Point target/model.onnx's external data at `new_location` (same length, so the protobuf
    stays valid) and re-hash model.onnx: the manifest lists model.onnx and model.onnx.data."""
    model = pair / "target" / "model.onnx"
    raw = model.read_bytes()
    old = b"model.onnx.data"
    assert len(new_location) == len(old) and old in raw
    model.write_bytes(raw.replace(old, new_location.encode()))
    rehash(pair, "target/model.onnx")


def test_item01_unlisted_external_data_is_refused(pair_copy: Path) -> None:
    shutil.copy(pair_copy / "target" / "model.onnx.data", pair_copy / "target" / "model.onnx.dat2")
    _retarget_external_data(pair_copy, "model.onnx.dat2")
    with pytest.raises(ManifestError, match="model.onnx.dat2.*not list"):
        Pair.load(pair_copy)


def test_item01_external_data_outside_the_pair_is_refused(pair_copy: Path,
                                                          tmp_path: Path) -> None:
    shutil.copy(pair_copy / "target" / "model.onnx.data", tmp_path / "secret.da")
    _retarget_external_data(pair_copy, "../../secret.da")
    with pytest.raises(ManifestError, match="secret.da"):
        Pair.load(pair_copy)


HOSTILE_TEMPLATES = {
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}"
                     "{% endfor %}{% endfor %}x",
    "nested loops over a list": "{% set r = range(100000) | list %}{% for i in r %}"
                                "{% for j in r %}{% endfor %}{% endfor %}x",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(26) %}"
                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "doubling by +": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                     "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "repeat": "{{ 'a' * 1000000000 }}",
    "list repeat": "{{ ([1] * 1000000000) | length }}",
    "power": "{{ 2 ** 100000000 }}",
    "center": "{{ 'a' | center(1000000000) }}",
    "format width": "{{ '{:>1000000000}'.format('a') }}",
    "percent width": "{{ '%1000000000s' % 'a' }}",
    "indent": "{% set ns = namespace(s='\n') %}{% for i in range(17) %}"
              "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | indent(100000) | length }}",
    "join": "{% set big = 'x' * 60000 %}{{ ([big] * 100000) | join }}",
    "output loop": "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}",
    "macro recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_item02_templates_are_bounded(tiny_pair_dir: Path, tmp_path: Path, name: str) -> None:
    pair = copy_pair(tiny_pair_dir, tmp_path / "pair")
    (pair / "chat_template.jinja").write_text(HOSTILE_TEMPLATES[name])
    rehash(pair, "chat_template.jinja")
    start = time.monotonic()
    proc = run_cli(["generate", pair, "hi", "--chat", "--max-new-tokens", "2"], timeout=40)
    elapsed = time.monotonic() - start
    one_error_line(proc, "chat template")
    assert elapsed < 15, elapsed  # process start-up + a render bounded to ~1 s


def test_item02_render_limits_in_process(tiny_pair_dir: Path) -> None:
    tok = Tokenizer.from_folder(tiny_pair_dir)
    for name in ("nested ranges", "doubling", "power", "format width", "join"):
        tok._chat_template, tok._compiled_template = HOSTILE_TEMPLATES[name], None
        start = time.monotonic()
        with pytest.raises(InputError, match="chat template"):
            tok.render_chat([{"role": "user", "content": "hi"}])
        assert time.monotonic() - start < 3, name


def test_item02_huge_prompt_is_refused_before_the_tokenizer(tiny_pair_dir: Path) -> None:
    code = ("from specedge.runtime.pair import Pair\n"
            "from specedge.runtime.errors import InputError\n"
            f"p = Pair.load({str(tiny_pair_dir)!r})\n"
            "try:\n    p.encode_prompt('ab' * (1 << 26))\n"
            "except InputError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "characters" in proc.stdout


def test_item03_threads_option_is_capped(tiny_pair_dir: Path) -> None:
    for value in ("100000000", "999", "2,100000"):
        proc = run_cli(["generate", tiny_pair_dir, "hi", "--max-new-tokens", "2",
                        "--threads", value], timeout=30)
        one_error_line(proc, "--threads")
        assert "at most" in proc.stderr


def test_item03_manifest_threads_are_clamped(pair_copy: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    from specedge.runtime.sessions import max_threads

    edit_manifest(pair_copy, lambda d: d["defaults"].update(target_threads=1000,
                                                            draft_threads=1000))
    with caplog.at_level(logging.WARNING):
        pair = Pair.load(pair_copy)
    assert pair.target.config.intra_op_threads <= max_threads()
    assert pair.draft is not None and pair.draft.config.intra_op_threads <= max_threads()
    assert "threads" in caplog.text
    assert len(pair.generate("hi", GenerationConfig(max_new_tokens=2)).tokens) >= 1


# ============================================================================= data loss


def _fake_hf(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    return folder


@pytest.mark.parametrize("case", ["output is the source", "output is a parent of the source",
                                  "output is not a specedge folder"])
def test_item04_export_force_never_deletes_its_input(runner: CliRunner, tmp_path: Path,
                                                     case: str) -> None:
    work = tmp_path / "work"
    src = _fake_hf(work / "model")
    (work / "notes.txt").write_text("unrelated")
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    out = {"output is the source": src, "output is a parent of the source": work,
           "output is not a specedge folder": other}[case]
    before = tree_digest(tmp_path)
    result = invoke(runner, "export", src, "-o", out, "--force")
    clean_error(result, str(out))
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("case", ["output is the pair", "output is a parent of the pair",
                                  "output is inside the pair"])
def test_item05_quantize_force_never_deletes_its_input(runner: CliRunner, tiny_pair_dir: Path,
                                                       tmp_path: Path, case: str) -> None:
    work = tmp_path / "work"
    pair = copy_pair(tiny_pair_dir, work / "pair")
    (work / "notes.txt").write_text("unrelated")
    out = {"output is the pair": pair, "output is a parent of the pair": work,
           "output is inside the pair": pair / "target"}[case]
    before = tree_digest(tmp_path)
    result = invoke(runner, "quantize", pair, "-o", out, "--method", "int8-dynamic", "--force")
    clean_error(result, str(out))
    assert tree_digest(tmp_path) == before


def test_item05_force_replaces_a_previous_output(tiny_pair_dir: Path, tmp_path: Path) -> None:
    from specedge.exporter.output import check_output

    previous = copy_pair(tiny_pair_dir, tmp_path / "previous")
    assert check_output(previous, force=True, inputs=[tmp_path / "src"]) == previous
    with pytest.raises(InputError, match="--force"):
        check_output(previous, force=False, inputs=[])


# ============================================================================= leftovers


def _descendants(session: int) -> list[int]:
    """Processes of the session `session` (the child runs in its own session)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # sid, not a zombie
            out.append(int(stat.parent.name))
    return out


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.export
@pytest.mark.skipif(not HAS_TORCH, reason="needs [export]")
def test_item06_sigterm_during_export_leaves_nothing(tmp_path: Path) -> None:
    from specedge.exporter.tiny import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf", seed=5)
    out = tmp_path / "outdir" / "pair"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([*CLI, "export", str(hf), "-o", str(out), "--draft-precision",
                             "int4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not _children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is not None:
            pytest.skip("the export ended before its model builder started")
        proc.send_signal(signal.SIGTERM)  # to the CLI alone, as `kill PID` does
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, (proc.returncode, err)
        assert "Traceback" not in err and "terminated" in err
        time.sleep(0.5)
        assert _descendants(proc.pid) == [], "a child process outlived the CLI"
        assert not out.exists()
        assert not out.parent.exists() or list(out.parent.iterdir()) == []
        # (a library of the export stack keeps a small session-id file in TMPDIR: not ours)
        assert [p for p in tmp.iterdir() if p.is_dir()] == [], "temporary folders left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_item06_sigterm_during_generate(reference_pair_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen([*CLI, "generate", str(reference_pair_dir), "Tell me a long story.",
                             "--chat", "--max-new-tokens", "4000"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = proc.stdout.read(1)  # generation has started: the handler is in place
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert first and proc.returncode == 143, (proc.returncode, err)
    assert b"Traceback" not in err and b"terminated" in err
    assert list(tmp_path.iterdir()) == []


def test_item07_tune_on_a_full_disk(pair_copy: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n")
    before = tree_digest(pair_copy)
    proc = run_cli(["tune", pair_copy, "--data", prompts, "--ks", "1", "--max-new-tokens", "4"],
                   fsize=1024, timeout=120)
    line = one_error_line(proc, str(pair_copy))
    assert "File too large" in line or "No space" in line or "cannot write" in line
    assert "prompt 1/" not in proc.stderr, "the destination was not checked before measuring"
    assert tree_digest(pair_copy) == before
    assert sorted(p.name for p in pair_copy.iterdir()) == sorted(
        ["chat_template.jinja", "draft", MANIFEST_NAME, "target", "tokenizer.json",
         "tokenizer_config.json"])


def test_item07_bench_json_on_a_full_disk(tiny_pair_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "out" / "report.json"
    report.parent.mkdir()
    proc = run_cli(["bench", tiny_pair_dir, "--ks", "1", "--repeats", "1", "--warmup", "0",
                    "--max-new-tokens", "4", "--no-adaptive", "--json", report], fsize=200,
                   timeout=120)
    one_error_line(proc, str(report))
    assert list(report.parent.iterdir()) == []


def test_item07_write_manifest_failure_leaves_nothing(pair_copy: Path) -> None:
    code = ("from specedge.runtime.manifest import load_manifest, write_manifest\n"
            "from specedge.runtime.errors import SpecEdgeError\n"
            f"m = load_manifest({str(pair_copy)!r})\n"
            "try:\n    write_manifest(m, m.root)\nexcept SpecEdgeError as e:\n"
            "    print('refused:', e)\n")

    def limits() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    before = tree_digest(pair_copy)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, preexec_fn=limits,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"refused: {pair_copy / MANIFEST_NAME}: cannot write" in proc.stdout
    assert tree_digest(pair_copy) == before
    assert sorted(p.name for p in pair_copy.iterdir()) == sorted(
        ["chat_template.jinja", "draft", MANIFEST_NAME, "target", "tokenizer.json",
         "tokenizer_config.json"])


# ============================================================================= crashes


def test_item08_invalid_utf8_argument(tiny_pair_dir: Path) -> None:
    proc = run_cli(["generate", tiny_pair_dir, b"caf\xe9 \xff", "--max-new-tokens", "2"])
    one_error_line(proc, "UTF-8")


def test_item08_lone_surrogate_api(tiny_pair: Pair) -> None:
    for prompt in ("a\ud800b", [{"role": "user", "content": "\udcff"}]):
        with pytest.raises(InputError, match="UTF-8"):
            tiny_pair.generate(prompt, GenerationConfig(max_new_tokens=2))


def test_item08_surrogate_in_a_batch_row(runner: CliRunner, concat_dir: Path,
                                         tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "fine"}\n{"prompt": "bad \\ud800 row"}\n')
    clean_error(invoke(runner, "generate", concat_dir, "--batch", rows), f"{rows}:2")


def test_item08_invalid_utf8_on_chat_stdin(tiny_pair_dir: Path) -> None:
    proc = run_cli(["chat", tiny_pair_dir, "--max-new-tokens", "3"],
                   input=b"hello\n\xff\xfe bad\nagain\n", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("error:") == 1 and "UTF-8" in proc.stderr
    assert _prompts(proc.stdout) == 4  # the conversation went on after the bad line


@pytest.mark.parametrize("path", ["target/\ud800.onnx", "\udcff/model.onnx", "a\udfff"])
def test_item09_surrogate_in_a_manifest_path(tiny_pair_dir: Path, path: str) -> None:
    doc = json.loads((tiny_pair_dir / MANIFEST_NAME).read_text())
    doc["models"]["target"]["path"] = path
    with pytest.raises(ManifestError, match="models.target.path"):
        parse_manifest(tiny_pair_dir, doc)
    doc = json.loads((tiny_pair_dir / MANIFEST_NAME).read_text())
    doc["tokenizer"]["files"][path] = "0" * 64
    with pytest.raises(ManifestError, match="tokenizer.files"):
        parse_manifest(tiny_pair_dir, doc)


def test_item10_declared_kv_sizes_beyond_the_model(pair_copy: Path) -> None:
    def huge(doc: dict[str, Any]) -> None:
        for m in doc["models"].values():
            m.update(num_kv_heads=1024, head_dim=4096, max_seq_len=1 << 22)

    edit_manifest(pair_copy, huge)
    with pytest.raises(ModelError, match="num_kv_heads"):
        Pair.load(pair_copy)


def test_item10_kv_budget_is_checked_before_allocating(tiny_pair: Pair,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from specedge.runtime import kvcache

    monkeypatch.setattr(kvcache, "available_memory", lambda device: 64 << 10)
    with pytest.raises(InputError, match="KV cache needs .* available"):
        tiny_pair.generate("hi", GenerationConfig(max_new_tokens=400))


def test_item10_allocation_failure_is_a_clean_error(tiny_pair: Pair,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    from specedge.runtime.kvcache import KVCache

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("std::bad_alloc")

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_shape_and_type", fail)
    with pytest.raises(ModelError, match="could not allocate"):
        KVCache(tiny_pair.target, 1, 64)


def test_item10_vocab_ids_header_claiming_a_huge_shape(pair_copy: Path) -> None:
    path = pair_copy / "draft" / "vocab_ids.npy"
    header = "{'descr': '<i8', 'fortran_order': False, 'shape': (1099511627776,), }"
    header = header + " " * (117 - len(header)) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
                     + np.arange(16, dtype="<i8").tobytes())

    def change(doc: dict[str, Any]) -> None:
        doc["models"]["draft"]["vocab_ids"] = "draft/vocab_ids.npy"
        doc["models"]["draft"]["files"]["draft/vocab_ids.npy"] = sha256_file(path)

    edit_manifest(pair_copy, change)
    code = ("from specedge.runtime.pair import Pair\nfrom specedge.runtime.errors import "
            f"ModelError\ntry:\n    Pair.load({str(pair_copy)!r})\nexcept ModelError as e:\n"
            "    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS,
                                                                (3 << 30, 3 << 30)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "vocab_ids.npy" in proc.stdout


def test_item11_deeply_nested_manifest_is_refused_at_load(pair_copy: Path) -> None:
    def nest(doc: dict[str, Any]) -> None:
        value: Any = "x"
        for _ in range(600):
            value = {"a": value}
        doc["provenance"]["deep"] = value

    edit_manifest(pair_copy, nest)
    with pytest.raises(ManifestError, match="nested"):
        load_manifest(pair_copy)


def test_item11_empty_ks_is_refused_by_the_libraries(tiny_pair_dir: Path) -> None:
    from specedge.calibration.tune import TuneOptions
    from specedge.runtime.batch_bench import BatchBenchOptions
    from specedge.runtime.bench import BenchOptions

    with pytest.raises(InputError, match="ks"):
        BenchOptions(ks=())
    with pytest.raises(InputError, match="ks"):
        BatchBenchOptions(prompts=("a",), batches=(1,), ks=())
    with pytest.raises(InputError, match="ks"):
        TuneOptions(pair=tiny_pair_dir, prompts=("a",), ks=())


@pytest.mark.parametrize("option", ["--batch", "--prompts", "--data"])
def test_item11_endless_input_files(tiny_pair_dir: Path, option: str) -> None:
    command = {"--batch": ["generate", tiny_pair_dir], "--prompts": ["bench", tiny_pair_dir],
               "--data": ["tune", tiny_pair_dir, "--dry-run"]}[option]
    start = time.monotonic()
    proc = run_cli([*command, option, "/dev/zero"], timeout=60, memory=2 << 30)
    one_error_line(proc, "/dev/zero")
    assert time.monotonic() - start < 30


def _prompts(stdout: str) -> int:
    """How many times chat asked for a line (greedy decoding: the replies are the same on
    every run, and none of them holds "> ")."""
    return stdout.count("> ")


def test_item12_chat_outgrowing_the_context(runner: CliRunner, tiny_pair_dir: Path) -> None:
    turns = ["Tell me a story about a robot " * 6] * 8
    result = invoke(runner, "chat", tiny_pair_dir, "--max-new-tokens", "60",
                    "--system", "Be brief.", input="\n".join(turns) + "\n")
    assert result.exit_code == 0, result.output
    assert result.exception is None
    assert "dropped" in result.stderr and "oldest" in result.stderr
    assert "error:" not in result.stderr
    assert _prompts(result.stdout) == len(turns) + 1  # every turn answered, then EOF


def test_item12_one_failed_turn_does_not_end_the_chat(runner: CliRunner,
                                                      tiny_pair_dir: Path) -> None:
    too_long = "word " * 3000
    result = invoke(runner, "chat", tiny_pair_dir, "--max-new-tokens", "3",
                    input=f"hello\n{too_long}\nstill here?\n")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("error:") == 1
    assert _prompts(result.stdout) == 4


# ============================================================================= unclear output


def test_item13_broken_pipe_exits_quietly(tiny_pair_dir: Path) -> None:
    proc = subprocess.Popen([*CLI, "generate", str(tiny_pair_dir), "The quick",
                             "--max-new-tokens", "40"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head -c 0`: the reader is gone before the first write
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert err == "", err
    assert proc.returncode == 141  # 128 + SIGPIPE, as a Unix tool killed by the pipe


def test_item14_onnxruntime_logs_are_silent_unless_verbose(tiny_pair_dir: Path,
                                                           tmp_path: Path) -> None:
    pair = copy_pair(tiny_pair_dir, tmp_path / "pair")

    def wrong_head_dim(doc: dict[str, Any]) -> None:
        for m in doc["models"].values():
            m["head_dim"] = 8  # GroupQueryAttention fails at run time, with an ORT log line

    edit_manifest(pair, wrong_head_dim)
    proc = run_cli(["generate", pair, "hi", "--max-new-tokens", "2"])
    line = one_error_line(proc, "failed to run")
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [line], proc.stderr
    verbose = run_cli(["-v", "generate", pair, "hi", "--max-new-tokens", "2"])
    assert verbose.returncode == 1 and "[E:onnxruntime" in verbose.stderr


@pytest.mark.export  # editing the ONNX file needs the onnx package
@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx to edit the model")
def test_item15_logits_wider_than_the_vocabulary(concat_dir: Path, tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    pair = copy_pair(concat_dir, tmp_path / "pair")
    path = pair / "target" / "model.onnx"
    model = onnx.load(str(path))
    graph = model.graph
    for node in graph.node:
        node.output[:] = ["logits_raw" if o == "logits" else o for o in node.output]
    pads = helper.make_tensor("wide_pads", TensorProto.INT64, [6], [0, 0, 0, 0, 0, 80])
    fill = helper.make_tensor("wide_fill", TensorProto.FLOAT, [], [100.0])
    graph.initializer.extend([pads, fill])
    graph.node.append(helper.make_node("Pad", ["logits_raw", "wide_pads", "wide_fill"],
                                       ["logits"]))
    out = next(o for o in graph.output if o.name == "logits")
    out.type.tensor_type.shape.dim[2].ClearField("dim_value")
    out.type.tensor_type.shape.dim[2].dim_param = "vocab"
    onnx.save(model, str(path))
    rehash(pair, "target/model.onnx")
    with pytest.raises(ModelError, match="400 logits.*320"):
        loaded = Pair.load(pair)
        loaded.generate_batch(["hi", "there"], GenerationConfig(max_new_tokens=4,
                                                                drafter="none"))


@pytest.mark.parametrize(("row", "contains"), [
    ('{"prompt": "a", "chat": "no"}', '"chat" must be true or false'),
    ('{"prompt": "a", "max_new_tokens": "5"}', '"max_new_tokens"'),
    ('{"prompt": "a", "temperature": "hot"}', '"temperature"'),
    ('{"prompt": "a", "temperature": -1}', "temperature"),
    ('{"prompt": 7}', '"prompt"'),
    ('{"prompt": ""}', "empty"),
    ('{"messages": "hi"}', '"messages"'),
    ('{"prompt": "a", "seed": 1.5}', '"seed"'),
    ('{"prompt": "' + "word " * 3000 + '"}', "context"),
])
def test_item16_batch_rows_are_typed_and_errors_name_the_line(
        runner: CliRunner, concat_dir: Path, tmp_path: Path, row: str, contains: str) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "fine"}\n\n' + row + "\n")
    line = clean_error(invoke(runner, "generate", concat_dir, "--batch", rows), f"{rows}:3:")
    assert contains in line, line


def test_item17_tune_logs_no_skipped_check(runner: CliRunner, pair_copy: Path,
                                           tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n")
    with caplog.at_level(logging.INFO):
        result = invoke(runner, "tune", pair_copy, "--data", prompts, "--ks", "1",
                        "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "skipped" not in caplog.text and "skipped" not in result.stderr
    assert load_manifest(pair_copy).provenance["tune"]["rows"]


def test_item18_inspect_prints_strict_json(runner: CliRunner, pair_copy: Path) -> None:
    text = (pair_copy / MANIFEST_NAME).read_text()
    doc = json.loads(text)
    doc["models"]["target"]["validation"] = {"kl_mean": "__NAN__", "max": "__INF__"}
    (pair_copy / MANIFEST_NAME).write_text(
        json.dumps(doc).replace('"__NAN__"', "NaN").replace('"__INF__"', "-Infinity"))
    result = invoke(runner, "inspect", pair_copy)
    assert result.exit_code == 0, result.output

    def strict(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    json.loads(result.stdout, parse_constant=strict)


BLOCK_ONNX = r'''
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("onnx", "torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
from specedge.cli import main
main()
'''


def test_item18_missing_export_extra_is_named(tiny_pair_dir: Path, tmp_path: Path) -> None:
    for args in (["quantize", str(tiny_pair_dir), "-o", str(tmp_path / "q"), "--method",
                  "int8-dynamic"],
                 ["export", str(tmp_path), "-o", str(tmp_path / "e")]):
        proc = subprocess.run([sys.executable, "-c", BLOCK_ONNX, *args], capture_output=True,
                              text=True, timeout=120, check=False)
        one_error_line(proc, "[export]")
        assert "ModuleNotFoundError" not in proc.stderr
        assert not (tmp_path / "q").exists() and not (tmp_path / "e").exists()


@pytest.mark.export
@pytest.mark.skipif(not HAS_TORCH, reason="needs [export]")
def test_item18_full_disk_during_export_names_the_output(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from specedge.exporter import pair as exporter_pair
    from specedge.exporter.tiny import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf", seed=5)
    out = tmp_path / "outdir" / "pair"

    def full(src: Any, precision: str, name: str, opts: Any, tmp: Path, work: Path) -> Any:
        (tmp / "target").mkdir()
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "target" / "x.data"))

    monkeypatch.setattr(exporter_pair, "_export_model", full)
    with pytest.raises(SpecEdgeError) as info:
        exporter_pair.export_pair(exporter_pair.ExportOptions(target=str(hf), output=out))
    assert str(out) in str(info.value) and "No space left" in str(info.value)
    assert ".tmp-" not in str(info.value)
    assert not out.exists() and list(out.parent.iterdir()) == []
