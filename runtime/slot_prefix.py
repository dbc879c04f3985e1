"""Prompt prefixes kept in a continuous batch's free slots: a chat's next turn joins the batch
in the slot that holds its conversation, and prefills only what is new.

A finished row leaves its keys and values in its slot. `SlotPrefixes` remembers which prompt
tokens each free slot still holds, exactly as a prefill wrote them, and `BatchDecoder.add` puts
a new request into the free slot that holds the longest whole-chunk prefix of its prompt, or,
when none does, into the slot released longest ago (the idea of llama.cpp's server, which picks
the slot whose cached prompt is most similar). Nothing is copied: the slot is the cache.

Rows share prefixes too: before each prefill call of a joining row, if another row (decoding,
or joining ahead of it) holds more of its prompt than it does (the same document or system
prompt), that row's whole prefill chunks are copied into it (`KVCache.copy_prefix`, on the
device where the cache is), so a prefix that several rows of a batch share is computed once,
also when the requests arrive together (as vLLM's automatic prefix caching shares blocks).

The rules are batch-1 prefix caching's (`runtime/prefix_cache`), and so is the exactness: every
row prefill (target and draft) is fed in chunks cut at the multiples of `PREFILL_CHUNK`, only
whole chunks a prefill wrote are kept, never a prompt's last two positions (a two-row step
re-feeds the position before the one it feeds), and a slot's buffers have the batch's length
whatever request used them. A warm row therefore makes the calls a cold row makes from its
first computed chunk, on the same inputs. Rows of the same call never mix, so the other rows
of the batch do not matter.

A reply's positions were written by verification blocks and draft steps, not by prefill chunks:
`BatchDecoder.prefill_ahead` recomputes the conversation so far in chunks into the free slot
that holds its start, in idle time (`specedge serve` does so when no request waits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .prefix_cache import PREFILL_CHUNK, kept_prefix, prefill_chunks, reusable

if TYPE_CHECKING:  # the runtime's models; imported for types only
    from .backend import OrtModel
    from .kvcache import KVCache


@dataclass
class Held:
    """What a free slot holds: the prompt tokens of its target row's whole prefill chunks, and
    of its draft row's (None: the draft row holds nothing a prefill wrote in chunks);
    `released`: when the slot was freed (a counter), for least-recently-used choice."""

    target: tuple[int, ...] = ()
    draft: tuple[int, ...] | None = None
    released: int = -1


class SlotPrefixes:
    """What each slot of a batch holds while it is free (`keep=False`: nothing is kept, every
    request starts from empty rows)."""

    def __init__(self, capacity: int, *, keep: bool = True) -> None:
        self.keep = keep
        self.held = [Held() for _ in range(capacity)]
        self._clock = 0

    def choose(self, free: Sequence[int], prompt: Sequence[int]) -> tuple[int, int]:
        """The free slot for `prompt` and how many of its tokens the slot's target row holds:
        the slot that lets it skip the most, else the one released longest ago."""
        if not free:
            raise ValueError("no free slot")
        best = max(free, key=lambda s: (self.target_reuse(s, prompt), -self.held[s].released))
        if self.target_reuse(best, prompt) == 0:
            best = min(free, key=lambda s: self.held[s].released)
        return best, self.target_reuse(best, prompt)

    def target_reuse(self, slot: int, prompt: Sequence[int]) -> int:
        return reusable(self.held[slot].target, prompt) if self.keep else 0

    def draft_reuse(self, slot: int, prompt: Sequence[int]) -> int:
        held = self.held[slot].draft
        return reusable(held, prompt) if self.keep and held is not None else 0

    def sharing(self, rows: Sequence[tuple[int, Sequence[int]]], prompt: Sequence[int]
                ) -> tuple[int, int]:
        """Among other rows `(slot, the prompt tokens it holds as its prefill calls wrote
        them)`, the one that holds the longest whole-chunk prefix of `prompt`: its slot and how
        many tokens (0: none)."""
        best = (-1, 0)
        if self.keep:
            for slot, held in rows:
                n = reusable(held, prompt)
                if n > best[1]:
                    best = (slot, n)
        return best

    def take(self, slot: int) -> None:
        """A request now uses `slot`: it holds nothing kept until it is released."""
        self.held[slot] = Held(released=self.held[slot].released)

    def release(self, slot: int, prompt: Sequence[int], *, draft_prefilled: bool) -> Held:
        """The row that used `slot` is finished: it keeps the whole chunks of `prompt` (its
        target's, and its draft's when its draft was prefilled in chunks at its start)."""
        self._clock += 1
        kept = kept_prefix(prompt) if self.keep else ()
        held = Held(kept, kept if draft_prefilled and self.keep else None, self._clock)
        self.held[slot] = held
        return held

    def extendable(self, free: Sequence[int], ids: Sequence[int]) -> int | None:
        """The free slot whose target row holds the longest prefix of `ids` (the most recently
        released among equals), or None."""
        fits = [s for s in free if self.keep and
                tuple(ids[:len(self.held[s].target)]) == self.held[s].target]
        return max(fits, key=lambda s: (len(self.held[s].target), self.held[s].released),
                   default=None)

    def forget(self) -> None:
        """Keep nothing (after a failed call, the rows' contents are not trusted)."""
        self.held = [Held(released=h.released) for h in self.held]


def feed_row(model: OrtModel, cache: KVCache, slot: int, ids: Sequence[int], end: int) -> None:
    """Feed `ids[:end]` to row `slot` after its valid length, in `prefill_chunks`, no logits
    used."""
    start = int(cache.lengths[slot])
    if start < end:
        for a, b in prefill_chunks(start, end):
            model.feed_rows(cache, np.asarray([slot]), np.asarray([ids[a:b]], np.int64),
                            np.asarray([b - a]))


def extend_end(ids: Sequence[int], limit: int) -> int:
    """How far `BatchDecoder.prefill_ahead` prefills `ids`: their whole chunks, below the
    context `limit` (a row needs room for at least one more token)."""
    return min(len(ids), limit - 1) // PREFILL_CHUNK * PREFILL_CHUNK
