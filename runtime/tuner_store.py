"""What adaptive K learned, kept per (batch size, drafter, k max) for the next generation
(`Pair.tuners`): a generation starts from the tuner this device measured instead of from a
prior (`runtime/adaptive`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence

from .adaptive import AdaptiveK, new_tuner

__all__ = ["TunerKey", "TunerStore"]

TunerKey = tuple[int, str, int]  # (batch size, drafter, k max)


class TunerStore:
    """Adaptive-K state learned by generations, per (batch size, drafter, k max): the next such
    generation starts from what this device measured instead of from a prior. Thread-safe;
    `take` hands out copies, so concurrent generations never share one tuner."""

    def __init__(self) -> None:
        self.learned: dict[TunerKey, AdaptiveK] = {}
        self._lock = threading.Lock()

    def take(self, key: TunerKey, prefill: Sequence[int] = ()) -> AdaptiveK:
        """A copy of what earlier generations with this key learned (`prefill`: see
        `AdaptiveK.new_text`), or a new tuner.

        The first generation at a batch size starts from the tuner of the nearest batch size
        with the same drafter and k (a new tuner only when there is none): its costs are keyed
        by the tokens a call feeds, so they price calls at the new size too, and acceptance
        belongs to the pair and the text, not to the batch size. A cold tuner drafts before it
        has measured anything and then spends a round at k = 0 to measure plain decoding: on
        the CPU, 32 new tokens per row, the first batch at B = 4 and 8 ran at 0.88x and 0.93x
        of target-only cold against 1.00x and 1.05x warm."""
        with self._lock:
            stored = self.learned.get(key)
            if stored is None:
                same = [k for k in self.learned if k[1:] == key[1:]]
                if same:  # the nearest size; between two, the larger
                    stored = self.learned[min(same, key=lambda k: (abs(k[0] - key[0]), -k[0]))]
        if stored is None:
            return new_tuner(key[1], key[2])
        tuner = copy.deepcopy(stored)
        tuner.new_text(prefill=prefill, rows=key[0])
        return tuner

    def keep(self, key: TunerKey, tuner: AdaptiveK | None) -> None:
        """Store what a finished generation's tuner learned (None: it had none)."""
        if tuner is not None:
            with self._lock:
                self.learned[key] = tuner
