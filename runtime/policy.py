"""One resolver from a request to a decoding plan, used by every entry point.

`generate`, `stream`, `generate_batch` and `ContinuousBatch` all turn (drafter, K, adaptive) and
the pair's defaults into a `DecodePlan` here, so a request decodes the same way everywhere. The
plan also fixes the context limit: the target's, and the draft's only when a draft model runs.
Seeded sampling needs no policy of its own: it is position-keyed (`rounds.RowSampler`), so its
output does not depend on K or on adaptivity.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError
from .manifest import PairManifest

DRAFTER_CHOICES = ("model", "ngram", "hybrid", "none")
MODEL_DRAFTERS = ("model", "hybrid")
DRAFT_P_MIN = 0.0  # the default confidence cut-off of model drafts (0: off)


@dataclass(frozen=True)
class DecodePlan:
    """How a generation (or a batch) decodes.

    Attributes:
        drafter: "model", "ngram", "hybrid" or "none" (target only).
        k: the draft length (the maximum when adaptive); 0 with "none".
        adaptive: choose k each round from measured acceptance and costs.
        limit: the context in tokens (prompt + generated).
        cache_floor: the smallest cache the models can take (`min_cache_len`).
        draft_p_min: the draft model stops proposing at a token it gives less than this
            probability (0: never).
    """

    drafter: str
    k: int
    adaptive: bool
    limit: int
    cache_floor: int
    draft_p_min: float = 0.0

    @property
    def uses_draft_model(self) -> bool:
        return self.drafter in MODEL_DRAFTERS

    def check_prompt(self, n_tokens: int) -> None:
        """Refuse a prompt that leaves no room for one new token."""
        if n_tokens >= self.limit:
            raise InputError(f"the prompt has {n_tokens} tokens but the context is "
                             f"{self.limit}; shorten it")

    def cache_len(self, longest_prompt: int, max_new_tokens: int) -> int:
        """KV cache length for prompts up to `longest_prompt` tokens and this budget."""
        need = longest_prompt + max_new_tokens + self.k + 1
        return min(self.limit, max(need, self.cache_floor))


def resolve_plan(manifest: PairManifest, *, has_draft: bool, drafter: str | None = None,
                 k: int | None = None, adaptive: bool | None = None,
                 draft_p_min: float | None = None) -> DecodePlan:
    """The plan for a request; None fields take the pair's defaults.

    Args:
        manifest: the pair's manifest (defaults, max lengths).
        has_draft: whether a draft model is loaded.
        drafter, k, adaptive: what the request asks for (None: default).

    Raises:
        InputError: an unknown drafter, or one that needs a draft model the pair lacks.
    """
    d = manifest.defaults
    if drafter is None:
        name = d.drafter
        if name in MODEL_DRAFTERS and not has_draft:
            name = "ngram"  # the default needs a model that is not loaded: draft without it
    else:
        name = drafter
    if name not in DRAFTER_CHOICES:
        raise InputError(f"drafter must be one of {', '.join(DRAFTER_CHOICES)}, got {name!r}")
    if name in MODEL_DRAFTERS and not has_draft:
        raise InputError(f"drafter {name!r} needs a draft model but {manifest.root} has none "
                         "loaded; use --drafter ngram or export a pair with --draft-precision")
    steps = 0 if name == "none" else (k or d.num_draft_tokens)
    models = [manifest.target] + ([manifest.draft] if name in MODEL_DRAFTERS and
                                  manifest.draft is not None else [])
    return DecodePlan(drafter=name, k=steps,
                      adaptive=bool(d.adaptive if adaptive is None else adaptive) and steps > 0,
                      limit=min(m.max_seq_len for m in models),
                      cache_floor=max(m.min_cache_len for m in models),
                      draft_p_min=DRAFT_P_MIN if draft_p_min is None else draft_p_min)
