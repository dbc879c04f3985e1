"""What a draft model's cache holds, against the committed text: one row's bookkeeping, shared
by batch-1 drafting (`drafters.ModelDrafter`) and batch rows (`batch.BatchDecoder`).

The draft is not fed while adaptive K drafts nothing (k = 0) or free n-gram hits draft, so it
falls behind the committed text. Its catch-up feeds at most a `window` of the tokens it
missed, after what its cache holds; the tokens in between are skipped, and its "view" of the
committed text leaves them out from then on. Its context has a gap (its positions count its
cache, not the text), which changes what it proposes, never the output: the target verifies
every draft. Fed in full, one probe up from k = 0 late in a long text fed thousands of tokens,
so adaptive K skipped every probe and never drafted again in that text
(`AdaptiveK.CATCH_UP_WINDOW`, whose size is measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .rounds import fed_prefix


@dataclass
class FedTokens:
    """The tokens a draft's cache holds (`tokens`), as a prefix of its view of the committed
    text. `tokens[:stable]` is known to be committed already; cache positions from `seam` on
    hold the committed tokens `skipped` later (`view`)."""

    tokens: list[int] = field(default_factory=list)
    stable: int = 0
    seam: int = 0
    skipped: int = 0

    def reset(self, tokens: Sequence[int]) -> None:
        """The cache now holds exactly `tokens` (a prefill, or a slot's kept prefix)."""
        self.tokens = list(tokens)
        self.stable = len(self.tokens)
        self.seam = self.skipped = 0

    def view(self, committed: list[int]) -> list[int]:
        """The `committed` tokens as the cache holds them: all of them, or, once a catch-up
        was cut to a window, those before the seam and those after the skipped ones."""
        if not self.skipped:
            return committed
        return self.tokens[:self.seam] + committed[self.seam + self.skipped:]

    def lag(self, committed: list[int]) -> int:
        """Committed tokens (in the view) the cache does not hold, the last one included."""
        return len(self.view(committed)) - len(self.tokens)

    def catch_up(self, committed: list[int], window: int, hold: int = 0) -> int:
        """Tokens the next draft call would feed before drafting: the lag, cut to `window`
        once the cache holds its first `hold` tokens (a batch row's prompt: a deferred draft
        prefill is fed whole)."""
        lag = self.lag(committed)
        return min(lag, window) if len(self.tokens) >= hold else lag

    def cut(self, committed: list[int], window: int, hold: int = 0) -> None:
        """Skip the tokens a catch-up would feed beyond the last `window` (`catch_up`)."""
        over = self.lag(committed) - self.catch_up(committed, window, hold)
        if over > 0:
            self.seam = len(self.tokens)
            self.skipped += over

    def commit(self, committed: list[int]) -> int:
        """Keep what stays valid after a round committed `committed`; the cache's length."""
        n = fed_prefix(self.tokens, self.view(committed), self.stable)
        del self.tokens[n:]
        self.stable = n
        return n
