"""What a model call costs, by the tokens it feeds: the cost model behind adaptive K.

A call's time depends on how many tokens it processes, rows x positions: a batch of 4 rows
verifying 2 positions each costs about what 8 rows verifying 1 do, and much more than 1 row
verifying 2. Keying costs by that count, and not by positions alone, keeps apart what a batch
measures with all its rows and what it measures after most have finished: at batch 4 on a CPU,
plain rounds were measured at the start of each generation (4 live rows) and drafting rounds
near its end (1 or 2), so verify(1) read dearer than verify(2) and adaptive K drafted at a loss
(0.93x of target-only end to end).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CostTable:
    """Seconds of a call by tokens fed: a moving average where a size was measured at least
    `min_samples` times (decayed), otherwise the weighted least-squares line through the
    measured sizes (one stale outlier cannot hide a cheap size; slope clamped at >= 0).
    `fixed`: a known cost for every size (free drafts: 0)."""

    decay: float = 0.95
    min_samples: float = 3.0
    fixed: float | None = None
    mean: dict[int, float] = field(default_factory=dict)
    weight: dict[int, float] = field(default_factory=dict)  # decayed sample counts
    _line: tuple[float, float, float] | None = field(default=None, repr=False, compare=False)

    def record(self, tokens: int, seconds: float) -> None:
        """One call that fed `tokens` tokens took `seconds`."""
        old = self.mean.get(tokens)
        self.mean[tokens] = seconds if old is None else (
            self.decay * old + (1 - self.decay) * seconds)
        self.weight[tokens] = self.decay * self.weight.get(tokens, 0.0) + 1.0
        self._line = None  # refitted on demand

    def measured(self, tokens: int) -> bool:
        return self.fixed is not None or tokens in self.mean

    def cost(self, tokens: int) -> float | None:
        """Seconds of a call feeding `tokens` tokens; None before any measurement."""
        if self.fixed is not None:
            return self.fixed
        if self.weight.get(tokens, 0.0) >= self.min_samples or len(self.mean) == 1:
            return self.mean.get(tokens, next(iter(self.mean.values()), None))
        if not self.mean:
            return None
        if self._line is None:
            w = sum(self.weight.values())
            xm = sum(x * self.weight[x] for x in self.mean) / w
            ym = sum(y * self.weight[x] for x, y in self.mean.items()) / w
            var = sum(self.weight[x] * (x - xm) ** 2 for x in self.mean)
            cov = sum(self.weight[x] * (x - xm) * (y - ym) for x, y in self.mean.items())
            self._line = (xm, ym, max(0.0, cov / var) if var else 0.0)
        xm, ym, slope = self._line
        return max(ym + slope * (tokens - xm), 1e-9)
