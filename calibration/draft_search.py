"""`specedge draft`: build candidate drafters for a target, score them, keep the fastest.

Candidates, each measured on held-out prompts (none assumed):
- the int4 weight-only self-draft (ORT GenAI builder, RTN, block 32);
- quantized self-drafts made from the target by `specedge.exporter.quantize`: int8
  weight-only (asymmetric, block 32) and int4 HQQ (float zero points rewritten exactly into the
  fast uint8 layout);
- the int4 and int8 self-drafts with their LM head restricted to the V' most frequent tokens of
  calibration text (`draft_head.py`; exact, the draft distribution stays valid);
- separate draft models the user names (`drafts`: HF folders, hub ids, GGUF files), each
  exported beside the target at `drafts_precision`; one with its own tokenizer is bridged to the
  target's (`exporter/vocab_bridge.py`), so a small model of another family competes too;
- model-free n-gram prompt lookup, and hybrid (n-gram when it hits, otherwise the best draft
  model found above).
Calibration text is the target's own greedy output on calibration prompts that are disjoint from
the evaluation prompts. All candidates share one target session and are scored in one pass:
each evaluation prompt runs target-only, then every (candidate, K), so machine drift hits every
setting alike and every speed-up is measured against the same target-only run. The table
reports decode tokens/s, speed-up, acceptance, tokens per round, the draft's measured cost
relative to a target step, and each candidate's build time and peak memory.
The winner's drafter and K become the pair's defaults; the whole table (losers included, with
build time) goes into the manifest's provenance and is printed.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from specedge.exporter import draft_head, sources
from specedge.exporter.pair import (
    ExportOptions,
    check_output,
    export_pair,
    require_modules,
    staged_folder,
)
from specedge.exporter.quantize import QuantSettings, run_isolated
from specedge.runtime.errors import InputError, listed
from specedge.runtime.files import copy_pair, sha256_file
from specedge.runtime.manifest import Defaults, read_manifest, write_manifest
from specedge.runtime.pair import GenerationConfig, Pair

from .data import CALIBRATION_PROMPTS

# Self-drafts quantized from the target: method -> (label, asymmetric weights)
SELF_DRAFTS = {"int8-rtn": ("int8 weight-only self-draft", True),
               "int4-hqq": ("int4 HQQ self-draft", True),
               "int4-rtn": ("int4 RTN self-draft (asymmetric)", True)}
# Target precisions a search can export on a CPU (fp16 graphs are built for GPUs).
PRECISIONS = ("fp32", "int8", "int4")
# Precisions of the separate drafts (`--drafts`) a search exports on a CPU.
SEPARATE_DRAFT_PRECISIONS = ("fp32", "int8", "int8-rtn", "int4")


@dataclass(frozen=True)
class DraftSearchOptions:
    """What `specedge draft` builds and how it scores."""

    target: str
    output: Path
    precision: str = "fp32"
    vocab_sizes: tuple[int, ...] = (16384, 8192)
    eval_prompts: tuple[str, ...] = ()
    calibration_prompts: tuple[str, ...] = CALIBRATION_PROMPTS
    ks: tuple[int, ...] = (2, 3, 4, 6)
    self_drafts: tuple[str, ...] = ("int8-rtn", "int4-hqq")
    drafts: tuple[str, ...] = ()
    drafts_precision: str = "int4"
    max_new_tokens: int = 96
    force: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InputError(f"--precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if not self.eval_prompts:
            raise InputError("draft search needs evaluation prompts (--prompts FILE)")
        if set(self.eval_prompts) & set(self.calibration_prompts):
            raise InputError("evaluation and calibration prompts overlap; keep them disjoint")
        if self.drafts_precision not in SEPARATE_DRAFT_PRECISIONS:
            raise InputError(f"--draft-precision {self.drafts_precision!r}: use one of "
                             f"{', '.join(SEPARATE_DRAFT_PRECISIONS)}")
        if any(not d.strip() for d in self.drafts) or len(set(self.drafts)) < len(self.drafts):
            raise InputError(f"--draft {listed(self.drafts)}: name each draft model once "
                             "(an HF folder, a hub id or a .gguf file)")
        unknown = set(self.self_drafts) - set(SELF_DRAFTS)
        if unknown:
            raise InputError(f"--self-drafts {sorted(unknown)}: use {', '.join(SELF_DRAFTS)}")
        if any(v < 16 for v in self.vocab_sizes):
            raise InputError(f"--vocab-sizes must be >= 16, got {listed(self.vocab_sizes)}")
        # What scoring checks later, checked before minutes of building candidates.
        if not self.ks or any(not 1 <= k <= 64 for k in self.ks):
            raise InputError(f"--ks takes values in 1..64, got {listed(self.ks)}")
        GenerationConfig(max_new_tokens=self.max_new_tokens)  # its range, as generate's
        if any(not p.strip() for p in self.eval_prompts):
            raise InputError("a prompt of --prompts is empty; give each line some text")


@dataclass
class Candidate:
    name: str
    folder: Path
    drafter: str
    build_s: float
    rows: dict[int, dict[str, float]] = field(default_factory=dict)  # K -> measurements
    draft_cost_ratio: float | None = None
    peak_mib: float | None = None  # peak RSS of the build (its child process when isolated)

    def best(self) -> tuple[int, float]:
        k = max(self.rows, key=lambda k: self.rows[k]["speedup"])
        return k, self.rows[k]["speedup"]


def _vocab_candidate(base: Path, dst: Path, keep: np.ndarray) -> None:
    manifest = read_manifest(base)
    assert manifest.draft is not None
    copy_pair(base, dst)
    shutil.rmtree(dst / "draft")
    (dst / "draft").mkdir()
    draft_head.restrict_lm_head(base / manifest.draft.path, dst / "draft" / "model.onnx", keep)
    np.save(dst / "draft" / "vocab_ids.npy", keep.astype(np.int64), allow_pickle=False)
    files = {str(p.relative_to(dst)): sha256_file(p) for p in sorted((dst / "draft").iterdir())}
    draft = replace(manifest.draft, files=files, vocab_ids="draft/vocab_ids.npy", head=None,
                    validation={**manifest.draft.validation, "vocab_subset": int(len(keep))})
    write_manifest(replace(manifest, root=dst, draft=draft), dst)


def _peak_rss_mib() -> float:
    """Peak RSS so far of this process and of its largest finished child (MiB)."""
    import resource

    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


def _self_draft_candidate(base: Path, dst: Path, method: str) -> float | None:
    """A pair whose draft is the target quantized with `method` (in a child process)."""
    manifest = read_manifest(base)
    assert manifest.draft is not None
    copy_pair(base, dst)
    shutil.rmtree(dst / "draft")
    (dst / "draft").mkdir()
    settings = QuantSettings(method, symmetric=not SELF_DRAFTS[method][1])
    peak = run_isolated(settings, base / manifest.target.path, dst / "draft" / "model.onnx", [],
                        dst)
    files = {str(p.relative_to(dst)): sha256_file(p) for p in sorted((dst / "draft").iterdir())}
    source = {**manifest.target.source, "quantization": {
        "method": method, "block_size": settings.block_size, "symmetric": settings.symmetric,
        "accuracy_level": settings.accuracy_level}}
    draft = replace(manifest.target, files=files, path="draft/model.onnx",
                    precision=settings.precision, source=source, head=None,
                    validation={"self_draft_of": "target", "method": method})
    write_manifest(replace(manifest, root=dst, draft=draft), dst)
    return peak


def _separate_draft_candidate(opts: DraftSearchOptions, src: str, base: Path, folder: Path,
                              say: Any) -> Candidate:
    """A pair of the base pair's target (copied, not exported again) and the draft model `src`
    (bridged when its tokenizer differs), exported at `opts.drafts_precision`."""
    t0 = time.perf_counter()
    label = Path(src).name if Path(src).exists() else src
    say(f"exporting the draft {label} ({opts.drafts_precision})")
    report = export_pair(ExportOptions(target=opts.target, output=folder,
                                       precision=opts.precision, draft=src,
                                       draft_precision=opts.drafts_precision,
                                       target_from=base))
    draft = report.manifest.draft
    assert draft is not None
    name = f"{label} ({opts.drafts_precision})"
    bridged = draft.source.get("vocab_bridge")
    if isinstance(bridged, dict):
        name += f", own tokenizer ({bridged['proposes']} of {bridged['target_tokens']} tokens)"
    return Candidate(name, report.folder, "model", time.perf_counter() - t0,
                     peak_mib=_peak_rss_mib())


def _measure_all(candidates: list[Candidate], base_folder: Path, prompts: list[list[int]],
                 opts: DraftSearchOptions) -> float:
    """Score every candidate and K in one pass, interleaved prompt by prompt with target-only.

    All candidates share one target session (they differ only in their drafter), so each
    prompt runs target-only once and then every (candidate, K): machine drift hits every
    setting alike and every speed-up is against the same target-only run. Returns the
    target-only tokens/s.
    """
    from specedge.runtime.backend import OrtModel
    from specedge.runtime.bench import measure_costs

    base = Pair.load(base_folder)  # verified: a skipped check would be logged as requested
    pairs: dict[Path, Pair] = {base_folder: base}
    for cand in candidates:
        if cand.folder not in pairs:
            m = read_manifest(cand.folder)
            assert m.draft is not None
            draft = OrtModel(m.root, m.draft, "draft", base.target.config)
            pairs[cand.folder] = Pair(m, base.tokenizer, base.target, draft)
    settings: list[tuple[Candidate | None, int, GenerationConfig]] = [
        (None, 0, GenerationConfig(max_new_tokens=opts.max_new_tokens, drafter="none"))]
    for cand in candidates:
        settings += [(cand, k, GenerationConfig(max_new_tokens=opts.max_new_tokens,
                                                drafter=cand.drafter, num_draft_tokens=k,
                                                adaptive=False)) for k in opts.ks]
    sums = [[0.0] * 5 for _ in settings]  # tokens, seconds, accepted, proposed, rounds
    for owner, _, cfg in settings:  # warm-up
        pairs[owner.folder if owner else base_folder].generate_ids(
            prompts[0], replace(cfg, max_new_tokens=8))
    for ids in prompts:
        for (owner, _, cfg), total in zip(settings, sums, strict=True):
            _, _, st = pairs[owner.folder if owner else base_folder].generate_ids(ids, cfg)
            for i, v in enumerate((st.new_tokens, st.decode_s, st.accepted, st.proposed,
                                   st.rounds)):
                total[i] += v
    baseline = sums[0][0] / sums[0][1]
    for (owner, k, _), (tokens, seconds, accepted, proposed, rounds) in zip(settings, sums,
                                                                            strict=True):
        if owner is None:
            continue
        owner.rows[k] = {"tokens_per_s": tokens / seconds,
                         "acceptance": accepted / proposed if proposed else 0.0,
                         "tokens_per_round": tokens / rounds,
                         "speedup": tokens / seconds / baseline,
                         "target_only_tokens_per_s": baseline}
    for cand in candidates:
        if cand.drafter in ("model", "hybrid") and cand.draft_cost_ratio is None:
            costs = measure_costs(pairs[cand.folder], reps=9)
            if costs.draft_step:
                cand.draft_cost_ratio = costs.draft_step / costs.target[1]
    return baseline


def search(opts: DraftSearchOptions, say: Any = print) -> dict[str, Any]:
    """Build, score and keep the best drafting for `opts.target`; returns the table."""
    out = check_output(opts.output, force=opts.force, inputs=[opts.target, *opts.drafts])
    require_modules("draft")
    for src in (opts.target, *opts.drafts):  # a typo fails now, not after the first builds
        sources.source_kind(src, "target" if src == opts.target else "draft")
    work = Path(tempfile.mkdtemp(prefix=".specedge-draft-", dir=out.parent))
    try:
        t0 = time.perf_counter()
        say("exporting the target and the int4 self-draft")
        base = export_pair(ExportOptions(target=opts.target, output=work / "int4",
                                         precision=opts.precision, draft_precision="int4"))
        candidates = [Candidate("int4 self-draft", base.folder, "model",
                                time.perf_counter() - t0, peak_mib=_peak_rss_mib())]
        # The drafts the user named first: one that cannot pair with the target fails early.
        candidates += [_separate_draft_candidate(opts, src, base.folder, work / f"draft-{i}",
                                                say)
                       for i, src in enumerate(opts.drafts)]
        pair = Pair.load(base.folder)
        too_big = [v for v in opts.vocab_sizes if v >= pair.manifest.vocab_size]
        if too_big:
            raise InputError(f"--vocab-sizes {listed(too_big)}: the target's vocabulary has "
                             f"{pair.manifest.vocab_size} tokens, so such a head would not be "
                             f"smaller; give sizes below {pair.manifest.vocab_size}")
        eval_ids = [pair.encode_prompt(p, chat=True) for p in opts.eval_prompts]
        say("generating calibration text with the target")
        streams = []
        for prompt in opts.calibration_prompts:
            ids = pair.encode_prompt(prompt, chat=True)
            out_ids, _, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=128,
                                                                    drafter="none"))
            streams.append(ids + out_ids)
        for method in opts.self_drafts:
            t1 = time.perf_counter()
            label = SELF_DRAFTS[method][0]
            say(f"building the {label}")
            folder = work / method
            peak = _self_draft_candidate(base.folder, folder, method)
            candidates.append(Candidate(label, folder, "model", time.perf_counter() - t1,
                                        peak_mib=peak))
        heads = [c for c in candidates if c.name in ("int4 self-draft",
                                                      SELF_DRAFTS["int8-rtn"][0])]
        for head_base in heads:
            for size in opts.vocab_sizes:
                t1 = time.perf_counter()
                say(f"building the {head_base.name} with a {size}-token head")
                keep = draft_head.frequent_tokens(streams, size, pair.manifest.vocab_size,
                                                  always=pair.manifest.eos_token_ids)
                folder = work / f"{head_base.folder.name}-v{size}"
                _vocab_candidate(head_base.folder, folder, keep)
                candidates.append(Candidate(f"{head_base.name}, {size}-token head", folder,
                                            "model", time.perf_counter() - t1))
        del pair
        models = [c for c in candidates if c.drafter == "model"]
        candidates.append(Candidate("n-gram prompt lookup", base.folder, "ngram", 0.0))
        for model in models:
            if "-token head" not in model.name:  # hybrid over every full-vocabulary draft
                candidates.append(Candidate(f"hybrid n-gram + {model.name}", model.folder,
                                            "hybrid", 0.0, peak_mib=model.peak_mib))
        say(f"scoring {len(candidates)} candidates x K in {opts.ks}, interleaved")
        baseline = _measure_all(candidates, base.folder, eval_ids, opts)
        winner = max(candidates, key=lambda c: c.best()[1])
        k, speedup = winner.best()
        table = {"target_only_tokens_per_s": baseline, "eval_prompts": len(eval_ids),
                 "max_new_tokens": opts.max_new_tokens,
                 "winner": {"name": winner.name, "drafter": winner.drafter, "k": k,
                            "speedup": speedup},
                 "candidates": [{"name": c.name, "drafter": c.drafter, "build_s": c.build_s,
                                 "build_peak_rss_mib": c.peak_mib,
                                 "draft_cost_ratio": c.draft_cost_ratio,
                                 "rows": {str(k): r for k, r in c.rows.items()}}
                                for c in candidates]}
        manifest = read_manifest(winner.folder)
        with staged_folder(out) as final:
            copy_pair(winner.folder, final, hardlink=True)
            write_manifest(replace(manifest, root=final,
                                   defaults=Defaults(drafter=winner.drafter, num_draft_tokens=k,
                                                     adaptive=manifest.defaults.adaptive),
                                   provenance={**manifest.provenance, "draft_search": table}),
                           final)
        return table
    finally:
        shutil.rmtree(work, ignore_errors=True)


HEADERS = ("candidate", "K", "tok/s", "speed-up", "acceptance", "tokens/round", "draft cost",
           "build s", "build peak MiB")


def format_rows(table: dict[str, Any]) -> list[list[str]]:
    """The candidates of a `search` table as strings, one row per (candidate, K), in the order
    of `HEADERS`."""
    out = []
    for cand in table["candidates"]:
        ratio = cand["draft_cost_ratio"]
        peak = cand.get("build_peak_rss_mib")
        for k, row in cand["rows"].items():
            out.append([cand["name"], k, f"{row['tokens_per_s']:.1f}", f"{row['speedup']:.2f}x",
                        f"{row['acceptance']:.2f}", f"{row['tokens_per_round']:.2f}",
                        f"{ratio:.2f}" if ratio else "–", f"{cand['build_s']:.0f}",
                        f"{peak:.0f}" if peak else "in process"])
    return out
