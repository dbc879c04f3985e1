"""One completion request through the server (`runtime/server`): its prompts fitted to the
context and submitted to the scheduler as jobs, one choice each (a completions request may send
several prompts, as evaluation harnesses batch them: they join the running batch together), and
their events turned into the response or its server-sent events, with each choice's echoed
prompt and logprobs. Any choice that fails fails the request, and the others are cancelled.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import InputError
from .generation import Prompt, prompt_ids
from .jobs import Delta, Failed, Finished, Job, QueueFull
from .logprobs import TokenLogprob
from .openai_api import APIError, ParsedRequest, error_body, parse_request
from .openai_logprobs import echo_logprobs_json, join_logprobs_json, logprobs_json
from .openai_messages import messages_field
from .openai_responses import (
    SSE_DONE,
    ResponseShape,
    assistant_message,
    finish_reason,
    sse,
    tool_calls_json,
)
from .pair import GenerationConfig, GenerationResult
from .prompting import reply_grammar
from .reasoning import ReasoningFormat
from .reply_reader import ReplyPart, ReplyReader
from .server_http import Bridge, GenerationStream, read_json
from .tool_calls import ToolFormat
from .tool_prompt import ToolPlan, has_tool_turns

if TYPE_CHECKING:
    from .server import ServerState

__all__ = ["complete"]

# How a worker-side failure reaches the client: status, error type.
_FAILED = {"input": (400, "invalid_request_error"), "timeout": (504, "timeout_error"),
           "cancelled": (499, "invalid_request_error"), "shutdown": (503, "server_error"),
           "internal": (500, "server_error")}


@dataclass
class _Choice:
    """One prompt of a request: its job, and what its stream has sent so far."""

    index: int
    prompt: Prompt
    job: Job
    echo: bool  # the echoed prompt is still to be sent (streams)
    told: int = 0  # tokens whose logprobs were sent
    sent: bytearray = field(default_factory=bytearray)  # their bytes (for text offsets)


async def complete(request: Request, state: ServerState, kind: str) -> Response:
    """`POST /v1/chat/completions` ("chat") or `POST /v1/completions` ("text")."""
    body = await read_json(request, state.options.max_body_bytes, state.options.receive_timeout_s)
    parsed = parse_request(kind, body, state.defaults)
    most = state.scheduler.slots + state.options.max_queue
    if len(parsed.prompts) * parsed.n > most:
        raise APIError(400, f"'prompt': {len(parsed.prompts)} prompts x n={parsed.n} choices, "
                            f"but this server takes at most {most} in one request (its "
                            "--max-batch + --max-queue); send fewer at a time",
                       param="n" if parsed.n > 1 else "prompt")
    fitted = await run_in_threadpool(_fit_all, state, parsed)
    shape = ResponseShape.new(kind, state.defaults.model)
    bridge = Bridge(asyncio.get_running_loop())
    choices = _submit(state, parsed, fitted, bridge)
    if parsed.stream:
        return GenerationStream(_events(shape, bridge, parsed, state, choices, fitted),
                                on_close=lambda: _cancel(state, choices))
    results = await _collect(request, bridge, choices, state)
    token_bytes = state.pair.tokenizer.token_bytes
    return JSONResponse(shape.body([
        (result, _result_logprobs(kind, parsed, choice, result, token_bytes),
         _echo_text(state, choice) if parsed.echo else "")
        for choice, result in zip(choices, results, strict=True)],
        read=[_read(fitted, r.text) for r in results], key=fitted.call_key))


@dataclass(frozen=True)
class _Fitted:
    """A request's prompts as submitted (a chat rendered here: tools, template variables or
    a reasoning model, as its ids), each one's config, and how its replies are read: for tool
    calls (`tools`) and thinking (`reasoning`; `inside`: the prompt opened the block), and for
    a chat rendered here, how the conversation goes on (`follow`)."""

    prompts: list[Prompt]
    configs: list[GenerationConfig]
    tools: ToolFormat | None = None
    reasoning: ReasoningFormat | None = None
    inside: bool = False
    # A chat rendered here: the ids its next prompt starts with, given a reply (`Job.follow`).
    follow: Callable[[str], list[int]] | None = None
    call_key: str = ""  # its replies' tool call ids are digests of this (`tool_calls_json`)

    def reader(self) -> ReplyReader | None:
        """A reader of one reply (None: its text is returned as it is)."""
        if self.tools is None and self.reasoning is None:
            return None
        return ReplyReader(self.tools, self.reasoning, self.inside)


def _read(fitted: _Fitted, text: str) -> tuple[ReplyPart, bool] | None:
    """What a whole reply holds (None: plain text), and whether it reasoned."""
    reader = fitted.reader()
    if reader is None:
        return None
    return reader.read(text), reader.reasoned


def _chat_prompt(state: ServerState, parsed: ParsedRequest) -> _Fitted:
    """A chat request that needs its prompt rendered here (tools or tool turns, template
    variables, or a reasoning model, whose prompt may open its thinking block), as its ids
    with the grammar of a reply of calls only ("required" or a named function); any other
    request as it came (configs filled in by `_fit_all`)."""
    messages = cast(list[dict[str, Any]], parsed.prompt)  # chat: the checked messages
    tooled = parsed.kind == "chat" and bool(parsed.tools or has_tool_turns(messages))
    if parsed.kind != "chat" or not (tooled or parsed.template_variables
                                     or state.pair.prompts.reasoning):  # read apart or not
        return _Fitted(list(parsed.prompts), [parsed.config])
    tokenizer = state.pair.tokenizer
    plan = ToolPlan.for_tokenizer(tokenizer, parsed.tools) if tooled else None
    variables = parsed.template_variables

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if plan:
            return plan.prompt_text(tokenizer, messages, variables,
                                    add_generation_prompt=add_generation_prompt)
        return tokenizer.render_chat(messages, variables=variables,
                                     add_generation_prompt=add_generation_prompt)

    try:
        text = render(messages)
        ids = tokenizer.encode_rendered(text)
    except InputError as exc:  # the template refuses the conversation, tools or variables
        raise APIError(400, state.public(str(exc)), param="messages") from None
    try:
        grammar = plan.grammar if plan else None
    except InputError as exc:  # a parameters schema that does not compile
        raise APIError(400, str(exc), param="tools") from None
    if grammar is not None and parsed.config.grammar is not None:
        raise APIError(400, "give either a tool_choice that forces calls or a structured-"
                            "output field (response_format, ...), not both",
                       param="tool_choice")
    reasoning = state.reasoning  # None with --reasoning-format none: the thinking is content
    inside = reasoning is not None and reasoning.opened_by(text)
    grammar = reply_grammar(grammar or parsed.config.grammar, reasoning, text,
                            state.options.constrain_thinking)
    fitted = _Fitted([ids], [replace(parsed.config, grammar=grammar)],
                     plan.fmt if plan and plan.parses_calls else None, reasoning, inside,
                     call_key=hashlib.sha256(str(ids).encode()).hexdigest())

    def follow(reply: str) -> list[int]:
        """The conversation with `reply` as the response returns it, rendered as this server
        renders a client's re-sent conversation: what the next prompt starts with (an idle
        server prefills it ahead; appending the reply's tokens would not match a template that
        renders the thinking or calls its own way, or drops earlier thinking, as Qwen3's)."""
        message = messages_field([assistant_message(reply, _read(fitted, reply),
                                                    fitted.call_key)])[0]
        return tokenizer.encode_rendered(render([*messages, message],
                                                add_generation_prompt=False))

    return replace(fitted, follow=follow)


