"""`specedge serve` as an ASGI app: the OpenAI API over a continuously batched speculative worker.

    app = create_app(Pair.load("pairs/smollm2-135m"), ServerOptions(api_key="..."))
    uvicorn.run(app, host="127.0.0.1", port=8000,    # or mount it in another Starlette app
                http=request_deadline_protocol(30))  # (runtime/http_deadline: slow heads)

Built on Starlette (https://www.starlette.io); requests are translated by `openai_api` and
decoded by `scheduler.Scheduler` on its own thread, so the event loop never runs a model. Routes:
`POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text), and vLLM's tokenizer routes `GET /tokenizer_info`,
`POST /tokenize`, `POST /detokenize` (`tokenize_api`). With an API key, every route but
`/health` needs `Authorization: Bearer KEY`, compared in constant time. Errors use OpenAI's
error format and never carry a traceback or a file path. Events cross from the worker thread to
the event loop through `loop.call_soon_threadsafe`, so the app runs on asyncio servers (uvicorn,
hypercorn).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .chat_template import template_variables
from .completions import complete
from .errors import FieldError, InputError
from .metrics import Metrics
from .openai_api import (
    APIError,
    RequestDefaults,
)
from .pair import GenerationConfig, Pair
from .reasoning import ReasoningFormat
from .scheduler import (
    Scheduler,
    SchedulerOptions,
)
from .server_http import (
    CountRequests,
    RequireKey,
    api_error,
    http_error,
    internal_error,
    read_json,
)
from .tokenize_api import detokenize, tokenize, tokenizer_info

__all__ = ["ServerOptions", "create_app"]


@dataclass(frozen=True)
class ServerOptions:
    """How `specedge serve` listens, limits and decodes.

    Attributes:
        host, port: where the CLI's uvicorn listens (127.0.0.1 by default: this machine only).
        api_key: required as `Authorization: Bearer KEY` on every route but /health (None: no
            key). Never printed or logged.
        model_name: the model id clients send (default: the pair folder's name).
        max_batch: requests decoding together (concat-form pairs).
        max_queue: requests waiting beyond the running ones; one more gets 429.
        max_tokens_limit: the largest `max_tokens` a request may ask for (and the default).
        max_context: prompt + completion tokens per request (sizes the batch's KV cache).
        max_body_bytes: the largest request body (413 above it).
        receive_timeout_s: seconds a client may take to send a request body (408 after it, and
            the connection closes), so a stalled or trickling client cannot hold a connection
            and its buffer; the CLI's uvicorn gives each request head the same time
            (`http_deadline.request_deadline_protocol`).
        request_timeout_s: a request still running after this long is ended (504).
        drafter, num_draft_tokens, adaptive: the decoding plan (None: the pair's defaults).
        warmup_tokens: tokens decoded for a short prompt at startup, before the server listens
            (0: none), so the first request does not pay for cold sessions and a cold tuner.
        prefill_budget: prompt tokens a batching server prefills between two rounds while
            requests decode (0: whole prompts at once; `ContinuousBatch`).
        template_variables: chat template variables for every chat request (e.g.
            `{"enable_thinking": false}`); a request's `chat_template_kwargs` override them.
        reasoning_format: "auto" returns a reasoning model's thinking apart
            (`message.reasoning_content`, `runtime/reasoning`), "none" leaves it in the content.
        constrain_thinking: structured output (`response_format`, a forced `tool_choice`)
            constrains a reasoning model's thinking too (False: the answer after it only, as
            with any reply read for reasoning; the grammar must then spell the thinking block).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    model_name: str | None = None
    max_batch: int = 4
    max_queue: int = 16
    max_tokens_limit: int = 512
    max_context: int = 2048
    max_body_bytes: int = 1 << 20
    receive_timeout_s: float = 30.0
    request_timeout_s: float = 300.0
    drafter: str | None = None
    num_draft_tokens: int | None = None
    adaptive: bool | None = None
    warmup_tokens: int = 8
    prefill_budget: int = 256
    template_variables: Mapping[str, Any] = field(default_factory=dict)
    reasoning_format: str = "auto"
    constrain_thinking: bool = False

    def __post_init__(self) -> None:
        checks = [("port", self.port, 0, 65535), ("max_batch", self.max_batch, 1, 256),
                  ("warmup_tokens", self.warmup_tokens, 0, 4096),
                  ("max_queue", self.max_queue, 0, 100_000),
                  ("max_tokens_limit", self.max_tokens_limit, 1, 1_000_000),
                  ("max_context", self.max_context, 2, 1_000_000),
                  ("max_body_bytes", self.max_body_bytes, 1024, 1 << 30),
                  ("prefill_budget", self.prefill_budget, 0, 1_000_000)]
        for name, value, lo, hi in checks:
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise InputError(f"server option {name} must be an integer in [{lo}, {hi}], "
                                 f"got {value!r}")
        for name, seconds in (("request_timeout_s", self.request_timeout_s),
                              ("receive_timeout_s", self.receive_timeout_s)):
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                    or not 0 < seconds < float("inf"):
                raise InputError(f"server option {name} must be a number of seconds > 0, got "
                                 f"{seconds!r}")
        if self.reasoning_format not in ("auto", "none"):
            raise InputError(f"server option reasoning_format must be 'auto' or 'none', got "
                             f"{self.reasoning_format!r}")
        try:
            template_variables(self.template_variables, "--chat-template-kwargs")
        except FieldError as exc:
            raise InputError(f"{exc.param}: {exc}") from None
        if self.api_key is not None and not self.api_key.strip():
            raise InputError("the API key is empty; pass a non-empty --api-key or none")

    def scheduler_options(self) -> SchedulerOptions:
        return SchedulerOptions(max_batch=self.max_batch, max_queue=self.max_queue,
                                request_timeout_s=self.request_timeout_s,
                                max_context=self.max_context, drafter=self.drafter,
                                num_draft_tokens=self.num_draft_tokens, adaptive=self.adaptive,
                                warmup_tokens=self.warmup_tokens,
                                prefill_budget=self.prefill_budget)


@dataclass
class ServerState:
    """What the routes share: the pair, the options, the worker and its counters."""

    pair: Pair
    options: ServerOptions
    scheduler: Scheduler
    metrics: Metrics
    defaults: RequestDefaults
    reasoning: ReasoningFormat | None = None  # a reasoning model's thinking, returned apart

    def public(self, message: str) -> str:
        """A runtime message with the pair's folder replaced by the model id."""
        for root in {str(self.pair.manifest.root), str(self.pair.manifest.root.resolve())}:
            message = message.replace(root, self.defaults.model)
        return message


def create_app(pair: Pair, options: ServerOptions | None = None) -> Starlette:
    """The ASGI app serving `pair` (see the module docstring).

    The decoding worker starts with the app's lifespan or at the first request, and stops at
    lifespan shutdown; `app.state.scheduler` and `app.state.metrics` expose it.

    Raises:
        InputError: a decoding plan the pair cannot run (e.g. a model drafter without a draft).
    """
    options = options or ServerOptions()
    metrics = Metrics()
    scheduler = Scheduler(pair, options.scheduler_options(), metrics)
    pair.plan(GenerationConfig(drafter=options.drafter, num_draft_tokens=options.num_draft_tokens,
                               adaptive=options.adaptive))  # fail now, not at the first request
    if pair.tokenizer.has_chat_template:  # a broken one would fail every chat request
        try:
            pair.encode_prompt([{"role": "user", "content": "Hello"}])
        except InputError as exc:
            raise InputError(f"{pair.manifest.root}: the pair's chat template fails for a user "
                             f"turn ({exc}); fix it (specedge export ... --chat-template FILE) "
                             "before serving") from None
    defaults = RequestDefaults(model=options.model_name or pair.manifest.root.name,
                               max_tokens_limit=options.max_tokens_limit,
                               drafter=options.drafter,
                               num_draft_tokens=options.num_draft_tokens,
                               adaptive=options.adaptive, per_request_plan=not scheduler.batched,
                               template_variables=dict(options.template_variables))
    reasoning = pair.prompts.reasoning if options.reasoning_format == "auto" else None
    state = ServerState(pair, options, scheduler, metrics, defaults, reasoning)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await anyio.to_thread.run_sync(scheduler.warm_up)  # before uvicorn listens (once)
        scheduler.start()
        yield
        await anyio.to_thread.run_sync(scheduler.close)

    def bind(handler: Callable[[Request, ServerState], Awaitable[Response]]
             ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await handler(request, state)
        return endpoint

    routes = [
        Route("/v1/chat/completions", bind(_chat), methods=["POST"]),
        Route("/v1/completions", bind(_text), methods=["POST"]),
        Route("/v1/models", bind(_models), methods=["GET"]),
        Route("/v1/models/{model:path}", bind(_model), methods=["GET"]),
        Route("/tokenizer_info", bind(_tokenizer_info), methods=["GET"]),
        Route("/tokenize", bind(_tokenize), methods=["POST"]),
        Route("/detokenize", bind(_detokenize), methods=["POST"]),
        Route("/health", bind(_health), methods=["GET"]),
        Route("/metrics", bind(_metrics), methods=["GET"]),
    ]
    middleware = [Middleware(CountRequests, metrics=metrics)]
    if options.api_key is not None:
        middleware.append(Middleware(RequireKey, key=options.api_key))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error,
                                        Exception: internal_error})
    # A path with a trailing slash gets a 404 that names the route, not a bare redirect that a
    # client which does not follow it (httpx by default) shows as an empty reply.
    app.router.redirect_slashes = False
    app.state.scheduler, app.state.metrics = scheduler, metrics
    return app


# ------------------------------------------------------------------------------- routes


async def _chat(request: Request, state: ServerState) -> Response:
    return await complete(request, state, "chat")


async def _text(request: Request, state: ServerState) -> Response:
    return await complete(request, state, "text")


async def _models(request: Request, state: ServerState) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def _model(request: Request, state: ServerState) -> Response:
    if request.path_params["model"] != state.defaults.model:
        raise APIError(404, "The model does not exist; GET /v1/models lists the served one.",
                       param="model", code="model_not_found")
    return JSONResponse(_model_card(state))


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.defaults.model, "object": "model", "created": 0, "owned_by": "specedge"}


