"""`specedge bench`: measure a pair on this device, and what its measured costs predict.

For each setting (target only, fixed K = 1..8, adaptive K) it runs the same prompts, interleaved
within each repetition so drift hits every setting alike, and reports medians with min–max over
repetitions. Next to the achieved speed it reports what the measured acceptance and costs predict
(Leviathan et al. 2023, Eq. for the expected speed-up, with the measured verify cost in place of
"one target call costs the same for any number of tokens"):

    predicted(K) = tokens_per_round(K) * verify(1) / (K * draft_step + verify(K + 1))

where tokens_per_round is measured at K, draft_step is the draft's cost for one token, and
verify(s) the target's cost for s tokens after a past, both measured by a micro-benchmark on the
same sessions. efficiency = achieved / predicted shows what the loop loses (host overhead, draft
catch-up calls, a growing context).
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError, listed
from .files import write_atomic
from .pair import GenerationConfig, Pair
from .sampling import SamplingParams

DEFAULT_PROMPTS = (
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "List five tips for staying productive when working from home.",
)


def bench_drafter(pair: Pair, asked: str | None) -> str:
    """The drafter a bench speculates with: `asked`, or the pair's draft model (n-gram prompt
    lookup for a pair without one).

    Raises:
        InputError: `asked` needs a draft model the pair does not have (a bench that measured
            target-only alone would answer another question than the one asked).
    """
    if asked is None:
        return "model" if pair.draft is not None else "ngram"
    if asked != "ngram" and pair.draft is None:
        raise InputError(f"--drafter {asked} needs a draft model and {pair.manifest.root} has "
                         "none; bench it with --drafter ngram (or leave --drafter out)")
    return asked


@dataclass(frozen=True)
class BenchOptions:
    """What `specedge bench` measures."""

    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_new_tokens: int = 128
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    adaptive: bool = True
    drafter: str | None = None  # None: the pair's draft model, or n-gram lookup without one
    repeats: int = 3
    warmup: int = 1
    chat: bool = True
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    categories: tuple[str, ...] | None = None  # one per prompt: results also per category

    def sampling(self) -> SamplingParams:
        """The sampling every setting uses (seeded when sampling, so the settings sample the
        same tokens where their drafts agree)."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p,
                              seed=self.seed if self.temperature > 0 else None)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise InputError("bench needs at least one prompt")
        if self.categories is not None and len(self.categories) != len(self.prompts):
            raise InputError(f"{len(self.categories)} categories for {len(self.prompts)} "
                             "prompts; give one category per prompt")
        if self.repeats < 1 or self.warmup < 0:
            raise InputError("--repeats must be >= 1 and --warmup >= 0")
        self.sampling()  # validates temperature, top-k, top-p and min-p
        GenerationConfig(max_new_tokens=self.max_new_tokens)  # validates it, as generate does
        if not self.ks or any(not 1 <= k <= 64 for k in self.ks):
            raise InputError(f"--ks takes values in 1..64, got {listed(self.ks)}")


@dataclass
class SettingResult:
    """One setting's measurements over the repetitions."""

    name: str
    k: int | None  # None: target only; 0 with adaptive
    tokens_per_s: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    tokens_per_round: list[float] = field(default_factory=list)
    host_ms_per_round: list[float] = field(default_factory=list)
    mean_k: list[float] = field(default_factory=list)
    # category -> [new tokens, decode seconds], summed over the repetitions
    by_category: dict[str, list[float]] = field(default_factory=dict)

    def category_rate(self, category: str) -> float:
        tokens, seconds = self.by_category.get(category, (0.0, 0.0))
        return tokens / seconds if seconds else float("nan")

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return float(statistics.median(values)) if values else float("nan")

    def span(self, name: str) -> tuple[float, float]:
        values = getattr(self, name)
        return (min(values), max(values)) if values else (float("nan"), float("nan"))


@dataclass
class Costs:
    """Micro-benchmarked model costs (seconds, medians) at a past of `past_len` tokens."""

    past_len: int
    target: dict[int, float]  # new tokens -> seconds
    draft_step: float | None