def _fit_all(state: ServerState, parsed: ParsedRequest) -> _Fitted:
    """Each prompt's config, its completion fitted into the context (off the event loop).

    Raises:
        APIError: 400 for a prompt the chat template refuses, one too long for the context,
            tools that do not compile, or a logit bias or stop token id outside the
            vocabulary.
    """
    vocab = state.pair.target.spec.vocab_size
    for param, ids in (("logit_bias", [t for t, _ in parsed.config.sampling.logit_bias]),
                       ("stop_token_ids", parsed.config.stop_token_ids)):
        if outside := [t for t in ids if t >= vocab]:
            raise APIError(400, f"{param} names token id {outside[0]}, but this model's "
                                f"vocabulary has {vocab} ids (0..{vocab - 1})", param=param)
    param = "messages" if parsed.kind == "chat" else "prompt"
    fitted = _chat_prompt(state, parsed)
    config = fitted.configs[0]
    configs = []
    for prompt in fitted.prompts:
        try:
            ids = state.pair.encode_prompt(prompt)
            context = state.scheduler.context(config)
        except InputError as exc:
            raise APIError(400, state.public(str(exc)), param=param) from None
        room = context - len(ids)
        asked = config.max_new_tokens
        if room < 1 or (parsed.max_tokens_given and asked > room):
            raise APIError(400, f"This model's maximum context length is {context} tokens; the "
                                f"prompt has {len(ids)} tokens"
                                + (f" and {asked} more were requested." if room >= 1 else "."),
                           param=param, code="context_length_exceeded")
        configs.append(replace(config, max_new_tokens=min(asked, room)))
    return replace(fitted, configs=configs)