async def _tokenizer_info(request: Request, state: ServerState) -> Response:
    return JSONResponse(tokenizer_info(state.pair, _context(state)))


async def _tokenize(request: Request, state: ServerState) -> Response:
    body = await read_json(request, state.options.max_body_bytes, state.options.receive_timeout_s)
    return JSONResponse(await run_in_threadpool(tokenize, state.pair, body, _context(state),
                                                state.defaults.template_variables))


async def _detokenize(request: Request, state: ServerState) -> Response:
    body = await read_json(request, state.options.max_body_bytes, state.options.receive_timeout_s)
    return JSONResponse(await run_in_threadpool(detokenize, state.pair, body))


def _context(state: ServerState) -> int:
    """The context (prompt + completion tokens) a request with the server's defaults gets."""
    return state.scheduler.context(GenerationConfig(drafter=state.options.drafter,
                                                    num_draft_tokens=state.options.num_draft_tokens,
                                                    adaptive=state.options.adaptive))


async def _health(request: Request, state: ServerState) -> Response:
    ok = state.scheduler.alive
    return JSONResponse({"status": "ok" if ok else "error", "model": state.defaults.model,
                         "scheduling": "continuous-batch" if state.scheduler.batched
                         else "fifo-batch-1"}, status_code=200 if ok else 503)


async def _metrics(request: Request, state: ServerState) -> Response:
    text = state.metrics.render({"specedge_queue_depth": state.scheduler.queued,
                                 "specedge_running": state.scheduler.running,
                                 "specedge_warmup_seconds": state.scheduler.warmup_s})
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
