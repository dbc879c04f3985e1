"""`FedTokens`: a lagging draft's view of the committed text stays consistent through any
rounds (drafting with a catch-up cut to a window, rejected drafts rolled back, rounds the draft
does not see)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from specedge.runtime.fed_tokens import FedTokens

WINDOW = 4


@given(prompt=st.integers(1, 6), hold=st.booleans(),
       rounds=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 12)),
                       max_size=40))
def test_the_cache_holds_a_prefix_of_the_view(prompt: int, hold: bool,
                                             rounds: list[tuple[int, int, int]]) -> None:
    """Each round: (k, accepted, tokens the target adds at k = 0). Tokens are their positions
    in the text, so the view's gaps show; drafts carry ids no committed token has."""
    committed = list(range(prompt))
    fed = FedTokens()
    fed.reset(committed[:-1])  # prefilled: all but the last
    need = prompt - 1 if hold else 0
    for k, accepted, plain in rounds:
        if k == 0:  # the draft is not fed
            committed += range(len(committed), len(committed) + plain)
            continue
        assert fed.catch_up(committed, WINDOW, need) <= WINDOW
        fed.cut(committed, WINDOW, need)
        view = fed.view(committed)
        assert fed.lag(committed) <= WINDOW
        fed.tokens += view[len(fed.tokens):] + [-1 - i for i in range(k - 1)]  # the drafts
        accepted = min(accepted, k)
        committed += range(len(committed), len(committed) + accepted + 1)
        fed.commit(committed)
        view = fed.view(committed)
        assert fed.tokens == view[:len(fed.tokens)] and len(fed.tokens) <= len(view) - 1
        assert view[fed.seam:] == committed[fed.seam + fed.skipped:]  # the gap is one span
        assert fed.tokens[:prompt - 1] == committed[:prompt - 1]  # the prompt stays whole
        assert fed.seam >= prompt - 1 or not fed.skipped


def test_a_prompt_not_yet_fed_is_caught_up_whole() -> None:
    """A batch row whose draft prefill was deferred (nothing fed) catches up on its whole
    prompt: `hold` keeps the window off until the cache holds it."""
    fed, committed = FedTokens(), list(range(20))
    assert fed.catch_up(committed, WINDOW, hold=19) == 20
    fed.cut(committed, WINDOW, hold=19)
    assert fed.view(committed) == committed and not fed.skipped
    fed.tokens = committed[:-1]
    committed += range(20, 30)
    assert fed.catch_up(committed, WINDOW, hold=19) == WINDOW
    fed.cut(committed, WINDOW, hold=19)
    assert fed.view(committed) == committed[:19] + committed[26:] and fed.skipped == 7
