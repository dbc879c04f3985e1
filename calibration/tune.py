"""`specedge tune`: measure each drafter and K on calibration prompts, store the fastest.

Target-only, every (drafter, fixed K) and each drafter's adaptive K (up to the largest K) run on
the same prompts, interleaved prompt by prompt so that machine drift hits all alike; the score is
decode tokens/s. The winner becomes the pair's default drafter, K and adaptivity (the manifest is
rewritten atomically); `generate` and `bench` use it. Adaptive K wins when it is within
`ADAPTIVE_MARGIN` of the fastest fixed setting: on prompts unlike the calibration set it backs off
where drafting stops paying, which a fixed K cannot.
Before measuring, it checks that the manifest can be written back (the folder takes a file of
its size, and the manifest serializes), so a full or read-only disk fails in a second, not after
minutes, and leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specedge.runtime.errors import InputError, listed
from specedge.runtime.files import check_writable, json_dumps
from specedge.runtime.manifest import DRAFTERS, write_manifest
from specedge.runtime.pair import GenerationConfig, Pair

ADAPTIVE_MARGIN = 0.97  # adaptive K is kept when at least this fraction of the best fixed K


@dataclass(frozen=True)
class TuneOptions:
    pair: Path
    prompts: tuple[str, ...]
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    drafters: tuple[str, ...] = ("model",)
    max_new_tokens: int = 96
    write: bool = True

    def __post_init__(self) -> None:
        if not self.prompts:
            raise InputError("tune needs calibration prompts")
        if not self.ks or any(not 1 <= k <= 64 for k in self.ks):
            raise InputError(f"--ks takes values in 1..64, got {listed(self.ks)}")
        bad = [d for d in self.drafters if d not in DRAFTERS]
        if bad:
            raise InputError(f"unknown drafter(s) {bad}; use {', '.join(DRAFTERS)}")


def tune(opts: TuneOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure and (optionally) store the best drafter and K; returns the table."""
    pair = Pair.load(opts.pair)
    drafters = [d for d in opts.drafters if d == "ngram" or pair.draft is not None]
    if not drafters:
        raise InputError(f"{opts.pair} has no draft model; tune with --drafters ngram")
    if opts.write:
        # The manifest is written back at the end: check now that it can be.
        size = len(json_dumps(pair.manifest.to_json(), indent=2)) + (64 << 10)
        check_writable(Path(opts.pair), size, what=str(Path(opts.pair) / "specedge.json"))
    settings: dict[tuple[str, int, bool], GenerationConfig] = {
        ("none", 0, False): GenerationConfig(max_new_tokens=opts.max_new_tokens, drafter="none")}
    for d in drafters:
        for k in opts.ks:
            settings[(d, k, False)] = GenerationConfig(
                max_new_tokens=opts.max_new_tokens, drafter=d, num_draft_tokens=k,
                adaptive=False)
        settings[(d, max(opts.ks), True)] = GenerationConfig(
            max_new_tokens=opts.max_new_tokens, drafter=d, num_draft_tokens=max(opts.ks),
            adaptive=True)
    ids = [pair.encode_prompt(p, chat=True) for p in opts.prompts]
    for cfg in settings.values():  # warm-up
        pair.generate_ids(ids[0], replace(cfg, max_new_tokens=8))
    sums = {key: [0.0, 0.0, 0.0, 0.0] for key in settings}
    for n, prompt_ids in enumerate(ids):
        for key, cfg in settings.items():
            _, _, st = pair.generate_ids(prompt_ids, cfg)
            for i, v in enumerate((st.new_tokens, st.decode_s, st.accepted, st.proposed)):
                sums[key][i] += v
        if progress:
            progress(f"prompt {n + 1}/{len(ids)}")
    rows: list[dict[str, Any]] = [
        {"drafter": d, "k": k, "adaptive": a, "tokens_per_s": s[0] / s[1] if s[1] > 0 else 0.0,
         "acceptance": s[2] / s[3] if s[3] else None} for (d, k, a), s in sums.items()]
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base if base > 0 else 0.0
    best = pick_best(rows)
    table = {"rows": rows, "best": best, "prompts": len(ids),
             "max_new_tokens": opts.max_new_tokens}
    if opts.write:
        manifest = pair.manifest  # as loaded (and verified) above, not re-read
        defaults = manifest.defaults
        if best["drafter"] == "none":  # speculation does not pay: keep K, turn adaptive on
            defaults = replace(defaults, adaptive=True)
        else:
            defaults = replace(defaults, drafter=best["drafter"], num_draft_tokens=best["k"],
                               adaptive=best["adaptive"])
        write_manifest(replace(manifest, defaults=defaults,
                               provenance={**manifest.provenance, "tune": table}),
                       Path(opts.pair))
    return table



def pick_best(rows: list[dict[str, Any]], margin: float = ADAPTIVE_MARGIN) -> dict[str, Any]:
    """The fastest row, except that the fastest adaptive row wins when it reaches `margin` of
    it (adaptive K also backs off on prompts where drafting stops paying)."""
    fastest = max(rows, key=lambda r: r["tokens_per_s"])
    adaptive = [r for r in rows if r["adaptive"]]
    if adaptive and fastest["drafter"] != "none":
        best_adaptive = max(adaptive, key=lambda r: r["tokens_per_s"])
        if best_adaptive["tokens_per_s"] >= margin * fastest["tokens_per_s"]:
            return best_adaptive
    return fastest
