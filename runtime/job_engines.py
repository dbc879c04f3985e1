"""How the serving worker runs jobs (`runtime/scheduler`), one engine a pair:

- `BatchEngine`: jobs as rows of one `serving.ContinuousBatch` (concat-form pairs), joining and
  leaving between rounds, with finished conversations prefilled ahead into free slots;
- `SerialEngine`: jobs as batch-1 `Pair.open` generations, first in first out (gqa-shared
  pairs), with the last conversation prefilled ahead into the pair's prefix cache.

Both expose the same few calls (`admit`, `drop`, `round`, `fail_all`, `idle_work`, `warm_up`),
all made on the worker thread.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Generator

from .generation import GenerationConfig, GenerationResult, Prompt
from .jobs import Finished, Job, Outcomes, SchedulerOptions, failure, log_failure
from .pair import Pair
from .serving import ContinuousBatch
from .stats import GenerationStats

log = logging.getLogger("specedge.serve")


def _next_prompt(pair: Pair, job: Job, reply: str) -> list[int]:
    """The ids a finished job's conversation goes on with (`Job.follow`, else the pair's
    `conversation_ids`): what an idle engine prefills ahead."""
    if job.follow is not None:
        return job.follow(reply)
    return pair.conversation_ids(job.prompt, reply, chat=job.config.chat)


class BatchEngine:
    """Jobs as rows of one `ContinuousBatch` (concat-form pairs)."""

    def __init__(self, pair: Pair, options: SchedulerOptions) -> None:
        self.pair, self.options = pair, options
        self.batch = self._new_batch()
        self.jobs: dict[int, Job] = {}
        # Finished jobs and their replies, the latest last, for `idle_work` (with prefixes kept
        # in the batch's free slots: a pair loaded with a prefix cache).
        self.ahead: deque[tuple[Job, str]] = deque(maxlen=options.max_batch)

    def warm_up(self, prompt: Prompt, config: GenerationConfig) -> None:
        self.batch.submit(prompt, config)
        self.batch.run()

    def idle_work(self) -> Callable[[], None] | None:
        """With no job waiting: prefill the latest finished request's prompt and reply into
        the free slot that holds its prompt (`ContinuousBatch.prefill_ahead`); None when there
        is nothing to do."""
        if not self.ahead:
            return None
        job, reply = self.ahead.pop()

        def work() -> None:
            try:
                self.batch.prefill_ahead(_next_prompt(self.pair, job, reply))
            except Exception as exc:  # the kept prefixes are dropped; requests are not affected
                log.warning("prefilling a finished conversation ahead failed: %s", exc)

        return work

    def _new_batch(self) -> ContinuousBatch:
        o = self.options
        return ContinuousBatch(self.pair, capacity=o.max_batch, max_len=o.max_context,
                               drafter=o.drafter, num_draft_tokens=o.num_draft_tokens,
                               adaptive=o.adaptive, keep_prefixes=self.pair.prefixes.size > 0,
                               prefill_budget=o.prefill_budget or None)

    @property
    def running(self) -> int:
        return len(self.batch.running)

    def admit(self, job: Job) -> None:
        job.request_id = self.batch.submit(job.prompt, job.config)
        job.output = self.batch.output(job.request_id)
        self.jobs[job.request_id] = job

    def drop(self, job: Job) -> None:
        self.batch.cancel(job.request_id)
        self.jobs.pop(job.request_id, None)

    def round(self) -> Outcomes:
        """One round of the batch; a failure fails every job (the batch is rebuilt)."""
        try:
            self.batch.admit()
            for p, _ in self.batch.running.values():
                # A joined row's first token (from its prefill) is streamed now, not after the
                # round: time to first token was prefill + one round, a drafting one with
                # speculation (its solo p50 7-20 ms above plain decoding's).
                if (job := self.jobs.get(p.request_id)) is not None:
                    job.progress()
            finished = self.batch.decode()
        except Exception as exc:
            log_failure(exc)
            return [(job, failure(exc)) for job in self.fail_all()]
        holding = {p.request_id for p, _ in self.batch.running.values()}
        holding.update(rid for rid, _ in finished)
        for rid in holding:
            job = self.jobs[rid]
            job.rounds += 1
            job.progress()
        done = [(self.jobs.pop(rid), result) for rid, result in finished]
        if self.batch.decoder.prefixes.keep:
            self.ahead.extend((job, result.text) for job, result in done)
        return [(job, Finished(result)) for job, result in done]

    def fail_all(self) -> list[Job]:
        jobs = list(self.jobs.values())
        self.jobs.clear()
        self.ahead.clear()
        self.batch = self._new_batch()  # a failed round leaves no state worth keeping
        return jobs


class SerialEngine:
    """Jobs as batch-1 `Pair.open` generations (their output read between rounds, as
    `Pair.stream` does), first in first out (gqa-shared pairs)."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.fifo: deque[Job] = deque()
        self.current: Job | None = None
        self.stream: Generator[list[int], None, str] | None = None
        self.ids: list[int] = []
        self.stats = GenerationStats()
        self.ahead: Job | None = None  # the last finished job, for `idle_work`
        self.reply = ""

    def idle_work(self) -> Callable[[], None] | None:
        """With no job waiting: prefill the last finished request's prompt and reply into the
        kept caches (`Pair.prefill_ahead`), so that a client sending its conversation on
        prefills only its new message; None when there is nothing to do."""
        job, self.ahead = self.ahead, None
        if job is None:
            return None

        def work() -> None:
            try:
                self.pair.prefill_ahead(_next_prompt(self.pair, job, self.reply))
            except Exception as exc:  # the caches are dropped; requests are not affected
                log.warning("prefilling the last conversation ahead failed: %s", exc)

        return work

    def warm_up(self, prompt: Prompt, config: GenerationConfig) -> None:
        self.pair.generate(prompt, config)

    @property
    def jobs(self) -> dict[int, Job]:
        every = ([self.current] if self.current else []) + list(self.fifo)
        return {id(j): j for j in every}

    @property
    def running(self) -> int:
        return 1 if self.current else 0

    def admit(self, job: Job) -> None:
        self.fifo.append(job)

    def drop(self, job: Job) -> None:
        if job is self.current:
            if self.stream is not None:
                self.stream.close()  # ends the decode loop and frees its caches now
            self.current = self.stream = None
        elif job in self.fifo:
            self.fifo.remove(job)

    def round(self) -> Outcomes:
        """Run until the current job's next text delta (one round, or a few when stop-string
        prefixes hold text back); a failure fails the current job only."""
        if self.current is None:
            self.current = self.fifo.popleft()
        job = self.current
        try:
            if self.stream is None:
                self.stats = GenerationStats()
                self.ids, job.output, self.stream = self.pair.open(job.prompt, job.config,
                                                                   self.stats)
            while True:  # rounds until text can be handed out: one "round" of the job's
                next(self.stream)
                if job.progress():
                    job.rounds += 1
                    return []
        except StopIteration:
            self.current = self.stream = None
            assert job.output is not None
            result = GenerationResult.of(job.output, self.ids, self.stats)
            job.progress()  # what the detokenizer held back
            if self.pair.prefixes.size:
                self.ahead, self.reply = job, result.text
            return [(job, Finished(result))]
        except Exception as exc:
            self.current = self.stream = None
            log_failure(exc)
            return [(job, failure(exc))]

    def fail_all(self) -> list[Job]:
        jobs = list(self.jobs.values())
        if self.stream is not None:
            self.stream.close()
        self.current = self.stream = None
        self.fifo.clear()
        return jobs
