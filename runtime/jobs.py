"""What the serving worker works with (`runtime/scheduler`): its options, the jobs the HTTP
layer submits, and the events a job emits to its sink (`Delta`, `Finished`, `Failed`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import InputError, SpecEdgeError
from .generation import GenerationConfig, GenerationResult, Prompt
from .logprobs import TokenLogprob
from .rounds import RowOutput

log = logging.getLogger("specedge.serve")


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
    # the tokens committed since the previous delta, when the request asked for logprobs
    logprobs: tuple[TokenLogprob, ...] = ()


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
                 sink: Callable[[Event], None], deadline_s: float,
                 score_prompt: int | None = None,
                 follow: Callable[[str], list[int]] | None = None) -> None:
        self.prompt, self.config, self.sink = prompt, config, sink
        # The ids the conversation's next prompt starts with, given the reply (what an idle
        # worker prefills ahead), for a prompt rendered by its caller (a server's chat with
        # tools or thinking); None: `Pair.conversation_ids` of the prompt.
        self.follow = follow
        # n >= 0: the worker scores the prompt (its tokens' logprobs, n alternatives each)
        # before the job decodes, into `prompt_logprobs`, with its token ids in `prompt_ids`.
        self.score_prompt = score_prompt
        self.prompt_ids: list[int] = []
        self.prompt_logprobs: list[TokenLogprob] = []
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
        self.logprobs_sent = 0  # of `output.logprobs`, handed out with deltas

    def progress(self) -> bool:
        """Emit the text the output can hand out now (if any) as a `Delta`, with the logprobs
        of the tokens committed since the previous one; whether it emitted."""
        assert self.output is not None
        text = self.output.delta()
        if not text:
            return False
        new = self.output.logprobs[self.logprobs_sent:]
        self.logprobs_sent += len(new)
        self.emit(Delta(text, tuple(new)))
        return True

    def emit(self, event: Event) -> None:
        if isinstance(event, Delta) and self.first_text_at is None:
            self.first_text_at = time.monotonic()
        try:
            self.sink(event)
        except Exception:  # a sink whose client went away must not stop the worker
            log.debug("dropped an event for a closed request", exc_info=True)


Outcomes = list[tuple[Job, Finished | Failed]]


def failure(exc: Exception) -> Failed:
    """A decoding error as the client sees it: input errors say why, others say nothing."""
    if isinstance(exc, InputError):
        return Failed("input", str(exc))
    return Failed("internal", "decoding failed")


def log_failure(exc: Exception) -> None:
    if isinstance(exc, InputError):
        log.info("request refused by the runtime: %s", exc)
    elif isinstance(exc, SpecEdgeError):
        log.error("decoding failed: %s", exc)
    else:
        log.error("decoding failed", exc_info=exc)
