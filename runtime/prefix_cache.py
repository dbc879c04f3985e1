"""Prompt prefixes kept between generations: a chat's next turn prefills only what is new.

A multi-turn chat (and a client of the server re-sending its conversation) starts every
generation with the tokens of the previous prompt. `PrefixCache` keeps the KV caches of finished
batch-1 generations and hands the next generation the one that shares the longest prefix with
its prompt; only the rest is prefilled (the idea of llama.cpp's `cache_prompt` and vLLM's prefix
caching).

Exactness: a generation that reuses a prefix computes exactly what it would compute from empty
caches, bit for bit, by construction rather than by tolerance:

- every prefill is fed in chunks cut at the multiples of `PREFILL_CHUNK` (absolute positions),
  so a cold prefill and a warm one run the same calls on the same tokens from the first chunk
  the warm one computes;
- only whole chunks of an earlier prompt are reused, and never its last two positions (a two-row
  step re-feeds the position before the one it feeds: the last prompt token at the first decode
  step, the one before it when the last chunk is a single token): positions that a prefill
  chunk wrote and that no later call rewrote;
- a cache is reused only at the length (capacity) a cold generation would allocate: caches are
  sized to powers of two (`cache_capacity`), so a conversation growing within one size keeps
  hitting, and kernels that might depend on the buffer's size see the same size.

A reply's keys and values were written by decode steps and verification blocks, not by prefill
chunks, so they are not reused as they are: `extend` (`Pair.prefill_ahead`) recomputes the
conversation so far in the chunks a cold prefill makes, once the reply has been shown, and the
next turn then prefills only its new message.

Chunking also bounds a long prompt's prefill memory (an attention call's scores grow with
chunk x past instead of prompt x prompt).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .kvcache import KVCache
from .logprobs import TokenLogprob, token_logprobs

if TYPE_CHECKING:  # the runtime's models; imported for types only
    from .backend import OrtModel

PREFILL_CHUNK = 128  # tokens per prefill call, cut at absolute positions
# The smallest cache a prefix-caching generation allocates: a conversation's first turns share
# one length (a cache is reused only at its own length), for 47 MiB of fp32 keys and values of
# the SmolLM2-135M reference target.
MIN_CAPACITY = 1024


def prefill_chunks(start: int, end: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """`[start, end)` cut at the multiples of `chunk`: the calls a prefill from `start` makes.

    >>> prefill_chunks(0, 300, 128)
    [(0, 128), (128, 256), (256, 300)]
    >>> prefill_chunks(256, 300, 128)
    [(256, 300)]
    """
    if not 0 <= start < end or chunk < 1:
        raise ValueError(f"prefill of [{start}, {end}) in chunks of {chunk}")
    bounds = [start, *range((start // chunk + 1) * chunk, end, chunk), end]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def reusable(cached: Sequence[int], prompt: Sequence[int], chunk: int = PREFILL_CHUNK) -> int:
    """How many leading tokens of `prompt` a cache holding `cached` (whole chunks of an earlier
    prompt) can skip: their common prefix, cut down to whole chunks, leaving at least one token
    of `prompt` to prefill (its last logits give the first new token)."""
    limit = min(len(cached), len(prompt) - 1)
    n = 0  # whole chunks compared at once (C speed: a batch asks this before every call)
    while n + chunk <= limit and tuple(cached[n:n + chunk]) == tuple(prompt[n:n + chunk]):
        n += chunk
    return n


def kept_prefix(prompt: Sequence[int], chunk: int = PREFILL_CHUNK) -> tuple[int, ...]:
    """The tokens of `prompt` whose keys and values a finished generation leaves as its prefill
    chunks wrote them: whole chunks, not the last two positions (two-row steps re-feed them)."""
    return tuple(prompt[: max(0, len(prompt) - 2) // chunk * chunk])


def cache_capacity(need: int, limit: int) -> int:
    """The cache length of a generation that needs `need` positions when prefixes are kept:
    the next power of two (at least `MIN_CAPACITY`), at most the context `limit`."""
    return min(limit, max(MIN_CAPACITY, 1 << max(0, need - 1).bit_length()))


def prefill(model: OrtModel, cache: KVCache, ids: Sequence[int], *, argmax: bool
            ) -> np.ndarray:
    """Feed `ids` after the cache's valid prefix (a reused one, or none) in `prefill_chunks`,
    and return the last position's argmax `[1]` (with `argmax`) or logits `[1, vocab]`."""
    chunks = prefill_chunks(int(cache.lengths[0]), len(ids))
    for a, b in chunks[:-1]:  # the last position's logits are the only ones used
        model.feed(cache, np.asarray([ids[a:b]], np.int64))
    a, b = chunks[-1]
    block = np.asarray([ids[a:b]], np.int64)
    if argmax:
        return model.forward_argmax(cache, block, last=True)[0]
    return model.forward(cache, block)[0, -1:]