def _submit(state: ServerState, parsed: ParsedRequest, fitted: _Fitted,
            bridge: Bridge) -> list[_Choice]:
    """One job per prompt, its events tagged with its choice's index.

    Raises:
        APIError: 429 when the queue cannot take them all (those taken are cancelled).
    """
    score = parsed.config.logprobs if parsed.echo else None  # the echoed prompt's logprobs
    choices: list[_Choice] = []
    try:
        for p, (prompt, config) in enumerate(zip(fitted.prompts, fitted.configs, strict=True)):
            for j in range(parsed.n):  # OpenAI's order: prompt by prompt, n choices each
                i = p * parsed.n + j

                def sink(event: Any, i: int = i) -> None:
                    bridge.put((i, event))

                job = state.scheduler.submit(prompt, _choice_config(config, j), sink,
                                             score_prompt=score, follow=fitted.follow)
                choices.append(_Choice(i, prompt, job, parsed.echo))
    except QueueFull as full:
        _cancel(state, choices)
        raise APIError(429, f"The server is busy ({state.options.max_queue} requests queued); "
                            f"retry after {full.retry_after} s.", kind="rate_limit_error",
                       code="queue_full", headers={"Retry-After": str(full.retry_after)}) from None
    return choices


def _choice_config(config: GenerationConfig, j: int) -> GenerationConfig:
    """Choice j of a prompt: a seeded request's samples with seed + j (the same seed would give
    the same text: seeded sampling is position-keyed), the others as asked."""
    seed = config.sampling.seed
    if j == 0 or seed is None or config.sampling.greedy:
        return config
    return replace(config, sampling=replace(config.sampling, seed=(seed + j) % 2**64))


def _cancel(state: ServerState, choices: Sequence[_Choice]) -> None:
    for choice in choices:
        state.scheduler.cancel(choice.job)  # no-op once it has ended


def _echo_text(state: ServerState, choice: _Choice) -> str:
    """The prompt an echoed completion starts with: its text, or its token ids' text."""
    if isinstance(choice.prompt, str):
        return choice.prompt
    return state.pair.tokenizer.decode(prompt_ids(choice.prompt) or [],
                                       skip_special_tokens=False)


