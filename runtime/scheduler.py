"""The decoding worker behind `specedge serve`: one thread owns every decoding call.

The HTTP layer submits jobs and reads their events; it never decodes. One worker thread runs:

- for concat-form pairs, a `serving.ContinuousBatch`: jobs join the running batch between rounds
  (up to `max_batch` rows, one target call per round for all of them) and leave on completion,
  stop, cancellation or deadline, which frees their slot before the next round;
- for gqa-shared pairs (batch 1 only, see README "Graph forms"), a FIFO of batch-1
  `Pair.stream` generations, one at a time.

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
from dataclasses import dataclass, replace
from typing import Any

from .errors import InputError, SpecEdgeError
from .metrics import Metrics
from .pair import GenerationConfig, GenerationResult, Pair, Prompt
from .rounds import RowOutput
from .serving import ContinuousBatch

log = logging.getLogger("specedge.serve")

__all__ = ["Delta", "Failed", "Finished", "Job", "QueueFull", "Scheduler",
           "SchedulerOptions"]


@dataclass(frozen=True)
class SchedulerOptions:
    """How the worker schedules.

    Attributes:
        max_batch: rows decoding together (concat pairs; gqa-shared pairs run one at a time).
        max_queue: jobs waiting beyond the running ones before `submit` refuses.
        request_timeout_s: a job still unfinished this long after submission is ended.
        max_context: prompt + generated tokens per job (also sizes the batch's KV cache).
        drafter, num_draft_tokens, adaptive: the decoding plan (None: the pair's defaults).
        warmup_tokens: tokens `warm_up` decodes (0: none).
        prefill_budget: prompt tokens a batch prefills between two rounds while rows decode
            (0: whole prompts at once).
    """

    max_batch: int = 4
    max_queue: int = 16
    request_timeout_s: float = 300.0
    max_context: int = 2048
    drafter: str | None = None
    num_draft_tokens: int | None = None
    adaptive: bool | None = None
    warmup_tokens: int = 8
    prefill_budget: int = 256


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    reason: str  # "cancelled" | "timeout" | "input" | "internal" | "shutdown"
    message: str


Event = Delta | Finished | Failed


class QueueFull(Exception):
    """The queue is full; try again in `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Job:
    """One generation request, as the worker sees it."""

    def __init__(self, prompt: Prompt, config: GenerationConfig,
                 sink: Callable[[Event], None], deadline_s: float) -> None:
        self.prompt, self.config, self.sink = prompt, config, sink
        self.submitted = time.monotonic()
        self.deadline = self.submitted + deadline_s
        self.cancelled = False  # set by any thread, read by the worker before each round
        self.done = False
        self.first_text_at: float | None = None
        self.rounds = 0  # rounds run while holding a slot
        self.cancel_round: int | None = None  # `rounds` when the cancel was asked
        self.rounds_after_cancel: int | None = None  # rounds run between cancel and release
        self.request_id = -1  # ContinuousBatch id
        self.output: RowOutput | None = None

    def emit(self, event: Event) -> None:
        if isinstance(event, Delta) and self.first_text_at is None:
            self.first_text_at = time.monotonic()
        try:
            self.sink(event)
        except Exception:  # a sink whose client went away must not stop the worker
            log.debug("dropped an event for a closed request", exc_info=True)


# ------------------------------------------------------------------------------- engines

Outcomes = list[tuple[Job, Finished | Failed]]


def _failure(exc: Exception) -> Failed:
    """A decoding error as the client sees it: input errors say why, others say nothing."""
    if isinstance(exc, InputError):
        return Failed("input", str(exc))
    return Failed("internal", "decoding failed")


def _log_failure(exc: Exception) -> None:
    if isinstance(exc, InputError):
        log.info("request refused by the runtime: %s", exc)
    elif isinstance(exc, SpecEdgeError):
        log.error("decoding failed: %s", exc)
    else:
        log.error("decoding failed", exc_info=exc)


class _BatchEngine:
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
                self.batch.prefill_ahead(self.pair.conversation_ids(
                    job.prompt, reply, chat=job.config.chat))
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
            finished = self.batch.step()
        except Exception as exc:
            _log_failure(exc)
            return [(job, _failure(exc)) for job in self.fail_all()]
        holding = {p.request_id for p, _ in self.batch.running.values()}
        holding.update(rid for rid, _ in finished)
        for rid in holding:
            job = self.jobs[rid]
            job.rounds += 1
            assert job.output is not None
            if text := job.output.delta():
                job.emit(Delta(text))
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


class _SerialEngine:
    """Jobs as batch-1 `Pair.stream` generations, first in first out (gqa-shared pairs)."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.fifo: deque[Job] = deque()
        self.current: Job | None = None
        self.stream: Any = None
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
                self.pair.prefill_ahead(self.pair.conversation_ids(
                    job.prompt, self.reply, chat=job.config.chat))
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
                self.stream = self.pair.stream(job.prompt, job.config)
            text = next(self.stream)
        except StopIteration as stop:
            self.current = self.stream = None
            result: GenerationResult = stop.value
            if self.pair.prefixes.size:
                self.ahead, self.reply = job, result.text
            return [(job, Finished(result))]
        except Exception as exc:
            self.current = self.stream = None
            _log_failure(exc)
            return [(job, _failure(exc))]
        job.rounds += 1
        job.emit(Delta(text))
        return []

    def fail_all(self) -> list[Job]:
        jobs = list(self.jobs.values())
        if self.stream is not None:
            self.stream.close()
        self.current = self.stream = None
        self.fifo.clear()
        return jobs


# ------------------------------------------------------------------------------- scheduler


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
        self.engine: _BatchEngine | _SerialEngine = (
            _BatchEngine(pair, self.options) if self.batched else _SerialEngine(pair))
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
               sink: Callable[[Event], None]) -> Job:
        """Queue a job; its events go to `sink` (called on the worker thread).

        Raises:
            QueueFull: `max_batch + max_queue` jobs are already queued or running.
        """
        job = Job(prompt, config, sink, self.options.request_timeout_s)
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
            self.engine.admit(job)
        except Exception as exc:
            _log_failure(exc)
            self._end(job, _failure(exc))

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