def prompt_logprobs(model: OrtModel, ids: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """The log-probability of each token of `ids` after the first under `model`
    (`len(ids) - 1` entries, each with its `top` alternatives), from one prefill of `ids` in
    `prefill_chunks` on a new cache: what a completion with `echo` reports for its prompt."""
    cache = model.new_cache(1, len(ids))
    out: list[TokenLogprob] = []
    for a, b in prefill_chunks(0, len(ids)):
        logits = model.forward(cache, np.asarray([ids[a:b]], np.int64))[0]  # [b - a, vocab]
        n = min(b, len(ids) - 1) - a  # position i predicts token i + 1
        out.extend(token_logprobs(logits[:n], ids[a + 1:a + 1 + n], top))
    return out


def extend(entry: Entry, skip: int, ids: Sequence[int], models: Sequence[OrtModel | None],
           share_prompt_kv: bool = False) -> None:
    """Make `entry` hold the whole chunks of `ids` (up to its capacity), of which it holds the
    first `skip` tokens: both caches (`models`: the target's and the draft's) roll back to
    `skip` and are fed the rest in `prefill_chunks`, the calls a cold prefill of `ids` makes.
    With `share_prompt_kv` (a self-draft, `drafters.self_draft`) the draft's cache copies the
    target's new positions instead of computing them, as a cold generation's draft does."""
    end = min(len(ids), entry.capacity) // PREFILL_CHUNK * PREFILL_CHUNK
    if end <= skip:
        return
    target, draft = models
    assert target is not None
    entry.target.rollback(skip)
    feed(target, entry.target, ids[:end])
    if draft is not None and entry.draft is not None:
        entry.draft.rollback(skip)
        if share_prompt_kv and entry.draft.same_layout(entry.target):
            entry.draft.copy_from(entry.target, skip, end)
        else:
            feed(draft, entry.draft, ids[:end])
    entry.ids = tuple(ids[:end])


def feed(model: OrtModel, cache: KVCache, ids: Sequence[int]) -> None:
    """Feed `ids` after the cache's valid prefix in `prefill_chunks`; no logits are used (a
    draft's prefill)."""
    start = int(cache.lengths[0])
    if start < len(ids):
        for a, b in prefill_chunks(start, len(ids)):
            model.feed(cache, np.asarray([ids[a:b]], np.int64))


@dataclass
class Entry:
    """The caches of one finished generation: `ids`, the prompt tokens they hold (whole
    chunks); `capacity`, the length they were allocated at."""

    ids: tuple[int, ...]
    capacity: int
    target: KVCache
    draft: KVCache | None


class PrefixCache:
    """Up to `size` entries (0: none kept), the most recently used first; thread-safe. A
    generation takes an entry (no other generation can use it meanwhile) and puts one back when
    it ends."""

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"prefix cache size must be an integer >= 0, got {size!r}")
        self.size = size
        self._entries: list[Entry] = []
        self._lock = threading.Lock()

    def take(self, prompt: Sequence[int], capacity: int) -> tuple[Entry | None, int]:
        """The entry of `capacity` that lets `prompt` skip the most tokens (removed from the
        cache), and how many it skips; (None, 0) when none skips any."""
        with self._lock:
            best, best_n = None, 0
            for entry in self._entries:
                n = reusable(entry.ids, prompt) if entry.capacity == capacity else 0
                if n > best_n:
                    best, best_n = entry, n
            if best is not None:
                self._entries.remove(best)
            return best, best_n

    def take_extendable(self, ids: Sequence[int]) -> Entry | None:
        """The entry holding the longest prefix of `ids` (none, when that is all it holds:
        the caches of a prompt shorter than a chunk), removed from the cache; None when every
        entry holds tokens that `ids` do not start with."""
        with self._lock:
            fits = [e for e in self._entries if tuple(ids[:len(e.ids)]) == e.ids]
            best = max(fits, key=lambda e: len(e.ids), default=None)
            if best is not None:
                self._entries.remove(best)
            return best

    def put(self, entry: Entry) -> None:
        """Keep `entry`, the most recently used; the oldest beyond `size` go."""
        if not self.size:
            return
        with self._lock:
            self._entries.insert(0, entry)
            del self._entries[self.size:]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
