"""Quality of a quantized model against its unquantized source, measured through the runtime.

- perplexity on held-out text (teacher forcing: one prefill per text, next-token NLL);
- KL(reference ‖ quantized) and top-1 agreement over the same positions;
- for a target: how often greedy output differs from the reference target's, and the first
  position where it does (the quantized target's distribution is its own, not the fp32 one);
- for a draft: its acceptance against the pair's target (greedy, K = 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from specedge.runtime.backend import OrtModel
from specedge.runtime.logprobs import log_softmax
from specedge.runtime.pair import GenerationConfig, Pair


def _logits(model: OrtModel, ids: Sequence[int]) -> np.ndarray:
    cache = model.new_cache(1, len(ids) + 1)
    return model.forward(cache, np.asarray([list(ids)], np.int64))[0]  # [n, vocab]


def language_quality(reference: OrtModel, model: OrtModel,
                     token_lists: Sequence[Sequence[int]]) -> dict[str, float]:
    """Perplexities of both models, and KL / top-1 agreement of `model` against `reference`."""
    nll_ref = nll = kl = agree = count = 0.0
    for ids in token_lists:
        ref_lp = log_softmax(_logits(reference, ids))
        lp = log_softmax(_logits(model, ids))
        nxt = np.asarray(ids[1:])
        rows = np.arange(len(nxt))
        nll_ref -= ref_lp[rows, nxt].sum()
        nll -= lp[rows, nxt].sum()
        kl += (np.exp(ref_lp) * (ref_lp - lp)).sum(-1).sum()
        agree += (ref_lp.argmax(-1) == lp.argmax(-1)).sum()
        count += len(ids)
    positions = sum(len(ids) - 1 for ids in token_lists)
    return {"perplexity": float(np.exp(nll / positions)),
            "reference_perplexity": float(np.exp(nll_ref / positions)),
            "kl_mean": float(kl / count), "top1_agreement": float(agree / count),
            "positions": int(count)}


def greedy_difference(reference: Pair, pair: Pair, prompts: Sequence[str],
                      max_new_tokens: int = 64) -> dict[str, Any]:
    """How often greedy target-only output of `pair` differs from `reference`'s."""
    differ, first = 0, []
    for prompt in prompts:
        ids = reference.encode_prompt(prompt, chat=True)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, drafter="none")
        a, _, _ = reference.generate_ids(ids, cfg)
        b, _, _ = pair.generate_ids(ids, cfg)
        if a != b:
            differ += 1
            first.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                              min(len(a), len(b))))
    return {"prompts": len(prompts), "differ": differ, "differ_rate": differ / len(prompts),
            "first_difference_median": float(np.median(first)) if first else None,
            "note": "a quantized target samples from its own distribution, not the fp32 one"}


def draft_acceptance(pair: Pair, prompts: Sequence[str], k: int = 3,
                     max_new_tokens: int = 64) -> dict[str, float]:
    """Greedy acceptance of the pair's draft against its target."""
    acc = prop = tokens = rounds = 0
    for prompt in prompts:
        _, _, st = pair.generate_ids(pair.encode_prompt(prompt, chat=True), GenerationConfig(
            max_new_tokens=max_new_tokens, num_draft_tokens=k, adaptive=False, drafter="model"))
        acc += st.accepted
        prop += st.proposed
        tokens += st.new_tokens
        rounds += st.rounds
    return {"k": k, "acceptance": acc / prop if prop else 0.0,
            "tokens_per_round": tokens / rounds if rounds else 0.0}
