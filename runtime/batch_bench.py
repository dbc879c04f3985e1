"""`specedge bench --batch 1,2,4,8`: aggregate throughput of batched decoding, with and without
speculation, and the costs that explain where speculation stops paying.

For each batch size B the same prompts are split into batches of B. Every setting (target only,
fixed K, adaptive K, and fixed K with masking instead of compaction) runs on the same batch
before the next batch is taken (interleaved, so machine drift hits every setting alike).
Aggregate tokens/s = all rows' new tokens / decode seconds. Greedy outputs are identical across
settings (exactness), so every setting produces the same tokens.

Costs (micro-benchmarked on the same sessions, B rows after a past of `past_len`):
verify(B, s) is one target call with s new tokens per row, step(B) one draft call with one token
per row. With K drafts a round costs K * step(B) + verify(B, K + 1) and emits B * E(K) tokens;
target-only emits B tokens per verify(B, 1). On a CPU, verify(B, K + 1) grows with B * (K + 1)
once the matrix multiplies stop being bound by reading the weights, which is where
speculation stops paying.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import host_argmax
from .bench import bench_drafter
from .errors import InputError, listed
from .pair import GenerationConfig, Pair


@dataclass(frozen=True)
class BatchBenchOptions:
    """What `specedge bench --batch` measures."""

    prompts: tuple[str, ...]
    batches: tuple[int, ...] = (1, 2, 4, 8)
    ks: tuple[int, ...] = (1, 2, 3, 4)
    adaptive: bool = True
    masking: bool = True  # also run the smallest K with finished rows masked, not compacted
    max_new_tokens: int = 64
    chat: bool = True
    # "model", "ngram" (free prompt-lookup drafts) or "hybrid"; None: the pair's draft model,
    # or n-gram lookup without one (`bench.bench_drafter`)
    drafter: str | None = None

    def __post_init__(self) -> None:
        if self.drafter not in (None, "model", "ngram", "hybrid"):
            raise InputError(f"unknown drafter {self.drafter!r}; use model, ngram or hybrid")
        if not self.batches or any(b < 1 for b in self.batches):
            raise InputError(f"--batch takes positive integers, got {listed(self.batches)}")
        if len(self.prompts) < max(self.batches):
            raise InputError(f"--batch {max(self.batches)} needs at least that many prompts; "
                             f"got {len(self.prompts)}")
        if not self.ks or any(not 1 <= k <= 64 for k in self.ks):
            raise InputError(f"--ks takes values in 1..64, got {listed(self.ks)}")
        GenerationConfig(max_new_tokens=self.max_new_tokens)  # validates it, as generate does


@dataclass
class BatchSetting:
    name: str
    k: int  # 0: target only
    adaptive: bool = False
    compact: bool = True
    tokens: int = 0
    seconds: float = 0.0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    k_sum: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class BatchRow:
    batch: int
    settings: list[BatchSetting] = field(default_factory=list)
    costs: dict[str, float] = field(default_factory=dict)


def _settings(opts: BatchBenchOptions) -> list[BatchSetting]:
    out = [BatchSetting("target only", 0)]
    out += [BatchSetting(f"K={k}", k) for k in opts.ks]
    if opts.adaptive:
        out.append(BatchSetting("adaptive", max(opts.ks), adaptive=True))
    if opts.masking:
        out.append(BatchSetting(f"K={min(opts.ks)} masked", min(opts.ks), compact=False))
    return out


def time_rows_call(model: Any, batch: int, new: int, vocab: int, past_len: int = 128,
                   reps: int = 7, seed: int = 0) -> float:
    """Median seconds of one `forward_rows` call feeding `new` tokens to each of `batch` rows
    after a past of `past_len` (random ids below `vocab`; rows rolled back between reps). On
    fixed buffers with CUDA graphs the first runs warm up and capture: give it reps to spare."""
    rng = np.random.default_rng(seed)
    rows = np.arange(batch)
    cache = model.new_cache(batch, past_len + new + 1)
    model.forward_rows(cache, rows, rng.integers(0, vocab, (batch, past_len)),
                       np.full(batch, past_len))
    times = []
    for _ in range(reps):
        cache.lengths[:] = past_len
        t0 = time.perf_counter()
        model.forward_rows(cache, rows, rng.integers(0, vocab, (batch, new)), np.full(batch, new))
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def time_host_greedy(batch: int, width: int, vocab: int, dtype: str = "float16",
                     reps: int = 9, seed: int = 0) -> float:
    """Median seconds of the host's share of a greedy batched call once its logits are on
    the host (what `OrtModel.forward_rows_greedy` does there: the finiteness check and each
    row's argmax), on random logits `[batch, width, vocab]` of `dtype`."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch, width, vocab)) * 4).astype(dtype)
    valid = np.ones((batch, width), bool)
    greedy, lens = np.ones(batch, bool), np.full(batch, width)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        keys = host_argmax.order_keys(logits)
        if not host_argmax.finite_at(keys, valid):
            raise AssertionError("random logits are finite")
        host_argmax.rows_argmax(keys, greedy, lens)
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def measure_batch_costs(pair: Pair, batch: int, ks: tuple[int, ...], past_len: int = 128,
                        reps: int = 7, draft: bool = True) -> dict[str, float]:
    """Median seconds of verify(B, s) for s in 1 and K+1, and of one draft step at batch B
    (with `draft` and a draft model; n-gram drafts cost no model call)."""
    vocab = pair.manifest.vocab_size
    costs = {f"verify_{s}": time_rows_call(pair.target, batch, s, vocab, past_len, reps)
             for s in sorted({1, *(k + 1 for k in ks)})}
    if draft and pair.draft is not None:
        costs["draft_step"] = time_rows_call(pair.draft, batch, 1, vocab, past_len, reps)
    return costs


def run_batch_bench(pair: Pair, opts: BatchBenchOptions,
                    progress: Callable[[str], None] | None = None) -> list[BatchRow]:
    """Run every batch size; greedy decoding."""
    if pair.manifest.target.graph != "concat":
        raise InputError(f"{pair.manifest.root}: batched decoding needs a pair exported with "
                         "--graph concat (ONNX Runtime's GroupQueryAttention, CPU and CUDA, takes "
                         "one row when several tokens follow a past)")
    report = []
    drafter = bench_drafter(pair, opts.drafter)
    warm = GenerationConfig(max_new_tokens=4, drafter=drafter, num_draft_tokens=2,
                            chat=opts.chat)
    pair.generate_batch(list(opts.prompts[:2]), warm)
    for batch in opts.batches:
        row = BatchRow(batch, _settings(opts))
        count = len(opts.prompts) // batch * batch
        for start in range(0, count, batch):
            prompts = list(opts.prompts[start:start + batch])
            for s in row.settings:
                cfg = GenerationConfig(
                    max_new_tokens=opts.max_new_tokens, chat=opts.chat,
                    drafter=drafter if s.k else "none", num_draft_tokens=s.k or None,
                    adaptive=s.adaptive)
                result = pair.generate_batch(prompts, cfg, compact=s.compact)
                st = result.stats
                s.tokens += st.new_tokens
                s.seconds += st.decode_s
                s.proposed += st.proposed
                s.accepted += st.accepted
                s.rounds += st.rounds
                s.k_sum += sum(st.draft_lengths)
                if progress:
                    progress(f"batch {batch}, {s.name}")
        row.costs = measure_batch_costs(pair, batch, opts.ks,
                                        draft=drafter != "ngram")
        report.append(row)
    return report


def rows_as_dicts(report: list[BatchRow]) -> list[dict[str, Any]]:
    """One flat dict per (batch, setting), with speed-ups against target-only at that batch
    and at batch 1, and the measured cost ratios."""
    base1 = report[0].settings[0].tokens_per_s if report else 0.0
    out = []
    for row in report:
        base = row.settings[0].tokens_per_s
        verify1 = row.costs.get("verify_1", 0.0)
        for s in row.settings:
            entry: dict[str, Any] = {
                "batch": row.batch, "setting": s.name, "tokens_per_s": s.tokens_per_s,
                "speedup_vs_target_only": s.tokens_per_s / base if base else 0.0,
                "vs_batch1_target_only": s.tokens_per_s / base1 if base1 else 0.0,
                "acceptance": s.accepted / s.proposed if s.proposed else None,
                "mean_k": s.k_sum / s.rounds if s.rounds else 0.0, "tokens": s.tokens}
            if s.k and not s.adaptive and verify1:
                entry["verify_ratio"] = row.costs.get(f"verify_{s.k + 1}", 0.0) / verify1
                if "draft_step" in row.costs:
                    entry["draft_ratio"] = row.costs["draft_step"] / verify1
            out.append(entry)
    return out


HEADERS = ("batch", "setting", "aggregate tok/s", "vs target-only (same batch)",
           "vs batch-1 target-only", "acceptance", "mean K", "verify(B,K+1)/verify(B,1)",
           "draft step/verify(B,1)")


def format_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """`rows_as_dicts` as strings, in the order of `HEADERS` (for rich or markdown)."""
    def f(x: float | None, spec: str) -> str:
        return "–" if x is None else format(x, spec)

    return [[str(r["batch"]), r["setting"], f"{r['tokens_per_s']:.1f}",
             f"{r['speedup_vs_target_only']:.2f}x", f"{r['vs_batch1_target_only']:.2f}x",
             f(r["acceptance"], ".2f"), f"{r['mean_k']:.2f}", f(r.get("verify_ratio"), ".2f"),
             f(r.get("draft_ratio"), ".2f")] for r in rows]
