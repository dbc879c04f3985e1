"""Continuous batching: requests join a running speculative batch between rounds.

    server = ContinuousBatch(pair, capacity=4)
    first = server.submit("Hello", GenerationConfig(max_new_tokens=32))
    for request_id, result in server.step():   # one round; finished requests come back
        ...
    server.submit("Another prompt")             # joins at the next round
    results = server.run()                      # until every request is finished

Up to `capacity` requests decode together (one target call per round for all of them); more
wait in a queue and take the slot of the next finished request. Each request keeps its own
sampling parameters, seed, budget and stop strings, and gets exactly its batch-1 output. The
drafter, K and adaptivity belong to the server. Needs a `--graph concat` pair.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .batch import BatchDecoder, RowRequest, _Row
from .errors import InputError
from .pair import GenerationConfig, GenerationResult, Pair, Prompt, _RowText


@dataclass
class _Pending:
    request_id: int
    ids: list[int]
    config: GenerationConfig
    text: _RowText


class ContinuousBatch:
    """A running batch that takes new requests between rounds."""

    def __init__(self, pair: Pair, *, capacity: int = 8, max_len: int = 2048,
                 drafter: str | None = None, num_draft_tokens: int | None = None,
                 adaptive: bool | None = None, compact: bool = True) -> None:
        d = pair.manifest.defaults
        name = drafter or (d.drafter if pair.draft is not None else "none")
        use_draft = name != "none" and pair.draft is not None
        if name == "model" and pair.draft is None:
            raise InputError(f"drafter 'model' needs a draft model but {pair.manifest.root} "
                             "has none")
        limit = min(pair.manifest.target.max_seq_len,
                    pair.manifest.draft.max_seq_len if pair.manifest.draft else 1 << 30)
        self.pair = pair
        self.max_len = min(max_len, limit)
        k = num_draft_tokens or d.num_draft_tokens
        self.decoder = BatchDecoder(
            pair.target, pair.draft if use_draft else None, capacity=capacity,
            num_draft_tokens=k if use_draft else 0,
            adaptive=(d.adaptive if adaptive is None else adaptive) and use_draft,
            eos_token_ids=pair.manifest.eos_token_ids, max_len=self.max_len, compact=compact)
        self.queue: deque[_Pending] = deque()
        self.running: dict[int, tuple[_Pending, _Row]] = {}  # slot -> request
        self.next_id = 0

    def submit(self, prompt: Prompt, config: GenerationConfig | None = None) -> int:
        """Queue a request; it joins the batch at the next round with a free slot."""
        config = config or GenerationConfig()
        ids = self.pair.encode_prompt(prompt, chat=config.chat)
        if len(ids) + config.max_new_tokens + self.decoder.k_max + 1 > self.max_len:
            raise InputError(f"{len(ids)} prompt tokens + max_new_tokens "
                             f"{config.max_new_tokens} exceed the server's context of "
                             f"{self.max_len}")
        pending = _Pending(self.next_id, ids, config, _RowText(self.pair, ids, config.stop))
        self.next_id += 1
        self.queue.append(pending)
        return pending.request_id

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running)

    def step(self) -> list[tuple[int, GenerationResult]]:
        """Admit queued requests into free slots, run one round, return what finished."""
        while self.queue and self.decoder.has_room():
            p = self.queue.popleft()
            request = RowRequest(prompt=p.ids, max_new_tokens=p.config.max_new_tokens,
                                 params=p.config.sampling,
                                 stop=p.text.push if p.config.stop else None)
            row = self.decoder.add(request, p.config.sampling.make_rng())
            self.running[row.index] = (p, row)
        done = []
        for row in self.decoder.step():
            p, _ = self.running.pop(row.index)
            self.decoder.release(row)
            if not p.config.stop:
                p.text.push(row.generated)
            text, reason = p.text.finish(row.reason or "max_new_tokens")
            done.append((p.request_id, GenerationResult(
                text=text, tokens=row.generated, prompt_tokens=p.ids, stop_reason=reason,
                stats=row.stats)))
        return done

    def run(self) -> dict[int, GenerationResult]:
        """Step until every queued and running request is finished."""
        results: dict[int, GenerationResult] = {}
        while self.busy:
            results.update(self.step())
        return results
