"""How much of a concat-form host cache a call binds in place: the room, and the moves that
change it.

A concat-form graph reads each layer's past as one contiguous `[rows, heads, past, head_dim]`
array. A host cache laid out as `[2 x layers, batch, heads, room, head_dim]` is exactly that for
any run of neighbouring rows when `past` is the room, so a call of such rows binds the cache
itself and copies nothing in (`BatchRows._run_host_kv`); gathering the rows' pasts instead cost
2.9 ms of a 4-row round of the reference pair (`docs/results/serve.md`, session 56). The room is
kept a little above the longest row: grown in steps of `ROOM_STEP` positions as rows grow, shrunk
when every row is well below it, and re-laid in place in the one buffer of `max_len` positions a
row that the cache was allocated with.

What a call is padded to decides its rounding (its attention sums over `past + width` keys with
the holes masked), so:

- the choice is a pure function of the cache's lengths and room (`padded_past`);
- a cache on the device (`runtime/device_kv`) is never padded: it is gathered on the device
  whatever the padding, so there is no copy to save and padding would only change its rounding;
- a call of one row is never padded: a row alone (batch 1, a prompt's chunk) computes exactly
  what it always did;
- only fp32 models pad (`pads`). There a hole moves a logit by rounding (~1e-5, as the holes of
  the shorter rows of a batch always did). An int4 or int8 model may quantize its activations in
  the graph, which turns such a rounding difference into ~0.6 logits
  (`docs/results/batch_invariance.md`), so the other precisions keep the gather, which leaves
  the longest row of a call without holes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .manifest import ModelSpec

ROOM_STEP = 32  # positions: the room grows and shrinks by multiples of this
RUN_BLOCKS = 16  # blocks moved by one numpy assignment when the room changes


def pads(spec: ModelSpec) -> bool:
    """Whether a concat-form model's batched calls pad their rows to the room (see above)."""
    return spec.precision == "fp32"


def room_for(longest: int, max_len: int) -> int:
    """The room for rows of at most `longest` positions: rounded up to `ROOM_STEP`, at least one
    step, at most `max_len`."""
    steps = max(1, -(-longest // ROOM_STEP))
    return min(max_len, steps * ROOM_STEP)


def next_room(room: int, longest: int, max_len: int) -> int:
    """The room a cache should have when its longest row will hold `longest` positions: grown
    when they do not fit, shrunk when the room is more than a step above what they need (the
    step of slack keeps a row that rolls back and grows again from moving the cache each
    round), else unchanged."""
    want = room_for(longest, max_len)
    return want if longest > room or room > want + ROOM_STEP else room


def padded_past(room: int, fed: np.ndarray, contiguous: bool) -> int:
    """The past length a concat-form call pads its rows' pasts to, `fed` being their valid
    lengths: the room, bound in place, where two or more neighbouring rows are fed and the
    padding is narrower than both two steps and the longest past (what a gather would copy; an
    idle row kept long, as a prefix for later, makes the room too wide to pay for); else the
    longest, gathered."""
    longest = int(fed.max())
    if len(fed) > 1 and contiguous and room - longest < min(2 * ROOM_STEP, longest):
        return room
    return longest


def restride(flat: np.ndarray, blocks: int, old: int, new: int, width: int) -> None:
    """Re-lay the first `blocks` blocks of `old` x `width` elements of `flat` as blocks of `new`
    x `width`, in place, each keeping its first `min(old, new)` rows (what lies beyond them in a
    grown block is left as it was: masked positions).

    Growing moves the blocks from the last, shrinking from the first, `RUN_BLOCKS` at a time: no
    destination reaches a source not yet moved, and numpy buffers the overlap within a run, so
    no copy as large as the cache is made.
    """
    if new == old or blocks == 0:
        return
    keep = min(old, new)
    starts = range(0, blocks, RUN_BLOCKS)
    for a in (reversed(starts) if new > old else starts):
        b = min(blocks, a + RUN_BLOCKS)
        src = flat[a * old * width:b * old * width].reshape(b - a, old, width)
        dst = flat[a * new * width:b * new * width].reshape(b - a, new, width)
        dst[:, :keep] = src[:, :keep]