@dataclass
class BenchReport:
    options: BenchOptions
    costs: Costs
    settings: list[SettingResult]
    environment: dict[str, Any]

    def baseline(self) -> float:
        return self.settings[0].median("tokens_per_s")

    def predicted(self, s: SettingResult) -> float | None:
        c = self.costs
        if s.k is None or s.name == "adaptive" or c.draft_step is None or s.k + 1 not in c.target:
            return None
        return s.median("tokens_per_round") * c.target[1] / (s.k * c.draft_step
                                                               + c.target[s.k + 1])

    def rows(self) -> list[dict[str, Any]]:
        base = self.baseline()
        out = []
        for s in self.settings:
            tps = s.median("tokens_per_s")
            lo, hi = s.span("tokens_per_s")
            pred = self.predicted(s)
            speedup = tps / base if base else float("nan")
            out.append({
                "setting": s.name, "k": s.k, "tokens_per_s": tps, "tokens_per_s_min": lo,
                "tokens_per_s_max": hi, "speedup": speedup,
                "acceptance": s.median("acceptance") if s.k is not None else None,
                "tokens_per_round": s.median("tokens_per_round"),
                "mean_k": s.median("mean_k"),
                "host_ms_per_round": s.median("host_ms_per_round"),
                "predicted_speedup": pred,
                "efficiency": speedup / pred if pred else None,
                "verify_cost_ratio": (self.costs.target.get(s.k + 1, float("nan"))
                                      / self.costs.target[1])
                if s.k and s.name != "adaptive" else None,
            })
        return out

    def category_rows(self) -> list[dict[str, Any]]:
        """Per category: each setting's speed-up over target only, and adaptive K against the
        best fixed K of that category (empty without categories)."""
        if self.options.categories is None:
            return []
        out = []
        for category in dict.fromkeys(self.options.categories):
            base = self.settings[0].category_rate(category)
            speedups = {s.name: s.category_rate(category) / base for s in self.settings}
            fixed = [s.name for s in self.settings if s.k is not None and s.name != "adaptive"]
            best = max(fixed, key=lambda n: speedups[n]) if fixed else None
            row: dict[str, Any] = {"category": category, "target_only_tokens_per_s": base,
                                   "speedups": speedups, "best_fixed": best}
            if best is not None and "adaptive" in speedups:
                row["adaptive_vs_best_fixed"] = speedups["adaptive"] / speedups[best]
            out.append(row)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"options": asdict(self.options), "environment": self.environment,
                "costs": asdict(self.costs), "categories": self.category_rows(),
                "draft_cost_ratio": (self.costs.draft_step / self.costs.target[1]
                                     if self.costs.draft_step else None),
                "rows": self.rows(), "raw": [asdict(s) for s in self.settings]}


def measure_costs(pair: Pair, past_len: int = 128, max_new: int = 9, reps: int = 15) -> Costs:
    """Median cost of one target call for 1..max_new new tokens, and of one draft step."""
    rng = np.random.default_rng(0)
    vocab = pair.manifest.vocab_size
    past = rng.integers(0, vocab, (1, past_len))

    def timed(model: Any, new: int) -> float:
        cache = model.new_cache(1, past_len + max_new + 1)
        model.forward(cache, past)
        times = []
        for _ in range(reps):
            cache.rollback(past_len)
            tokens = rng.integers(0, vocab, (1, new))
            t0 = time.perf_counter()
            model.forward(cache, tokens)
            times.append(time.perf_counter() - t0)
        return float(statistics.median(times))

    target = {s: timed(pair.target, s) for s in range(1, max_new + 1)}
    draft = timed(pair.draft, 1) if pair.draft is not None else None
    return Costs(past_len, target, draft)


