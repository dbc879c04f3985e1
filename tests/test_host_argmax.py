"""Host argmaxes of float16 logits on order keys: the same ids (ties to the lowest) and the
same finiteness verdicts as numpy's float argmax on the float32 values, for every bit pattern
(NaNs of either sign, +-inf, +-0, subnormals), and the model paths that use them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specedge.runtime import host_argmax

SPECIAL = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x0001, 0x8001, 0x7BFF, 0xFBFF,
           0x3C00, 0xBC00]


def _bits() -> st.SearchStrategy[int]:
    # A small pool per example makes ties common; specials and any pattern mixed in.
    return st.one_of(st.sampled_from(SPECIAL), st.integers(0, 0xFFFF),
                     st.integers(0x3800, 0x3C08))


@st.composite
def fp16_logits(draw: st.DrawFn) -> np.ndarray:
    shape = draw(st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 40)))
    pool = draw(st.lists(_bits(), min_size=1, max_size=6))
    bits = draw(hnp.arrays(np.uint16, shape, elements=st.sampled_from(pool)))
    return bits.view(np.float16)


@settings(max_examples=400, deadline=None)
@given(fp16_logits())
def test_order_keys_give_numpys_float_argmax(logits: np.ndarray) -> None:
    ref = logits.astype(np.float32)
    valid = np.ones(logits.shape[:-1], bool)
    valid.flat[::2] = False
    with np.errstate(invalid="ignore", over="ignore"):  # the reference's own NaN arithmetic
        want_ids = ref.argmax(-1)
        want_finite = bool(np.isfinite(np.take_along_axis(ref, want_ids[..., None], -1)).all())
        want_all = bool(np.isfinite(ref[valid].sum(dtype=np.float64)))
    keys = host_argmax.order_keys(logits)
    ids = host_argmax.argmax(keys)
    assert host_argmax.picked_finite(keys, ids) == want_finite
    if not np.isnan(ref).any():  # numpy picks the first NaN; such logits are refused anyway
        assert np.array_equal(ids, want_ids)
    assert host_argmax.finite_at(keys, valid) == want_all


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 3),
                                        st.integers(1, 20)),
                  elements=st.floats(width=32, allow_nan=True, allow_infinity=True)),
       st.integers(0, 2**9 - 1))
def test_float32_finiteness_at_the_fed_positions(logits: np.ndarray, mask: int) -> None:
    valid = np.asarray([(mask >> i) & 1 for i in range(logits.shape[0] * logits.shape[1])],
                       bool).reshape(logits.shape[:2])
    want = bool(np.isfinite(logits[valid]).all())
    assert host_argmax.finite_at(host_argmax.order_keys(logits), valid) == want


def test_float32_logits_are_used_as_they_are() -> None:
    logits = np.asarray([[[0.5, 2.0, 2.0, -np.inf]]], np.float32)
    keys = host_argmax.order_keys(logits)
    assert keys is logits
    assert host_argmax.argmax(keys).tolist() == [[1]]
    assert host_argmax.picked_finite(keys, host_argmax.argmax(keys))
    assert not host_argmax.finite_at(keys, np.ones((1, 1), bool))  # -inf at a fed position
    assert host_argmax.floats(logits) is logits
    assert host_argmax.floats(logits.astype(np.float16)).dtype == np.float32


def test_minus_zero_ties_with_zero_as_floats_do() -> None:
    logits = np.asarray([[[-0.0, 0.0, -1.0]]], np.float16)
    assert host_argmax.argmax(host_argmax.order_keys(logits)).tolist() == [[0]]
