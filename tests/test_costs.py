"""The cost table behind adaptive K: measured sizes by moving average, others by the line."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.runtime.costs import CostTable

sizes = st.lists(st.integers(1, 512), min_size=2, max_size=6, unique=True)


@settings(max_examples=100, deadline=None)
@given(sizes, st.floats(1e-4, 0.1), st.floats(0.0, 1e-3), st.integers(1, 512))
def test_a_linear_device_is_predicted_exactly_at_unmeasured_sizes(
        measured: list[int], fixed: float, per_token: float, asked: int) -> None:
    table = CostTable()
    for n in measured:
        table.record(n, fixed + per_token * n)
    assert table.cost(asked) == pytest.approx(fixed + per_token * asked, rel=1e-6, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(sizes, st.lists(st.floats(1e-4, 1.0), min_size=6, max_size=6))
def test_an_extrapolated_cost_never_falls_with_size(measured: list[int],
                                                    seconds: list[float]) -> None:
    """Noisy readings can make the fitted slope negative; it is clamped at 0, so a bigger call
    is never predicted cheaper than a smaller unmeasured one (which would make long drafts
    look free)."""
    table = CostTable()
    for n, s in zip(measured, seconds, strict=False):
        table.record(n, s)
    unmeasured = [n for n in range(1, 600) if n not in measured]
    costs = [table.cost(n) for n in unmeasured]
    assert all(c is not None and c > 0 for c in costs)
    assert all(a <= b + 1e-12 for a, b in zip(costs, costs[1:], strict=False))


def test_a_size_measured_often_follows_its_own_readings() -> None:
    table = CostTable()
    table.record(1, 1.0)
    table.record(8, 2.0)
    table.record(4, 5.0)  # far off the line through 1 and 8
    assert table.cost(4) != pytest.approx(5.0, rel=0.2)  # one reading: the line
    for _ in range(3):  # decayed weight 3.7 >= min_samples
        table.record(4, 5.0)
    assert table.cost(4) == pytest.approx(5.0)


def test_nothing_measured_is_none_and_a_fixed_cost_is_fixed() -> None:
    assert CostTable().cost(3) is None
    free = CostTable(fixed=0.0)
    free.record(3, 1.0)
    assert free.cost(3) == 0.0 and free.measured(7)


def test_a_slow_reading_is_undone_by_the_next_true_one() -> None:
    """Timing noise only adds time: a reading below the estimate replaces it, a higher one
    moves it by 5%, so a first call slowed by another program does not price the size for
    good (it did: 5% a reading, from probes that came every 16 to 256 rounds)."""
    table = CostTable()
    table.record(1, 2.0)  # slowed 2x
    table.record(1, 1.0)
    assert table.cost(1) == pytest.approx(1.0)
    table.record(1, 1.4)  # a real rise is followed, slowly
    assert table.cost(1) == pytest.approx(1.02)


def test_a_size_not_measured_lately_counts_less() -> None:
    """A size read once, slowly, long ago does not bend the line through sizes read since."""
    table = CostTable()
    table.record(3, 3.0)  # verify(3) of a slowed first round
    for _ in range(60):
        table.record(1, 1.0)  # plain decoding since
    table.record(2, 1.05)  # a probe
    assert table.cost(3) < 1.5  # mostly the line through 1 and 2 (before: 2.9)
