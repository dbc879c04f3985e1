"""Adaptive draft length: `AdaptiveK` chooses k each round from the measured per-position
acceptance and the measured costs of a draft step and of verifying k+1 positions (the
expected-speed-up formula of Leviathan et al., with measured verify cost), and falls back to
k=0 (target only) when no k is predicted to beat it. Batch 1 (`runtime/speculative`) and
batches (`runtime/batch`) use it; `tuner_store.TunerStore` keeps what generations learned,
per (batch size, drafter, k max), for the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

from .costs import CostTable

FREE = -1  # `_realized`'s kind of rounds that verified free n-gram hits only


class AdaptiveK:
    """Pick the draft length that maximizes predicted tokens per second, from measurements.

    Model: position i of a round is reached only if drafts 1..i-1 were accepted; a(i) estimates
    "accepted, given reached" at position i (acceptance is not independent across positions, so
    one global rate mispredicts). k drafts then emit E(k) = 1 + sum_{j<=k} prod_{i<=j} a(i)
    tokens per round, at a cost of first + (k - 1) * draft_step + verify(k + 1); k = 0 is plain
    target decoding, cost verify(1). `first` is the round's first draft call, which feeds what
    the target committed since the draft's last call (`first_width` tokens a row: 2 after a
    full accept, 1 after a rejection), `draft_step` a one-token call.

    - a(i) = (hits_i + shrink * a(i-1)) / (reached_i + shrink), a(0) = `prior`, from counts
      that decay by `accept_decay` per observation (about 50 rounds: fewer made a 0.6
      acceptance read as 0.4 and switch drafting off): a position seen in a few rounds stays
      near its shallower neighbour instead of following two unlucky probes (which kept k at 3
      where the drafts accept 97% at every depth), and one seen often follows its own counts.
      Position 1 takes the larger of its own rate and its rate shrunk toward the prior:
      drafting measures acceptance and k = 0 does not, so a pessimistic estimate stays while
      an optimistic one is corrected by the rounds it drafts (one rejected draft in a server's
      8-token warm-up read as acceptance 0 and kept drafting off for every request after it;
      shrinking a lucky first round's 2 of 2 down kept a cold generation at k = 0).
      The counts also age while nothing is drafted, by `PLAIN_AGE` a plain round, down to
      `AGE_FLOOR` readings a row: acceptance belongs to the stretch of text it was read in, and
      a long text whose opening drafts were mostly rejected kept that reading at k = 0 to its
      end (simulated: 60 such rounds, then 400 that would accept 90%, drafted in none of
      them). Down to the floor, one lucky probe round of a batch does not read as a new text.
    - verify(s) and the draft calls come from `costs.CostTable`s keyed by the tokens a call
      feeds (live rows x positions), so a batch whose rows finish at different times compares
      its plain and drafting rounds at the rows it has now (`rows`), and a first draft call
      that feeds two tokens a row is priced as such: a gqa-shared draft in a batch runs it as
      two one-token calls (GroupQueryAttention), and priced as one step it made k = 1 look 2x
      cheaper than it was (the batching server drafted at 3-4 rows where it lost).
    - verify(1), plain decoding, is measured first: the round after the first drafting round
      runs at k = 0 (one target-only round, never slower than plain decoding). Drafting is
      chosen only when predicted `MIN_GAIN` (3%) faster than k = 0; until the draft calls
      were read in `TRUST_READINGS` rounds, k = 0 re-reads `k_start` at once (cold rounds read
      slow).
    - In a batch, what rounds realized overrules the model: when drafting lately gave fewer
      tokens a second than plain rounds at the same rows (measured in at least `REALIZED_MIN`
      rounds, decayed by `REALIZED_DECAY` a round since, separate catch-ups left out; plain
      rounds as predicted until they ran as many), k = 0 is chosen (the batching server under
      4 clients on 2 cores drafted at 3-4 rows where the model predicted a gain: realized 131
      against 136 tok/s, 76 against 105). Decayed, the readings of drafting left alone fade
      below `REALIZED_MIN` in a few hundred rounds, so the model decides again and the round
      it drafts renews the reading. Leaving k = 0 also pays the tokens the lagging draft feeds
      first (`_lag_cost`).
    - Every `probe_every` rounds a neighbouring k is tried so that the costs and acceptances it
      relies on stay measured; a probe that does not change the choice doubles the interval (up
      to `max_probe_every`), because a probe is not free. The draft model is not fed while
      k = 0, and a catch-up feeds at most its last `CATCH_UP_WINDOW` tokens a row
      (`fed_tokens`); a probe up from k = 0 is skipped only when it would first feed a
      row's whole deferred draft prefill (a batch row that joined at k = 0). Fed in full, at
      batch 8 on a CPU one catch-up late in a 64-token generation cost 0.37 s, 13
      target-only rounds, and such probes were skipped, so a text (a batch's: its rows) that
      went to k = 0 stayed there to its end. A probe due during a new generation (whose draft
      starts from its prefill) runs at its first round instead, so probes keep their doubling
      interval. For the same reason a choice to leave k = 0 while
      the draft lags must save its catch-up within the next probe interval, and a batch's
      choice to draft at a text's start must save the rows' draft prefills (deferred at
      k = 0) within the text; both priced by the draft's measured calls (`record_feed`), in
      tokens of text left. A probe that
      changes nothing also waits until its cost (beyond a plain round, plus any draft prefill
      or catch-up it needed: `add_probe_cost`) is at most `PROBE_SHARE` of the rounds between.

    A tuner outlives one generation: `Pair` keeps one per (batch size, drafter, k max), so every
    generation after the first starts from what this device measured; `new_text` discounts the
    acceptance counts the last generation observed (acceptance belongs to the text, costs to
    the device).
    """

    MIN_COST_SAMPLES = 3.0
    TRUST_READINGS = 2  # rounds whose draft calls were read before drafting may turn off
    # A lagging draft catches up on at most this many tokens a row (`fed_tokens`): 8 cut its
    # context so short that the first round after read acceptance 0.48 where a full catch-up
    # read 0.96 (the reference pair, greedy, 30 rounds at k = 0 before each; 32: 0.88), and a
    # probe then judged drafting by it.
    CATCH_UP_WINDOW = 32
    # Acceptance read before k = 0 ages by this a plain round, down to AGE_FLOOR readings a row
    # (the docstring).
    PLAIN_AGE = 0.99
    AGE_FLOOR = 2.0
    JOIN_PROBE_AT = 4  # rounds into a joining row that a due probe runs (`draft_fed`)
    PROBE_SHARE = 0.02  # an unfruitful probe may cost this share of the rounds till the next
    MAX_COSTLY_PROBE_EVERY = 4096
    MIN_GAIN = 0.03  # drafting is chosen over plain decoding only when predicted this much faster
    REALIZED_MIN = 3.0  # decayed rounds at these rows before their realized rate overrules
    # Per round since a reading: a verdict lasts a few hundred rounds, and once it faded one
    # drafting round renews it (at 0.98 it faded in ~50 rounds and took 4 losing rounds to
    # renew: a tenth of the 4-row rounds under load drafted at a loss).
    REALIZED_DECAY = 0.995

    def __init__(self, k_max: int, *, k_start: int = 2, decay: float = 0.95,
                 accept_decay: float = 0.98, shrink: float = 4.0, prior: float = 0.7,
                 probe_every: int = 16,
                 max_probe_every: int = 256, draft_step: float | None = None) -> None:
        self.k_max = k_max
        self.k = self.k_start = min(k_start, k_max)
        self.decay, self.accept_decay = decay, accept_decay
        self.shrink, self.prior = shrink, prior
        self.hits = [0.0] * (k_max + 1)  # decayed "accepted" counts per draft position (1-based)
        self.reached = [0.0] * (k_max + 1)  # decayed "reached" counts per position
        self.accept = [prior] * (k_max + 1)  # a(i), derived from the counts
        # Seconds of a draft call by tokens fed (rows x width; fixed 0 for free drafts), and of
        # a target call by tokens verified (rows x positions).
        self.draft = CostTable(decay, self.MIN_COST_SAMPLES, fixed=draft_step)
        # Tokens a row that a round's first draft call feeds after a drafting round (moving
        # average; after k = 0 rounds it also feeds their tokens, a one-off catch-up).
        self.first_width: float | None = None
        self._drafted = False  # the last round drafted
        self.draft_rounds = 0  # rounds whose draft calls were measured
        self.verify = CostTable(decay, self.MIN_COST_SAMPLES)
        self.rows = 1  # live rows of the next round
        self.rounds = 0
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self.interval = probe_every
        self.next_probe = probe_every
        self.probing = False  # the current k is a probe
        self._best_at_probe: int | None = None
        self._probes = 0
        self._last_probe = 0  # rounds at the last probe
        self.catch_up = 0  # the most tokens a row's draft would feed before drafting
        self.catch_up_tokens = 0  # all rows' tokens a separate catch-up call would feed (0:
        # none, the first draft call feeds them)
        # Seconds of a draft call outside drafting (a prefill, a catch-up) by tokens fed (rows
        # x width): apart from the steps, whose rows carry a past (at batch 8 on a CPU, mixed
        # in, short prompts' prefills priced a 4-row step at 14 ms and adaptive K drafted at a
        # loss: 0.77x).
        self.feeds = CostTable(decay, self.MIN_COST_SAMPLES)
        self._text_prefill: tuple[int, ...] = ()  # prompts whose draft prefill waits
        self._observed = False  # drafts were verified since the text started
        self._probe_cost = 0.0  # seconds the current probe cost beyond a plain round
        self.text_rounds: float | None = None  # rounds per text (moving average)
        self.text_tokens: float | None = None  # tokens per row per text (moving average)
        self._tokens_now = 0.0  # tokens per row so far in this text
        self._text_start = 0
        self.tokens_left: int | None = None  # the most tokens a live row may still generate
        # (rows, drafted) -> [rounds, tokens a row, seconds, round of the last reading]: batched
        # rounds realized, decayed by REALIZED_DECAY a round (`realized_rate`).
        self._realized: dict[tuple[int, int], list[float]] = {}

    def new_text(self, carry: float = 0.3, prefill: Sequence[int] = (),
                 rows: int | None = None) -> None:
        """A new generation starts: keep the measured costs (a property of the device), but
        discount the acceptance counts to `carry` of their weight (a property of the text) so
        the new prompt's own rounds take over within a few rounds, and choose k again.

        `prefill`: the lengths of the prompts the draft is prefilled with (one call each) only
        if this text starts drafting (a batch defers the prefill at k = 0); drafting must then
        save those prefills within the text (once a feed was measured). `rows`: the
        text's rows (a batch's prompts)."""
        if rows:
            self.rows = rows
        if self._observed:
            # Only what the last text observed is discounted: after texts at k = 0 throughout,
            # compounded discounts left nothing, and one probe round of 8 rows that all
            # accepted read as acceptance 1.0 at every depth and switched to k = 4 (batch 8).
            self.hits = [h * carry for h in self.hits]
            self.reached = [n * carry for n in self.reached]
            self._estimate_acceptance()
            self._observed = False
        self.catch_up = 0  # the draft starts from the new prompt's prefill
        self.catch_up_tokens = 0
        self.tokens_left = None  # the last text's rows are gone; its rounds will say
        self._text_prefill = tuple(prefill)
        if self.rounds > self._text_start:
            n = float(self.rounds - self._text_start)
            self.text_rounds = n if self.text_rounds is None else 0.7 * self.text_rounds + 0.3 * n
            t = self._tokens_now
            self.text_tokens = t if self.text_tokens is None else 0.7 * self.text_tokens + 0.3 * t
        self._tokens_now = 0.0
        self._text_start = self.rounds
        cost, plain = self._catch_up_cost(), self.verify_cost(1)
        if self.k == 0 and cost and plain:
            # A probe up from k = 0 now would prefill every row's draft: it waits until that
            # costs at most PROBE_SHARE of the rounds since the last probe (batch 8, chat
            # prompts on a CPU: the first probe after the warm-up cost 0.5 s, 17 rounds).
            self.next_probe = max(self.next_probe, self._last_probe + min(
                int(cost / (self.PROBE_SHARE * plain)), self.MAX_COSTLY_PROBE_EVERY))
        if self.k == 0 and (self.text_rounds is None
                            or self.next_probe <= self.rounds + self.text_rounds):
            # A probe due during this text runs now, while catching up is cheap (later it
            # would be skipped); one due later waits for a later text.
            self.next_probe = min(self.next_probe, self.rounds)
        if self.draft_step is not None:
            self.k = self.choose()

    def draft_fed(self) -> None:
        """A row joined, alone, with its draft fed up to its prompt (continuous batching, whose
        rows join at any round and start no text: `new_text`): at k = 0 a probe due within the next
        interval runs a few rounds into the row (`JOIN_PROBE_AT`), while its catch-up is cheap.
        Without this a server's probes fell mid-request, were all skipped, and a tuner at k = 0
        stayed there for every request after. Not at the row's first round: the first token of
        a reply is where a draft most often disagrees (a chat prompt's opening word), and one
        such probe per request kept a server's acceptance estimate low."""
        if self.k == 0 and self.next_probe <= self.rounds + self.interval:
            self.next_probe = min(self.next_probe, self.rounds + self.JOIN_PROBE_AT) \
                if self.next_probe > self.rounds else self.rounds + self.JOIN_PROBE_AT

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def add_probe_cost(self, seconds: float) -> None:
        """Time spent only because the current k is a probe (the draft's prefill for a
        generation that starts with one); it spaces out the next probes (`PROBE_SHARE`)."""
        if self.probing:
            self._probe_cost += seconds

    def record_feed(self, tokens: int, seconds: float) -> None:
        """Record a draft call that fed `tokens` tokens (rows x width) outside drafting: a
        prefill or a catch-up; it prices the next ones by their size."""
        if tokens > 0:
            self.feeds.record(tokens, seconds)

    def update(self, k: int, accepted: int, draft_step_s: float, draft_step_calls: int,
               verify_s: float, catch_up: int = 0,
               first_call: tuple[int, int, float] | None = None,
               tokens_left: int | None = None, catch_up_tokens: int = 0) -> None:
        """Record one round: k proposed, `accepted` of them accepted, and its costs;
        `catch_up`: tokens the draft would feed before drafting in the next round (its first
        draft call feeds them: `ModelDrafter`); `first_call`, `tokens_left`,
        `catch_up_tokens`: see `update_batch`."""
        self.update_batch(k, [(k, accepted)], draft_step_s, draft_step_calls, verify_s,
                          catch_up, catch_up_tokens=catch_up_tokens, first_call=first_call,
                          tokens_left=tokens_left)

    @property
    def draft_step(self) -> float | None:
        """Seconds of a one-token draft call at the current rows (None: not measured yet)."""
        return self.draft.cost(self.rows)

    def draft_cost(self, k: int) -> float | None:
        """Seconds of a round's k draft calls at the current rows: the first feeds
        `first_width` tokens a row, the others one (None: not measured yet)."""
        step = self.draft_step
        if k == 0 or step is None:
            return 0.0 if k == 0 else None
        first = self.draft.cost(max(self.rows, round(self.rows * (self.first_width or 1.0))))
        return (step if first is None else first) + (k - 1) * step

    def record_verify(self, size: int, verify_s: float, rows: int = 1) -> None:
        """Record only the cost of verifying `size` positions for `rows` rows (a round whose k
        this tuner did not choose)."""
        self.verify.record(rows * size, verify_s)

    def free_round(self, size: int, verify_s: float, tokens: int, seconds: float,
                   rows: int = 1) -> None:
        """Record a round that verified free n-gram drafts and ran no draft call (hybrid
        drafting; its k was not this tuner's): verifying `size` positions for `rows` rows took
        `verify_s`, and the round gave `tokens` (all rows) in `seconds` (`free_hits_pay`).

        The draft model now lags by the round's tokens, and the next drafting round's first
        call feeds them: a cost of the free round, so it stays out of `first_width`. Priced as
        every drafting round's (a first call of 7 tokens on average on the fast pair), it made
        k = 1 look ~10 ms dearer a round and turned drafting off where fixed K ran at 1.5x."""
        self.record_verify(size, verify_s, rows)
        self._drafted = False
        self._record_realized(rows, FREE, tokens, seconds)

    def free_hits_pay(self) -> bool:
        """Whether free n-gram hits are still verified while the draft model is off (k = 0):
        unless the rounds that verified them lately (`REALIZED_MIN` decayed rounds) gave fewer
        tokens a second than plain decoding. A verdict fades like `realized_rate`'s. With an
        fp32 target they are most of what hybrid drafting gains (stopped with the draft model,
        one rejected round cost the rest of the run: 1.00-1.11x where fixed K ran at 1.5x);
        on a quantized target, where verify(4) costs 1.5x verify(1), they lost 8% once. Not in
        a probe down to k = 0: it measures plain decoding."""
        if self.probing:
            return False
        free = self._rate((self.rows, FREE))
        plain = self.realized_rate(self.rows, 0) or self.expected_rate(0)
        return free is None or plain is None or free >= plain

    def update_batch(self, k: int, outcomes: list[tuple[int, int]], draft_step_s: float,
                     draft_step_calls: int, verify_s: float, catch_up: int = 0,
                     catch_up_s: float = 0.0, catch_up_tokens: int | None = None,
                     rows: int | None = None, next_rows: int | None = None,
                     first_call: tuple[int, int, float] | None = None,
                     realized: tuple[int, float] | None = None,
                     tokens_left: int | None = None) -> None:
        """Record one batched round: (proposed, accepted) per row, and the round's costs.

        The costs are those of the whole batch, so the chosen k maximizes the batch's rate.
        `catch_up`: the most tokens a row's draft would feed before drafting next round;
        `catch_up_tokens`: what a separate catch-up call would feed, rows x width (default
        `catch_up`; 0: no such call, the first draft call feeds them); `catch_up_s`: seconds
        of a separate catch-up call before this round's drafts; `rows`: the rows the round
        fed (default: one per outcome); `next_rows`: the rows the next round will feed
        (default `rows`), at whose costs its k is chosen;
        `first_call`: (rows, width, seconds) of the round's first draft call, when the caller
        keeps it apart (`draft_step_s` and `draft_step_calls` are then the one-token calls
        after it; without it every drafting call counts as a one-token step); `realized`:
        (tokens, seconds) the round gave all its rows, its catch-up left out; `tokens_left`:
        the most tokens a row live after the round may still generate (`rounds.tokens_left`),
        which bounds what leaving k = 0 can save before the rows it catches up finish.
        """
        rows = rows or len(outcomes)
        self.rounds += 1
        if realized is not None:
            self._record_realized(rows, min(k, 1), *realized)
        self.catch_up = catch_up
        self.catch_up_tokens = catch_up if catch_up_tokens is None else catch_up_tokens
        self.tokens_left = tokens_left
        self._text_prefill = ()  # the text has started: its prefill was made or deferred
        if outcomes:
            self._tokens_now += sum(a + 1 for _, a in outcomes) / len(outcomes)
        if self.probing:  # what the probe cost beyond a plain round
            plain = self.verify_cost(1)
            self._probe_cost += catch_up_s + max(
                0.0, draft_step_s + (first_call[2] if first_call else 0.0) + verify_s
                - (plain if plain is not None else verify_s))
        floor = self.AGE_FLOOR * rows
        if not any(p for p, _ in outcomes) and self.reached[1] > floor:
            age = max(self.PLAIN_AGE, floor / self.reached[1])
            self.hits = [h * age for h in self.hits]
            self.reached = [n * age for n in self.reached]
        for proposed, accepted in outcomes:
            self._observed |= proposed > 0
            for i in range(1, min(proposed, accepted + 1) + 1):
                self.reached[i] = self.accept_decay * self.reached[i] + 1.0
                self.hits[i] = self.accept_decay * self.hits[i] + (i <= accepted)
        self._estimate_acceptance()
        self.draft_rounds += bool(first_call or draft_step_calls)
        if first_call is not None:
            call_rows, width, seconds = first_call
            self.draft.record(call_rows * width, seconds)
            if self._drafted:
                self.first_width = width if self.first_width is None \
                    else 0.9 * self.first_width + 0.1 * width
        if draft_step_calls:
            self.draft.record(rows, draft_step_s / draft_step_calls)
        self.record_verify(k + 1, verify_s, rows)
        self.rows = next_rows or rows
        self._drafted = k > 0
        self.k = self.choose()

    def _record_realized(self, rows: int, kind: int, tokens: int, seconds: float) -> None:
        """`kind`: 0 plain rounds, 1 drafting ones (any k > 0), `FREE` free n-gram hits."""
        entry = self._realized.setdefault((rows, kind), [0.0, 0.0, 0.0, float(self.rounds)])
        fade = self.REALIZED_DECAY ** (self.rounds - entry[3])
        entry[:] = [entry[0] * fade + 1, entry[1] * fade + tokens / rows,
                    entry[2] * fade + seconds, float(self.rounds)]

    def realized_rate(self, rows: int, k: int) -> float | None:
        """Tokens a row a second that batched rounds at `rows` rows gave lately, as
        `expected_rate` counts them: plain rounds (k = 0) or drafting ones (any k > 0; apart
        by k, a server's readings were too few to tell); None: fewer than `REALIZED_MIN`
        decayed rounds."""
        return self._rate((rows, min(k, 1)))

    def _rate(self, key: tuple[int, int], least: float = REALIZED_MIN) -> float | None:
        """What the rounds of `key` realized; None: fewer than `least` decayed rounds."""
        entry = self._realized.get(key)
        if entry is None or entry[2] <= 0:
            return None
        if entry[0] * self.REALIZED_DECAY ** (self.rounds - entry[3]) < least:
            return None
        return entry[1] / entry[2]

    def _estimate_acceptance(self) -> None:
        prev = self.prior  # a(0)
        for i in range(1, self.k_max + 1):
            n, h = self.reached[i], self.hits[i]
            est = (h + self.shrink * prev) / (n + self.shrink)
            if i == 1 and n > 0:  # optimistic where few rounds were seen: see the docstring
                est = max(est, h / n)
            self.accept[i] = prev = est

    def verify_cost(self, s: int) -> float | None:
        """verify(s) for the current rows: measured where measured enough, else the line."""
        return self.verify.cost(self.rows * s)

    def expected_tokens(self, k: int) -> float:
        """Tokens per round at k (1 from the target plus the expected accepted drafts)."""
        total, reach = 1.0, 1.0
        for i in range(1, k + 1):
            reach *= self.accept[i]
            total += reach
        return total

    def expected_rate(self, k: int) -> float | None:
        """Predicted tokens per second at draft length k."""
        verify = self.verify_cost(k + 1)
        drafting = self.draft_cost(k)
        if verify is None or drafting is None:
            return None
        return self.expected_tokens(k) / (drafting + verify)

    def _catch_up_cost(self) -> float:
        """Seconds of feeding the draft before it can draft again: the rows' deferred draft
        prefills at a text's start (once a feed was measured; before, the first texts draft
        and measure it), or a catch-up call of its own (a batch's rows lagging by more than
        `batch.SEPARATE_CATCH_UP`; priced per step until a feed was measured), or the wider
        first draft call (`_lag_cost`); 0 when there is nothing to weigh."""
        if self._text_prefill:
            return sum(self.feeds.cost(n) or 0.0 for n in self._text_prefill)
        if not self.catch_up_tokens:
            return self._lag_cost()
        if self.feeds.mean:
            return self.feeds.cost(self.catch_up_tokens) or 0.0
        return self.catch_up * (self.draft_step or 0.0)

    def _lag_cost(self) -> float:
        """Seconds a first draft call after k = 0 rounds spends feeding their tokens beyond
        the `first_width` it feeds after a drafting round: a batch's gqa-shared draft feeds
        them one call a token (under 4 clients on 2 cores a lag of 5 made a k = 1 round 86 ms
        where it took 53)."""
        width = self.first_width or 1.0
        if self._drafted or not self.draft_rounds or self.catch_up <= width:
            return 0.0
        lagging = self.draft.cost(self.rows * self.catch_up)
        usual = self.draft.cost(max(self.rows, round(self.rows * width)))
        return max(0.0, lagging - usual) if lagging is not None and usual is not None else 0.0

    def choose(self) -> int:
        if self.draft_step is None and self.k > 0:
            return self.k  # no draft cost measured yet (e.g. no n-gram hit so far): keep trying
        if not self.verify.measured(self.rows):
            # Plain decoding's cost, verify(1), is measured by a round at k = 0 before any
            # choice: extrapolated from the drafting rounds' sizes it came out too dear, and a
            # cold tuner kept drafting for ~30 rounds where drafting does not pay (batch 8 on
            # a CPU: 0.88x of target-only over a 64-token batch).
            return 0
        rates = {k: self.expected_rate(k) for k in range(0, self.k_max + 1)}
        measured = {k: r for k, r in rates.items() if r is not None}
        best = max(measured, key=lambda k: measured[k]) if measured else self.k
        if best and 0 in measured and measured[best] < measured[0] * (1 + self.MIN_GAIN):
            best = 0  # near break-even the estimates' noise flipped k to drafts that lost
        plain_rate = self.realized_rate(self.rows, 0) or measured.get(0)
        done = self.realized_rate(self.rows, best) if best else None
        if done is None and best and self.k == 0 and self.catch_up <= self.CATCH_UP_WINDOW:
            # A verdict that faded stands; probes renew it, one round each and spaced by their
            # cost. Renewed by the model instead, each re-read paid a catch-up and a few losing
            # rounds, every 40-150 rounds (batch 2 on a CPU, sampled: 6% of the time in draft
            # calls). Not while a deferred draft prefill skips the probes.
            done = self._rate((self.rows, 1), least=0.0)
        if done is not None and plain_rate is not None and done < plain_rate:
            best = 0  # drafting lost in the rounds that ran it at these rows (the docstring)
        catch_up = self._catch_up_cost()
        if best and 0 in measured and catch_up > 0:
            # Leaving k = 0 first feeds the draft every token since; it must pay within the
            # next probe interval and what is left of this text (batch 8 on a CPU: one such
            # switch cost 0.8 s, 23 rounds; with the draft's prefill deferred, a whole
            # prefill). At a text's start drafting must pay the rows' draft prefills within
            # the text (batch 8 on a CPU: k = 1 predicted 4% faster did not pay 8 prefills).
            horizon = float(self.interval)  # tokens per row: the rounds at k = 0
            # A text already longer than the average ones says nothing about its end: its
            # budget bounds it (`tokens_left`); counting none left kept it at k = 0 to the end.
            left = None if self.text_tokens is None else self.text_tokens - self._tokens_now
            if left is not None and (left > 0 or self._text_prefill):
                horizon = max(0.0, left if self._text_prefill else min(horizon, left))
            if self.tokens_left is not None:
                # No row lives past its budget. A continuous batch starts no texts, and there
                # the probe interval (up to hundreds of rounds) let tail rows with a few
                # tokens left pay a whole deferred draft prefill (4 clients on 2 cores: 2-6
                # such rounds a pass, 100-350 ms each against 25-30 ms for a plain round).
                horizon = min(horizon, float(self.tokens_left))
            saving = horizon * (1 / measured[0] - 1 / measured[best])
            if saving < catch_up:
                best = 0
        if self._best_at_probe is not None:  # the round after a probe: did it change anything?
            changed = best != self._best_at_probe
            self.interval = self.probe_every if changed else min(2 * self.interval,
                                                                 self.max_probe_every)
            plain = self.verify_cost(1)
            if not changed and plain:
                # A dear probe (at batch 8 on a CPU, the draft's prefill for 8 prompts: 14
                # plain rounds) waits until it costs at most PROBE_SHARE of the rounds between.
                self.interval = max(self.interval, min(
                    int(self._probe_cost / (self.PROBE_SHARE * plain)),
                    self.MAX_COSTLY_PROBE_EVERY))
            self._probe_cost = 0.0
            self.next_probe = self.rounds + self.interval
            self._best_at_probe = None
        retry = (best == 0 and self.draft.fixed is None and not catch_up
                 and self.draft_rounds < self.TRUST_READINGS)
        if retry:
            # One drafting round does not turn drafting off: it is re-read now, while the
            # draft's catch-up is cheap. A cold process's first rounds read slow (the fast
            # pair's draft step 12.5 ms, verify(3) 29 ms; warm 9 and 23), and once at k = 0
            # the draft lags and every probe is skipped: a cold `specedge generate` ran
            # target-only to the end in 1 of 14 runs.
            self.next_probe = min(self.next_probe, self.rounds)
        self.probing = False
        if self.rounds >= self.next_probe:
            # Probe a neighbour so the costs and acceptances it relies on stay measured.
            self._probes += 1
            step = 1 if self._probes % 2 or best == 0 else -1
            probe = self.k_start if retry else max(0, min(self.k_max, best + step))
            if best == 0 and self.catch_up > self.CATCH_UP_WINDOW:
                probe = best  # a whole deferred draft prefill: more than the probe can tell
            if probe != best:
                self._best_at_probe, self.probing = best, True
                self._last_probe = self.rounds
                return probe
            self.next_probe = self.rounds + self.interval
        return best


def new_tuner(drafter: str, k_max: int) -> AdaptiveK:
    """Adaptive k for a drafter; n-gram drafts are free, so their cost is known up front."""
    return AdaptiveK(k_max, draft_step=0.0 if drafter == "ngram" else None)