def run_bench(pair: Pair, options: BenchOptions,
              progress: Callable[[str, int], None] | None = None) -> BenchReport:
    """Run the benchmark; `progress(label, advance)` is called after each generation."""
    sampling = options.sampling()
    drafter = bench_drafter(pair, options.drafter)
    options = replace(options, drafter=drafter)  # the report says which
    settings = [SettingResult("target only", None)]
    settings += [SettingResult(f"K={k}", k) for k in options.ks]
    if options.adaptive:
        settings.append(SettingResult("adaptive", max(options.ks)))

    def config(s: SettingResult) -> GenerationConfig:
        if s.k is None:
            return GenerationConfig(max_new_tokens=options.max_new_tokens, drafter="none",
                                    sampling=sampling, chat=options.chat)
        return GenerationConfig(max_new_tokens=options.max_new_tokens, drafter=drafter,
                                num_draft_tokens=s.k, adaptive=s.name == "adaptive",
                                sampling=sampling, chat=options.chat)

    tick = progress or (lambda _label, _n: None)
    for _ in range(options.warmup):
        for s in (settings[0], settings[-1]):
            pair.generate(options.prompts[0], config(s))
            tick("warm-up", 1)
    for rep in range(options.repeats):
        for s in settings:
            tokens = seconds = accepted = proposed = rounds = host = ks = 0.0
            for n, prompt in enumerate(options.prompts):
                r = pair.generate(prompt, config(s))
                st = r.stats
                tokens += st.new_tokens
                seconds += st.decode_s
                if options.categories is not None:
                    sums = s.by_category.setdefault(options.categories[n], [0.0, 0.0])
                    sums[0] += st.new_tokens
                    sums[1] += st.decode_s
                accepted += st.accepted
                proposed += st.proposed
                rounds += st.rounds
                host += st.host_s
                ks += sum(st.draft_lengths)
                tick(f"rep {rep + 1}/{options.repeats} {s.name}", 1)
            s.tokens_per_s.append(tokens / seconds if seconds else 0.0)
            s.acceptance.append(accepted / proposed if proposed else 0.0)
            s.tokens_per_round.append(tokens / rounds if rounds else 0.0)
            s.host_ms_per_round.append(1000 * host / rounds if rounds else 0.0)
            s.mean_k.append(ks / rounds if rounds else 0.0)
    costs = measure_costs(pair)
    return BenchReport(options, costs, settings,
                       {**environment(), "huge_pages": asdict(pair.huge_pages),
                        "target_steps": {"two_rows": pair.target.two_row_steps,
                                         "probe": (asdict(pair.target.row_probe)
                                                   if pair.target.row_probe else None)}})


def environment() -> dict[str, Any]:
    import os
    import platform
    import resource
    import sys

    import onnxruntime

    return {
        "machine": platform.machine(), "processor": platform.processor(),
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "torch_loaded": "torch" in sys.modules,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def total_generations(pair: Pair, options: BenchOptions) -> int:
    n_settings = 1 + len(options.ks) + int(options.adaptive)
    return options.warmup * 2 + options.repeats * n_settings * len(options.prompts)


def plot(report: BenchReport, out: Path) -> Path | None:
    """tokens/s and acceptance against K (PNG); None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in report.rows() if r["k"] is not None and r["setting"] != "adaptive"]
    if not rows:
        return None
    ks = [r["k"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, [r["tokens_per_s"] for r in rows], "o-", label="speculative tokens/s")
    ax.axhline(report.baseline(), color="gray", ls="--", label="target only")
    adaptive = [r for r in report.rows() if r["setting"] == "adaptive"]
    if adaptive:
        ax.axhline(adaptive[0]["tokens_per_s"], color="green", ls=":", label="adaptive")
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(ks, [r["acceptance"] for r in rows], "s--", color="tab:red", label="acceptance")
    ax2.set_ylabel("acceptance")
    ax2.set_ylim(0, 1)
    fig.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return write_atomic(out, png.getvalue())  # whole or absent, even on a full disk


def format_rows(report: BenchReport) -> Sequence[Sequence[str]]:
    """The table as strings (for rich or markdown)."""
    def f(x: float | None, spec: str) -> str:
        return "–" if x is None or x != x else format(x, spec)

    out = []
    for r in report.rows():
        out.append([
            r["setting"],
            f"{r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}–{r['tokens_per_s_max']:.1f})",
            f(r["speedup"], ".2f") + "x", f(r["acceptance"], ".2f"),
            f(r["tokens_per_round"], ".2f"), f(r["verify_cost_ratio"], ".2f"),
            f(r["predicted_speedup"], ".2f"), f(r["efficiency"], ".2f"),
            f(r["host_ms_per_round"], ".2f"), f(r["mean_k"], ".2f"),
        ])
    return out


def format_category_rows(report: BenchReport) -> tuple[Sequence[str], Sequence[Sequence[str]]]:
    """(headers, rows) of the per-category table: speed-ups over target only."""
    rows = report.category_rows()
    names = [s.name for s in report.settings[1:]]
    headers = ["category", "target only tok/s", *names]
    if rows and "adaptive_vs_best_fixed" in rows[0]:
        headers.append("adaptive / best fixed")
    out = []
    for r in rows:
        line = [r["category"], f"{r['target_only_tokens_per_s']:.1f}",
                *(f"{r['speedups'][n]:.2f}x" for n in names)]
        if "adaptive_vs_best_fixed" in r:
            line.append(f"{r['adaptive_vs_best_fixed']:.3f} ({r['best_fixed']})")
        out.append(line)
    return headers, out


HEADERS = ("setting", "tok/s median (min–max)", "speed-up", "acceptance", "tokens/round",
           "verify(K+1)/verify(1)", "predicted", "efficiency", "host ms/round", "mean K")
