"""The decoding worker behind `specedge serve`: one thread owns every decoding call.

The HTTP layer submits jobs and reads their events; it never decodes. One worker thread runs:

- for concat-form pairs, a `serving.ContinuousBatch`: jobs join the running batch between rounds
  (up to `max_batch` rows, one target call per round for all of them) and leave on completion,
  stop, cancellation or deadline, which frees their slot before the next round;
- for gqa-shared pairs (batch 1 only, see README "Graph forms"), a FIFO of batch-1
  `Pair.open` generations, one at a time.

Before it takes requests, `warm_up` decodes a few tokens of a short prompt through the same
engine (the server's lifespan does it before uvicorn listens): sessions, buffers and adaptive
K's tuner are warm for the first request instead of costing it.

Admission is bounded: at most `max_batch + max_queue` jobs are queued or running; one more is
refused with `QueueFull` (the server answers 429 with its `retry_after`). Cancellation is a flag
the worker reads before every round, so a cancelled job runs at most the round in flight.
Each job's events (`Delta`, `Finished`, `Failed`) go to its `sink`, called on the worker thread.

`Metrics` (`runtime/metrics`) holds the counters and histograms `/metrics` renders.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from .errors import InputError
from .generation import GenerationConfig, Prompt
from .job_engines import BatchEngine, SerialEngine
from .jobs import (
    Delta,
    Event,
    Failed,
    Finished,
    Job,
    QueueFull,
    SchedulerOptions,
    failure,
    log_failure,
)
from .metrics import Metrics
from .pair import Pair

log = logging.getLogger("specedge.serve")

__all__ = ["Delta", "Failed", "Finished", "Job", "QueueFull", "Scheduler",
           "SchedulerOptions"]


class Scheduler:
    """The worker thread and its bounded admission.

    Args:
        pair: a loaded pair (its sessions are used by the worker thread only).
        options: limits and the decoding plan.
        metrics: where finished jobs are counted (a new `Metrics` by default).
    """

    def __init__(self, pair: Pair, options: SchedulerOptions | None = None,
                 metrics: Metrics | None = None) -> None:
        self.pair, self.options = pair, options or SchedulerOptions()
        self.metrics = metrics or Metrics()
        self.batched = pair.manifest.target.graph == "concat"
        self.engine: BatchEngine | SerialEngine = (
            BatchEngine(pair, self.options) if self.batched else SerialEngine(pair))
        self.slots = self.options.max_batch if self.batched else 1
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._active = 0  # submitted and not ended
        self._running = 0  # published by the worker
        self._mean_s = 1.0  # running mean of request durations, for Retry-After
        self._closing = False
        self._thread: threading.Thread | None = None
        self.warmup_s = 0.0  # how long `warm_up` took (0: it did not run)
        self._warmed = False

    # -------------------------------------------------------------- called from any thread

    def start(self) -> None:
        """Start the worker (idempotent)."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specedge-decoder",
                                                daemon=True)
                self._thread.start()

    def warm_up(self) -> None:
        """Decode `options.warmup_tokens` tokens of a short prompt ("Hello", as a user turn when
        the pair has a chat template) with the server's plan, once, before the worker starts
        (on the calling thread; the worker owns every decoding call after).

        A prompt that does not fit the context is skipped with a warning; any other failure
        raises: a pair that cannot decode should not start serving.
        """
        o = self.options
        if not o.warmup_tokens or self._warmed or self._thread is not None:
            return
        self._warmed = True
        prompt: Prompt = ([{"role": "user", "content": "Hello"}]
                          if self.pair.tokenizer.has_chat_template else "Hello")
        config = GenerationConfig(max_new_tokens=o.warmup_tokens, drafter=o.drafter,
                                  num_draft_tokens=o.num_draft_tokens, adaptive=o.adaptive)
        start = time.perf_counter()
        room = self.context(config) - len(self.pair.encode_prompt(prompt))
        if room < o.warmup_tokens:  # as a request would be refused
            log.warning("warm-up skipped: %d tokens after its prompt exceed the context of "
                        "%d tokens", o.warmup_tokens, self.context(config))
            return
        try:
            self.engine.warm_up(prompt, config)
        except InputError as exc:
            log.warning("warm-up skipped: %s", exc)
            self.engine.fail_all()  # whatever the refused request left behind
            return
        self.warmup_s = time.perf_counter() - start
        log.info("warm-up: %d tokens in %.2f s", o.warmup_tokens, self.warmup_s)

    @property
    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return max(0, self._active - self._running)

    def context(self, config: GenerationConfig) -> int:
        """The context (prompt + generated tokens) a job with `config` gets."""
        plan = self.pair.plan(self._plan_config(config))
        return min(plan.limit, self.options.max_context)

    def _plan_config(self, config: GenerationConfig) -> GenerationConfig:
        if not self.batched:
            return config
        o = self.options
        return replace(config, drafter=o.drafter, num_draft_tokens=o.num_draft_tokens,
                       adaptive=o.adaptive)

    def submit(self, prompt: Prompt, config: GenerationConfig,
               sink: Callable[[Event], None], *, score_prompt: int | None = None,
               follow: Callable[[str], list[int]] | None = None) -> Job:
        """Queue a job; its events go to `sink` (called on the worker thread). With
        `score_prompt` (the alternatives per token), the worker fills `job.prompt_logprobs`
        before the job's first event. `follow`: the ids the conversation's next prompt starts
        with, given the reply (see `Job.follow`).

        Raises:
            QueueFull: `max_batch + max_queue` jobs are already queued or running.
        """
        job = Job(prompt, config, sink, self.options.request_timeout_s, score_prompt, follow)
        with self._cond:
            if self._closing:
                raise QueueFull(5)
            if self._active >= self.slots + self.options.max_queue:
                self.metrics.inc("specedge_rejected_total")
                waves = (self._active - self.slots) // self.slots + 1
                raise QueueFull(max(1, min(60, math.ceil(self._mean_s * waves))))
            self._active += 1
            self._inbox.append(job)
            self._cond.notify()
        self.start()
        return job

    def cancel(self, job: Job) -> None:
        """Ask the worker to end `job` (before its next round); no-op once it has ended."""
        if job.done or job.cancelled:
            return
        job.cancel_round = job.rounds
        job.cancelled = True
        with self._cond:
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker after the round in flight; unfinished jobs fail with "shutdown"."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -------------------------------------------------------------- the worker thread

    def _run(self) -> None:
        while True:
            with self._cond:
                busy = bool(self._inbox or self.engine.jobs or self._closing)
                work = None if busy else self.engine.idle_work()
                if work is None:
                    while not (self._inbox or self.engine.jobs or self._closing):
                        self._cond.wait()
                    new = list(self._inbox)
                    self._inbox.clear()
                    closing = self._closing
            if work is not None:  # nothing to decode: what the engine does ahead of requests
                work()
                continue
            if closing:
                for job in new + list(self.engine.fail_all()):
                    self._end(job, Failed("shutdown", "the server is shutting down"))
                return
            for job in new:
                self._admit(job)
            self._expire()
            if self.engine.jobs:
                self._round()
            self._running = self.engine.running

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self._end(job, Failed("cancelled", "cancelled"))
            return
        try:
            if job.score_prompt is not None:  # a model call: on this thread, as decoding
                job.prompt_ids = self.pair.encode_prompt(job.prompt, chat=job.config.chat)
                job.prompt_logprobs = self.pair.prompt_logprobs(job.prompt_ids,
                                                                job.score_prompt)
            self.engine.admit(job)
        except Exception as exc:
            log_failure(exc)
            self._end(job, failure(exc))

    def _expire(self) -> None:
        now = time.monotonic()
        for job in list(self.engine.jobs.values()):
            if job.cancelled or now > job.deadline:
                self.engine.drop(job)
                if job.cancel_round is not None:
                    job.rounds_after_cancel = job.rounds - job.cancel_round
                self._end(job, Failed("cancelled", "cancelled") if job.cancelled else
                          Failed("timeout", "the request ran past the server's limit of "
                                            f"{self.options.request_timeout_s:g} s"))

    def _round(self) -> None:
        for job, event in self.engine.round():
            self._end(job, event)

    def _end(self, job: Job, event: Failed | Finished) -> None:
        if job.done:
            return
        job.done = True
        job.emit(event)
        with self._cond:
            self._active -= 1
        elapsed = time.monotonic() - job.submitted
        self._mean_s = 0.8 * self._mean_s + 0.2 * elapsed
        self._count(job, event, elapsed)

    def _count(self, job: Job, event: Failed | Finished, elapsed: float) -> None:
        m = self.metrics
        m.observe("specedge_request_duration_seconds", elapsed)
        if isinstance(event, Failed):
            m.inc("specedge_generations_total", reason=event.reason)
            return
        result = event.result
        stats = result.stats
        m.inc("specedge_generations_total", reason=result.stop_reason)
        m.inc("specedge_prompt_tokens_total", len(result.prompt_tokens))
        m.inc("specedge_prompt_tokens_cached_total", stats.cached_tokens)
        m.inc("specedge_completion_tokens_total", len(result.tokens))
        m.inc("specedge_draft_tokens_proposed_total", stats.proposed)
        m.inc("specedge_draft_tokens_accepted_total", stats.accepted)
        m.inc("specedge_rounds_total", stats.rounds)
        if job.first_text_at is not None:
            m.observe("specedge_time_to_first_token_seconds", job.first_text_at - job.submitted)
            if len(result.tokens) > 1:
                m.observe("specedge_time_per_output_token_seconds",
                          (time.monotonic() - job.first_text_at) / (len(result.tokens) - 1))
