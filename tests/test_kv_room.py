"""A concat-form host cache's room (`runtime/kv_room`): neighbouring rows bound in place, the room
grown and shrunk in place, and every call computing what ONNX Runtime computes on the same
padded pasts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.runtime import kv_room
from specedge.runtime.kv_room import ROOM_STEP, next_room, padded_past, restride, room_for
from specedge.runtime.pair import Pair
from tests.concat_reference import assert_equals_session_run, pasts_of


@given(blocks=st.integers(0, 40), old=st.integers(1, 12), new=st.integers(1, 12),
       width=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_restride_keeps_every_blocks_first_rows(blocks: int, old: int, new: int, width: int,
                                                seed: int) -> None:
    rng = np.random.default_rng(seed)
    flat = rng.standard_normal(blocks * max(old, new) * width + 5)
    before = flat[:blocks * old * width].reshape(blocks, old, width).copy()
    tail = flat[blocks * max(old, new) * width:].copy()
    restride(flat, blocks, old, new, width)
    keep = min(old, new)
    after = flat[:blocks * new * width].reshape(blocks, new, width)
    assert np.array_equal(after[:, :keep], before[:, :keep])
    assert np.array_equal(flat[blocks * max(old, new) * width:], tail)  # nothing past the blocks


@given(room=st.integers(1, 300), longest=st.integers(0, 300), max_len=st.integers(1, 300))
def test_the_room_fits_the_rows_within_a_step_of_slack(room: int, longest: int,
                                                       max_len: int) -> None:
    longest, room = min(longest, max_len), min(room, max_len)
    got = next_room(room, longest, max_len)
    assert longest <= got <= max_len
    assert got <= room_for(longest, max_len) + ROOM_STEP  # never far above what rows need
    if longest <= room <= room_for(longest, max_len) + ROOM_STEP:
        assert got == room  # inside the slack: the cache is not moved


@given(room=st.integers(1, 300), fed=st.lists(st.integers(0, 300), min_size=1, max_size=6),
       contiguous=st.booleans())
def test_only_neighbouring_rows_are_padded_and_never_much(room: int, fed: list[int],
                                                          contiguous: bool) -> None:
    lengths = np.array(fed)
    room = max(room, int(lengths.max()))
    past = padded_past(room, lengths, contiguous)
    assert past in (room, int(lengths.max()))
    if past != int(lengths.max()):  # padded: a run of rows, holes narrower than the past
        assert contiguous and len(fed) > 1
        assert past - lengths.max() < min(2 * ROOM_STEP, lengths.max())


def test_one_row_is_never_padded() -> None:
    assert padded_past(64, np.array([40]), True) == 40


@pytest.fixture(scope="module")
def target(concat_dir: Path):  # noqa: ANN201
    return Pair.load(concat_dir).target


def test_neighbouring_rows_run_on_the_cache_itself(target, monkeypatch) -> None:  # noqa: ANN001
    """A batched call of neighbouring rows binds the cache as its pasts and computes what
    `session.run` computes fed those pasts padded to the room; rows out of order, or a lone row,
    are gathered as before. Before the room, every call gathered."""
    rng = np.random.default_rng(3)
    vocab = target.logits_size
    cache = target.new_cache(4, 200)
    for row, n in enumerate((70, 60, 75, 66)):
        target.feed_rows(cache, np.array([row]), rng.integers(3, vocab, (1, n)), np.array([n]))
    gathers = []
    original = cache.staging

    def staging(name: str, elements: int) -> np.ndarray:
        gathers.append(name)
        return original(name, elements)

    monkeypatch.setattr(cache, "staging", staging)
    for rows, lens, width, bound in (([0, 1, 2, 3], [4, 2, 4, 1], 4, True),
                                     ([1, 2], [2, 3], 3, True),
                                     ([2, 0], [1, 1], 1, False),
                                     ([3], [3], 3, False)):
        rows_a, lens_a = np.array(rows), np.array(lens)
        lengths, pasts = cache.lengths[rows_a].copy(), pasts_of(cache, rows_a)
        tokens = rng.integers(3, vocab, (len(rows), width))
        room = cache.room
        gathers.clear()
        got = target.forward_rows(cache, rows_a, tokens, lens_a)
        assert ("pasts" not in gathers) == bound
        past = room if bound else int(lengths.max())
        assert not bound or past > lengths.max()  # padded with holes
        assert_equals_session_run(target, cache, rows_a, pasts, lengths, tokens, lens_a, past,
                                  got)


def test_the_rows_survive_the_room_growing_and_shrinking(target) -> None:  # noqa: ANN001
    rng = np.random.default_rng(4)
    vocab = target.logits_size
    cache = target.new_cache(3, 300)
    rows = np.arange(3)
    target.forward_rows(cache, rows, rng.integers(3, vocab, (3, 20)), np.array([20, 12, 17]))
    seen = {cache.room}
    for _ in range(12):  # grow through several steps
        target.forward_rows(cache, rows, rng.integers(3, vocab, (3, 16)), np.full(3, 16))
        seen.add(cache.room)
    assert len(seen) >= 4 and cache.room >= int(cache.lengths.max())
    held = [cache.host[:, row, :, :int(n)].copy() for row, n in enumerate(cache.lengths)]
    cache.rollback(np.array([30, 25, 20]))  # all rows well below the room: it shrinks
    target.forward_rows(cache, rows, rng.integers(3, vocab, (3, 1)), np.ones(3, np.int64))
    assert cache.room == room_for(31, 300)
    for row, n in enumerate((30, 25, 20)):
        assert np.array_equal(cache.host[:, row, :, :n], held[row][:, :, :n])


def test_a_batch_of_rows_is_greedy_as_each_row_alone(concat_dir: Path) -> None:
    """End to end through the room's growth: a batch's greedy rows equal their batch-1 runs."""
    from specedge.runtime.pair import GenerationConfig

    pair = Pair.load(concat_dir)
    prompts = ["the quick brown fox", "a b c d e f g a b c", "once upon a time", "hi"]
    config = GenerationConfig(max_new_tokens=70, num_draft_tokens=3, adaptive=False)
    alone = [pair.generate(p, config).tokens for p in prompts]
    rooms: list[int] = []
    original = kv_room.next_room

    def spy(room: int, longest: int, max_len: int) -> int:
        rooms.append(original(room, longest, max_len))
        return rooms[-1]

    kv_room.next_room = spy  # type: ignore[assignment]
    try:
        batched = [r.tokens for r in pair.generate_batch(prompts, config).results]
    finally:
        kv_room.next_room = original  # type: ignore[assignment]
    assert batched == alone
    assert len(set(rooms)) >= 3  # the room grew as the rows did


def test_calls_on_the_same_buffers_keep_their_kv_binding(target) -> None:  # noqa: ANN001
    """Rounds at one width bind the 2 x layers pasts and presents once; a call on other buffers
    or shapes binds anew, and every call computes what a fresh cache computes."""
    rng = np.random.default_rng(6)
    vocab = target.logits_size
    cache, fresh = target.new_cache(4, 200), target.new_cache(4, 200)
    for c in (cache, fresh):
        target.forward_rows(c, np.arange(4), np.full((4, 40), 7),
                            np.array([40, 36, 38, 33]))
    tokens = rng.integers(3, vocab, (4, 4))
    first = target.forward_rows(cache, np.arange(4), tokens, np.full(4, 4))
    held = cache.host_binding
    cache.rollback(cache.lengths - 4)
    again = target.forward_rows(cache, np.arange(4), tokens, np.full(4, 4))
    assert cache.host_binding is held and np.array_equal(first, again)
    cache.rollback(cache.lengths - 4)
    other = target.forward_rows(cache, np.arange(4), tokens[:, :2], np.full(4, 2))
    assert cache.host_binding is not held
    want = target.forward_rows(fresh, np.arange(4), tokens, np.full(4, 4))
    assert np.array_equal(want, first)
    fresh.rollback(fresh.lengths - 4)
    assert np.array_equal(target.forward_rows(fresh, np.arange(4), tokens[:, :2],
                                              np.full(4, 2)), other)


steps = st.lists(st.tuples(st.lists(st.booleans(), min_size=4, max_size=4),  # rows fed
                           st.integers(1, 9),  # block width
                           st.lists(st.integers(0, 12), min_size=4, max_size=4)),  # rollbacks
                 min_size=1, max_size=14)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=steps, seed=st.integers(0, 2**16))
def test_any_call_sequence_agrees_with_the_gathered_cache(
        target, calls: list[tuple[list[bool], int, list[int]]], seed: int  # noqa: ANN001
) -> None:
    """Ragged calls, rollbacks, the room growing and shrinking: the padded cache gives what a
    cache that gathers every call gives, to rounding, and holds the same positions."""
    rng = np.random.default_rng(seed)
    vocab = target.logits_size
    padded = target.new_cache(4, 160)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kv_room, "pads", lambda spec: False)
        gathered = target.new_cache(4, 160)  # decides at allocation: gathers every call
    caches = (padded, gathered)

    for take, width, back in calls:
        rows = np.flatnonzero(take)
        if not len(rows):
            continue
        ends = padded.lengths[rows] + width
        lens = np.where(ends <= padded.max_len, width, 0)
        rows, lens = rows[lens > 0], lens[lens > 0]
        if not len(rows):
            continue
        tokens = rng.integers(3, vocab, (len(rows), width))
        got, want = (target.forward_rows(c, rows, tokens, lens) for c in caches)
        valid = np.arange(width)[None, :] < lens[:, None]
        assert np.abs(got - want)[valid].max() < 1e-4
        assert np.array_equal(padded.lengths, gathered.lengths)
        assert padded.lengths.max() <= padded.room <= padded.max_len
        shorter = np.maximum(padded.lengths - np.asarray(back), 0)
        for cache in caches:
            cache.rollback(shorter)
    for row, n in enumerate(padded.lengths):
        assert np.array_equal(padded.fed[row, :n], gathered.fed[row, :n])
        assert np.allclose(padded.host[:, row, :, :n], gathered.host[:, row, :, :n], rtol=0,
                           atol=1e-4)
