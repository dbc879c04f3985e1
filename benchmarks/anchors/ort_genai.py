"""ONNX Runtime GenAI as an external anchor: the same ONNX files, its own decode loop.

ORT GenAI (0.18) does draft-model speculative decoding itself. What works, found by trying
(0.18.0, CPU):

* genai_config.json gets a ``model.draft`` block next to ``model.decoder``, with the same keys
  (``filename``, ``session_options``, ``head_size``, ``hidden_size``, ``num_attention_heads``,
  ``num_hidden_layers``, ``num_key_value_heads``, ``inputs``, ``outputs``). Only ``filename`` is
  required (without it: "model.draft.filename is not set in genai_config.json."); an unknown key
  is a parse error. Target and draft must share the vocabulary and the execution provider.
* With a ``model.draft`` block every generator speculates; K defaults to 4, or to the top-level
  ``"speculative": {"max_draft_tokens": K}`` of genai_config.json, and per generator to
  ``GeneratorParams.set_speculative_options(max_draft_tokens=K)`` (an int in [1, 16]; also
  ``ngram_size``, ``ngram_chained_lookup``, ``min_adaptive_k``, ``cooldown``; read back with
  ``get_speculative_options()``). There is no way to turn speculation off for a folder with a
  draft block, so target-only runs use a folder without one.
* ``Generator.get_speculative_stats()`` returns a dict: ``draft_tokens_proposed`` (K per round),
  ``draft_tokens_accepted``, ``draft_tokens_evaluated`` (drafts up to the first rejection),
  ``rounds``, ``target_forward_passes``, ``draft_forward_passes``, ``acceptance_rate``
  (accepted / evaluated), timings, etc. ``generate_next_token()`` still hands out one token per
  call (a round's tokens are buffered).
* ``session_options`` take ``intra_op_num_threads`` (int) and plain ORT config entries as string
  values, e.g. ``"session.intra_op.allow_spinning": "0"`` (a bool, or a nested
  ``config_entries`` object, is a parse error). Each model block has its own session options.

Usage (smoke run, a few seconds): ``python benchmarks/anchors/ort_genai.py [PAIR_DIR]``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Files of a pair folder that are linked into the ORT GenAI folder (target/ and draft/ are
# linked as whole folders so that model.onnx finds its model.onnx.data).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _kv_name(template: str) -> str:
    """specedge templates use ``{i}``, ORT GenAI uses ``%d``."""
    return template.replace("{i}", "%d")


def _model_block(entry: dict[str, Any], folder: str, threads: int | None,
                 spin: bool | None) -> dict[str, Any]:
    session: dict[str, Any] = {"log_id": "onnxruntime-genai", "provider_options": []}
    if threads is not None:
        session["intra_op_num_threads"] = int(threads)
    if spin is not None:
        session["session.intra_op.allow_spinning"] = "1" if spin else "0"
    kv = entry["kv"]
    if kv.get("layout", "BHSD") != "BHSD":
        raise ValueError(f"ORT GenAI needs a BHSD KV cache, {folder} has {kv.get('layout')}")
    inputs = {"input_ids": entry.get("input_ids", "input_ids"),
              "attention_mask": entry.get("attention_mask", "attention_mask"),
              "past_key_names": _kv_name(kv["past_key"]),
              "past_value_names": _kv_name(kv["past_value"])}
    if entry.get("position_ids"):
        inputs["position_ids"] = entry["position_ids"]
    block: dict[str, Any] = {
        "session_options": session,
        "filename": f"{folder}/{Path(entry['path']).name}",
        "head_size": int(entry["head_dim"]),
        "inputs": inputs,
        "outputs": {"logits": entry.get("logits", "logits"),
                    "present_key_names": _kv_name(kv["present_key"]),
                    "present_value_names": _kv_name(kv["present_value"])},
        "num_hidden_layers": int(entry["num_layers"]),
        "num_key_value_heads": int(entry["num_kv_heads"]),
    }
    # The specedge manifest does not record the query heads / hidden size; ORT GenAI needs them
    # only for graphs it builds itself, so they are written only when the manifest has them.
    for key in ("num_attention_heads", "hidden_size"):
        if key in entry:
            block[key] = int(entry[key])
    return block


def _link(src: Path, dst: Path) -> None:
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.exists():
        raise FileExistsError(f"{dst} exists and is not a link; choose an empty out_dir")
    dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())


def make_genai_folder(pair_dir: Path, out_dir: Path, *, draft: bool, target_threads: int | None,
                      draft_threads: int | None, target_spin: bool | None = None,
                      draft_spin: bool | None = None, max_length: int = 2048,
                      max_draft_tokens: int | None = None) -> Path:
    """Write out_dir/genai_config.json for the pair's own ONNX files (no copies).

    ``target/`` (and ``draft/`` when ``draft``) and the tokenizer files are symlinked into
    ``out_dir``; the config names ``target/model.onnx`` as ``model.decoder`` and, when ``draft``,
    ``draft/model.onnx`` as ``model.draft`` (which makes ORT GenAI speculate on every generator).
    Threads and spinning are per model session options; ``None`` leaves ORT GenAI's default
    (all physical cores, spinning on). Greedy search (``do_sample`` false). ``max_draft_tokens``
    writes the folder's default K (``speculative.max_draft_tokens``; ORT GenAI's default is 4).
    Returns ``out_dir``.
    """
    pair_dir, out_dir = Path(pair_dir), Path(out_dir)
    manifest = json.loads((pair_dir / "specedge.json").read_text())
    models = manifest["models"]
    if draft and not models.get("draft"):
        raise ValueError(f"{pair_dir} has no draft model")
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ["target", "draft"] if draft else ["target"]
    for name in names:
        _link((pair_dir / models[name]["path"]).parent, out_dir / name)
    for name in _TOKENIZER_FILES:
        if (pair_dir / name).exists():
            _link(pair_dir / name, out_dir / name)
    special = manifest.get("special_tokens", {})
    eos = list(special.get("eos", []))
    target = models["target"]
    context = int(target["max_seq_len"])
    if draft:
        context = min(context, int(models["draft"]["max_seq_len"]))
    config: dict[str, Any] = {
        "model": {
            "bos_token_id": special.get("bos"),
            "context_length": context,
            "decoder": _model_block(target, "target", target_threads, target_spin),
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": special.get("pad", eos[0] if eos else 0),
            # Every pair graph is a plain decoder-only LLM with explicit KV inputs/outputs;
            # ORT GenAI runs all of its decoder-only LLM types through the same code.
            "type": "llama",
            "vocab_size": int(target.get("vocab_size", manifest["vocab_size"])),
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
            "length_penalty": 1.0, "max_length": min(int(max_length), context),
            "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": True,
            "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }
    if config["model"]["bos_token_id"] is None:
        del config["model"]["bos_token_id"]
    if draft:
        config["model"]["draft"] = _model_block(models["draft"], "draft", draft_threads,
                                                draft_spin)
        if max_draft_tokens is not None:
            config["speculative"] = {"max_draft_tokens": int(max_draft_tokens)}
    (out_dir / "genai_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


@dataclass
class GenaiRun:
    """One generation by ORT GenAI.

    ``seconds`` is decode time only (see ``run_genai``); ``prefill_seconds`` is the
    ``append_tokens`` call. ``accepted``/``proposed`` are ``draft_tokens_accepted`` /
    ``draft_tokens_proposed`` of ``get_speculative_stats()`` (None without a draft model);
    ``stats`` is that whole dict.
    """

    new_tokens: int
    seconds: float
    tokens: list[int]
    accepted: int | None
    proposed: int | None
    prefill_seconds: float = 0.0
    stats: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def _read_config(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "genai_config.json").read_text())


def run_genai(folder: Path, prompts_ids: list[list[int]], max_new_tokens: int, *,
              num_draft_tokens: int | None) -> list[GenaiRun]:
    """Greedy generation of each prompt with one ``og.Model`` loaded from ``folder``.

    Per prompt: fresh ``GeneratorParams`` (greedy, ``max_length = len(prompt) +
    max_new_tokens``), ``set_speculative_options(max_draft_tokens=num_draft_tokens)`` when
    given, ``append_tokens(prompt)``, then ``generate_next_token()`` until eos (kept in
    ``tokens`` and counted, like specedge's runtime) or ``max_new_tokens``.

    Timing: ``seconds`` is decode only, from the return of ``append_tokens`` to the last token;
    ``append_tokens`` (the prefill of the target and, when speculating, of the draft) is
    ``prefill_seconds``. Note that ORT GenAI's prefill includes the last prompt token, so the
    first new token costs no target forward inside the timed loop, whereas specedge's runtime
    prefills ``prompt[:-1]`` and feeds the last prompt token in its first decode round: the ORT
    GenAI figure is favoured by about one target step per generation (target-only decode does
    ``new_tokens - 1`` forwards). With a ``model.draft`` block ORT GenAI always speculates, with
    the folder's default K when ``num_draft_tokens`` is None.
    """
    import onnxruntime_genai as og

    config = _read_config(folder)
    has_draft = "draft" in config["model"]
    if num_draft_tokens is not None and not has_draft:
        raise ValueError(f"{folder} has no model.draft block; cannot speculate")
    model = og.Model(str(folder))
    runs = [run_one(model, config, prompt, max_new_tokens, num_draft_tokens=num_draft_tokens)
            for prompt in prompts_ids]
    del model
    return runs


def target_and_speculative(pair_dir: Path) -> tuple[tuple[Any, dict[str, Any]],
                                                     tuple[Any, dict[str, Any]]]:
    """ORT GenAI's target-only model and its speculative one (draft and target) on a pair's
    own files, at its best thread plan on a 2-core machine (target 2 threads, draft 1)."""
    tmp = Path(tempfile.mkdtemp())
    target = make_genai_folder(pair_dir, tmp / "t", draft=False, target_threads=2,
                               draft_threads=None)
    spec = make_genai_folder(pair_dir, tmp / "s", draft=True, target_threads=2, draft_threads=1)
    return load(target), load(spec)


def load(folder: Path) -> tuple[Any, dict[str, Any]]:
    """Load the og.Model of a folder made by `make_genai_folder` (and its config)."""
    import onnxruntime_genai as og

    return og.Model(str(folder)), _read_config(folder)


def run_one(model: Any, config: dict[str, Any], prompt: list[int], max_new_tokens: int, *,
            num_draft_tokens: int | None, sample: dict[str, Any] | None = None,
            guidance: tuple[str, str] | None = None) -> GenaiRun:
    """One greedy (or sampled, `sample` = search options) generation; see `run_genai`.
    `guidance`: structured output, ``(type, data)`` for ``GeneratorParams.set_guidance``
    ("json_schema", "regex" or "lark_grammar")."""
    import onnxruntime_genai as og

    has_draft = "draft" in config["model"]
    eos = config["model"].get("eos_token_id", [])
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + max_new_tokens, batch_size=1,
                              **(sample or {"do_sample": False}))
    if guidance is not None:
        params.set_guidance(*guidance)
    if num_draft_tokens is not None:
        params.set_speculative_options(max_draft_tokens=int(num_draft_tokens))
    generator = og.Generator(model, params)
    t0 = time.perf_counter()
    generator.append_tokens(list(prompt))
    t1 = time.perf_counter()
    tokens: list[int] = []
    while len(tokens) < max_new_tokens and not generator.is_done():
        generator.generate_next_token()
        token = int(generator.get_next_tokens()[0])
        tokens.append(token)
        if token in eos_ids:
            break
    t2 = time.perf_counter()
    stats = dict(generator.get_speculative_stats()) if has_draft else None
    run = GenaiRun(
        new_tokens=len(tokens), seconds=t2 - t1, tokens=tokens,
        accepted=int(stats["draft_tokens_accepted"]) if stats else None,
        proposed=int(stats["draft_tokens_proposed"]) if stats else None,
        prefill_seconds=t1 - t0, stats=stats)
    del generator, params
    return run


def _summary(label: str, runs: list[GenaiRun]) -> str:
    tokens = sum(r.new_tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    line = f"{label:<28} {tokens:4d} tokens  {seconds:7.3f} s  {tokens / seconds:7.1f} tok/s"
    if runs and runs[0].proposed is not None:
        accepted = sum(r.accepted or 0 for r in runs)
        proposed = sum(r.proposed or 0 for r in runs)
        line += f"  accepted {accepted}/{proposed}"
    return line


def main(argv: list[str] | None = None) -> int:
    import sys
    import tempfile

    from tokenizers import Tokenizer

    args = sys.argv[1:] if argv is None else argv
    pair_dir = Path(args[0] if args else Path(__file__).resolve().parents[2]
                    / "pairs" / "smollm2-135m")
    max_new = 32
    tok = Tokenizer.from_file(str(pair_dir / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in ("The capital of France is",
                                           "def fibonacci(n):\n    \"\"\"Return the n-th")]
    ok = True
    with tempfile.TemporaryDirectory(prefix="ort_genai_") as tmp:
        tgt = make_genai_folder(pair_dir, Path(tmp) / "target", draft=False, target_threads=2,
                                draft_threads=None)
        spec = make_genai_folder(pair_dir, Path(tmp) / "spec", draft=True, target_threads=2,
                                 draft_threads=1)
        run_genai(tgt, prompts[:1], 8, num_draft_tokens=None)  # warm-up
        base = run_genai(tgt, prompts, max_new, num_draft_tokens=None)
        run_genai(spec, prompts[:1], 8, num_draft_tokens=2)  # warm-up
        fast = run_genai(spec, prompts, max_new, num_draft_tokens=2)
    print(f"ORT GenAI {pair_dir.name}: {len(prompts)} prompts x <= {max_new} new tokens, "
          "decode only (prefill excluded)")
    print(_summary("target-only (target 2 thr)", base))
    print(_summary("speculative K=2 (2 + 1 thr)", fast))
    for i, (a, b) in enumerate(zip(base, fast, strict=True)):
        if a.tokens != b.tokens:
            ok = False
            print(f"MISMATCH prompt {i}: target-only {a.tokens} vs speculative {b.tokens}")
    if ok:
        print("speculative greedy tokens == target-only greedy tokens")
    if os.environ.get("ORT_GENAI_SKIP_RUNTIME_CHECK") != "1":
        try:
            from specedge.runtime.pair import GenerationConfig, Pair
        except ImportError as exc:  # the runtime is optional for this anchor
            print(f"runtime check skipped: {exc}")
        else:
            pair = Pair.load(pair_dir, verify_hashes=False, load_draft=False)
            for i, (prompt, run) in enumerate(zip(prompts, base, strict=True)):
                ids, _, _ = pair.generate_ids(prompt, GenerationConfig(
                    max_new_tokens=max_new, drafter="none"))
                if ids == run.tokens:
                    print(f"ORT GenAI target-only == specedge runtime target-only (prompt {i})")
                else:
                    ok = False
                    print(f"MISMATCH vs specedge runtime, prompt {i}: {run.tokens} vs {ids}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