def _echoed(choice: _Choice, token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    """The echoed prompt's logprobs (the worker scored it before the job's first event)."""
    return echo_logprobs_json(choice.job.prompt_ids, choice.job.prompt_logprobs, token_bytes)


def _prompt_bytes(choice: _Choice, token_bytes: Callable[[int], bytes]) -> bytes:
    return b"".join(token_bytes(t) for t in choice.job.prompt_ids)


def _result_logprobs(kind: str, parsed: ParsedRequest, choice: _Choice,
                     result: GenerationResult, token_bytes: Callable[[int], bytes]
                     ) -> dict[str, Any] | None:
    """A finished choice's logprobs object (None when the request asked for none)."""
    if result.logprobs is None:
        return None
    if not parsed.echo:
        return logprobs_json(kind, result.logprobs, token_bytes)
    return join_logprobs_json(_echoed(choice, token_bytes), logprobs_json(
        kind, result.logprobs, token_bytes, before=_prompt_bytes(choice, token_bytes)))


async def _events(shape: ResponseShape, bridge: Bridge, parsed: ParsedRequest, state: ServerState,
                  choices: Sequence[_Choice], fitted: _Fitted) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed request, each choice's chunks as they come (a
    reply read for reasoning or tool calls: its reasoning and answer text as they are known
    not to open a tag, and each call as it closes)."""
    wants = parsed.config.logprobs is not None
    token_bytes = state.pair.tokenizer.token_bytes
    readers = {c.index: fitted.reader() for c in choices}
    called: dict[int, int] = {}  # calls sent, by choice

    def logprobs(choice: _Choice, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not wants:
            return None
        out = logprobs_json(shape.kind, entries, token_bytes, before=bytes(choice.sent))
        for e in entries:
            choice.sent.extend(token_bytes(e.token))
        return out

    def delta(index: int, part: ReplyPart, lp: dict[str, Any] | None) -> Iterator[bytes]:
        if part.reasoning:
            yield shape.chunk(None, logprobs=lp, index=index, reasoning=part.reasoning)
            lp = None
        if part.content or (lp is not None and not part.calls):
            yield shape.chunk(part.content or None, logprobs=lp, index=index)
            lp = None
        if part.calls:
            first = called.get(index, 0)
            called[index] = first + len(part.calls)
            yield shape.chunk(None, logprobs=lp, index=index,
                              calls=tool_calls_json(part.calls, fitted.call_key, first,
                                                    chunk=True))

    def read(index: int, text: str | None) -> ReplyPart:
        """The part of choice `index`'s reply that `text` lets out (None: the reply ended)."""
        reader = readers[index]
        if reader is None:
            return ReplyPart(content=text or "")
        return reader.feed(text) if text is not None else reader.finish()

    if shape.kind == "chat":  # each choice's opening chunk
        for choice in choices:
            yield shape.chunk("", index=choice.index)
    results: dict[int, GenerationResult] = {}
    while len(results) < len(choices):
        index, event = await bridge.get()
        choice = choices[index]
        if isinstance(event, Failed):
            error = _failure_error(event, state)
            yield sse(error_body(error.message, kind=error.kind, code=error.code))
            break
        if choice.echo:  # the prompt first, once
            choice.echo = False
            echoed = None
            if wants:
                echoed = _echoed(choice, token_bytes)
                choice.sent.extend(_prompt_bytes(choice, token_bytes))
            yield shape.chunk(_echo_text(state, choice), logprobs=echoed, index=index)
        if isinstance(event, Delta):
            choice.told += len(event.logprobs)
            for chunk in delta(index, read(index, event.text),
                               logprobs(choice, event.logprobs)):
                yield chunk
        elif isinstance(event, Finished):
            rest = (event.result.logprobs or [])[choice.told:]  # tokens no delta carried
            lp = logprobs(choice, rest) if rest else None
            last = read(index, None)
            if last.reasoning or last.content or last.calls:
                for chunk in delta(index, last, lp):
                    yield chunk
                lp = None
            yield shape.chunk(None, finish_reason(event.result.stop_reason,
                                                  called.get(index, 0) > 0),
                              lp, index=index)
            results[index] = event.result
    else:
        if parsed.include_usage:
            yield shape.usage_chunk([results[i] for i in range(len(choices))])
    yield SSE_DONE


async def _collect(request: Request, bridge: Bridge, choices: Sequence[_Choice],
                   state: ServerState) -> list[GenerationResult]:
    """Wait for every choice of a non-streaming request, in order; a client that disconnects
    cancels them, and a failed one fails the request (and cancels the rest)."""
    results: dict[int, GenerationResult] = {}
    failed: Failed | None = None
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(_cancel_on_disconnect, request, choices, state)
            while len(results) < len(choices) and failed is None:
                index, event = await bridge.get()
                if isinstance(event, Finished):
                    results[index] = event.result
                elif isinstance(event, Failed):
                    failed = event
            group.cancel_scope.cancel()
    finally:
        _cancel(state, choices)
    if failed is not None:
        raise _failure_error(failed, state)
    return [results[i] for i in range(len(choices))]


async def _cancel_on_disconnect(request: Request, choices: Sequence[_Choice],
                                state: ServerState) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    _cancel(state, choices)


def _failure_error(event: Failed, state: ServerState) -> APIError:
    status, kind = _FAILED[event.reason]
    return APIError(status, state.public(event.message), kind=kind, code=event.reason)
