"""Statistics of one generation, returned as a dataclass (never printed by the library)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """Counters and timings of one generation.

    Times are seconds of wall clock. `draft_s` and `verify_s` are spent inside the draft's and the
    target's `run` calls during decoding; `host_s` is everything else in the decode rounds
    (sampling, acceptance, bookkeeping, detokenization). `decode_s` counts decoding only: a
    stream's time suspended at its yields (the caller's) is left out; `total_s` is the wall
    clock from the call (or a `ContinuousBatch.submit`) to the end. A batch row's `draft_s` and
    `verify_s` are the whole calls of the rounds it took part in, which its rows share.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a reused prefix held (not prefilled again)
    new_tokens: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_calls: int = 0
    target_calls: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)  # K used in each round
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted in each round

    def record_round(self, proposed: int, accepted: int, *, verify_s: float, draft_s: float,
                     draft_calls: int) -> None:
        """Count one speculative round of this generation."""
        self.rounds += 1
        self.target_calls += 1
        self.proposed += proposed
        self.accepted += accepted
        self.draft_lengths.append(proposed)
        self.accepted_lengths.append(accepted)
        self.verify_s += verify_s
        self.draft_s += draft_s
        self.draft_calls += draft_calls

    @property
    def host_s(self) -> float:
        return max(0.0, self.decode_s - self.draft_s - self.verify_s)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per round: accepted drafts + the corrected or bonus token (the first token,
        which comes from the prefill, is not a round's)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of decoding: the tokens after the first (which the prefill gives)
        over the decode time (prefill excluded)."""
        return max(0, self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def end_to_end_tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("host_s", "acceptance_rate", "mean_accepted_length", "tokens_per_s",
                     "end_to_end_tokens_per_s"):
            out[name] = getattr(self, name)
        return out
