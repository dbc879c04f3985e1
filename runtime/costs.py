"""What a model call costs, by the tokens it feeds: the cost model behind adaptive K.

A call's time depends on how many tokens it processes, rows x positions: a batch of 4 rows
verifying 2 positions each costs about what 8 rows verifying 1 do, and much more than 1 row
verifying 2. Keying costs by that count, and not by positions alone, keeps apart what a batch
measures with all its rows and what it measures after most have finished: at batch 4 on a CPU,
plain rounds were measured at the start of each generation (4 live rows) and drafting rounds
near its end (1 or 2), so verify(1) read dearer than verify(2) and adaptive K drafted at a loss
(0.93x of target-only end to end).

Timing noise is one-sided: another process, the kernel freeing memory or a cold cache only
make a call slower. So a reading below a size's estimate replaces it (`down`), while a higher
one moves it by 5% (a cost that really rose is followed within ~20 readings), and a size not
measured lately counts less in the line as other sizes are measured. Before, one slow first
round (its draft step and verify(3) read 2x, right after another program had run) kept the
verify line steep and the draft step dear for good: probes re-measured them at 5% a reading,
and adaptive K stayed at target-only for whole runs (`docs/results/llama_cpp_native.md`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CostTable:
    """Seconds of a call by tokens fed: a size's own estimate where it was measured at least
    `min_samples` times (decayed, also by the readings of other sizes since its last one),
    otherwise the weighted least-squares line through the measured sizes (one stale outlier
    cannot hide a cheap size; slope clamped at >= 0). A size's estimate moves to a lower
    reading by `down` of the gap (1: to it) and to a higher one by `1 - decay`.
    `fixed`: a known cost for every size (free drafts: 0)."""

    decay: float = 0.95
    min_samples: float = 3.0
    down: float = 1.0
    fixed: float | None = None
    mean: dict[int, float] = field(default_factory=dict)
    weight: dict[int, float] = field(default_factory=dict)  # decayed sample counts
    seen: dict[int, int] = field(default_factory=dict)  # `clock` at each size's last reading
    clock: int = 0  # readings recorded, all sizes
    _line: tuple[float, float, float] | None = field(default=None, repr=False, compare=False)

    def record(self, tokens: int, seconds: float) -> None:
        """One call that fed `tokens` tokens took `seconds`."""
        old = self.mean.get(tokens)
        if old is None:
            self.mean[tokens] = seconds
        else:
            step = self.down if seconds < old else 1 - self.decay
            self.mean[tokens] = old + step * (seconds - old)
        self.weight[tokens] = self._weight(tokens) * self.decay + 1.0
        self.clock += 1
        self.seen[tokens] = self.clock
        self._line = None  # refitted on demand

    def _weight(self, tokens: int) -> float:
        """A size's decayed sample count, decayed further by the readings of other sizes since
        its last one: a size not measured lately counts less."""
        if tokens not in self.weight:
            return 0.0
        return self.weight[tokens] * self.decay ** (self.clock - self.seen[tokens])

    def measured(self, tokens: int) -> bool:
        return self.fixed is not None or tokens in self.mean

    def cost(self, tokens: int) -> float | None:
        """Seconds of a call feeding `tokens` tokens; None before any measurement."""
        if self.fixed is not None:
            return self.fixed
        if self._weight(tokens) >= self.min_samples or len(self.mean) == 1:
            return self.mean.get(tokens, next(iter(self.mean.values()), None))
        if not self.mean:
            return None
        if self._line is None:
            weights = {x: self._weight(x) for x in self.mean}
            w = sum(weights.values())
            xm = sum(x * weights[x] for x in self.mean) / w
            ym = sum(y * weights[x] for x, y in self.mean.items()) / w
            var = sum(weights[x] * (x - xm) ** 2 for x in self.mean)
            cov = sum(weights[x] * (x - xm) * (y - ym) for x, y in self.mean.items())
            self._line = (xm, ym, max(0.0, cov / var) if var else 0.0)
        xm, ym, slope = self._line
        return max(ym + slope * (tokens - xm), 1e-9)
