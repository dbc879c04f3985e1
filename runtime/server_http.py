"""The HTTP plumbing of `specedge serve` (`runtime/server`): reading a bounded JSON body,
events from the worker thread into the event loop, the SSE response that cancels its generation
however it ends, the API-key and request-counting middleware, and the error handlers that answer
in OpenAI's error format without a traceback or a file path."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import SpecEdgeError
from .jobs import Event
from .metrics import Metrics
from .openai_api import APIError, error_body

log = logging.getLogger("specedge.serve")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenizer_info",
          "/tokenize", "/detokenize", "/health", "/metrics")


async def read_json(request: Request, limit: int, timeout_s: float) -> Any:
    """The request body as JSON, reading at most `limit` bytes within `timeout_s` seconds.

    Raises:
        APIError: 413 for a larger body, 408 for one that has not arrived in time, 400 for one
            that is not JSON.
    """
    too_big = APIError(413, f"The request body is larger than this server's limit of {limit} "
                            "bytes.", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client disconnected") from None
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s; send it "
                            "whole, or raise the server's --receive-timeout.",
                       code="request_timeout", headers={"Connection": "close"}) from None
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "The request body is not valid JSON.", code="invalid_json") from None


class Bridge:
    """Items (a request's events, tagged with their choice) from the worker thread into the
    event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def put(self, item: tuple[int, Event]) -> None:  # worker thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (server shutdown)
            pass

    async def get(self) -> tuple[int, Event]:
        return await self.queue.get()


class GenerationStream(StreamingResponse):
    """An SSE response that cancels its generation however the stream ends (client
    disconnect, server shutdown, or completion, where cancelling is a no-op)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def route_path(scope: Scope) -> str:
    """The path inside this app (without the prefix it is mounted at)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class RequireKey:
    """Bearer-key check on every route but /health, in constant time (sha256 digests compared
    with `hmac.compare_digest`, so neither content nor length leaks through timing)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(key.encode("utf-8")).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) == "/health" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = error_body("Incorrect or missing API key; send 'Authorization: Bearer KEY'.",
                          code="invalid_api_key")
        await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive,
                                                                               send)

    def _allowed(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
        scheme, _, token = header.partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        return hmac.compare_digest(digest, self._digest) and scheme.lower() == b"bearer"


class CountRequests:
    """Counts every HTTP request by route and status (unknown paths as "other")."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        path = route_path(scope)
        route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/")
                                              else "other")
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.inc("specedge_requests_total", route=route, status=str(status[0]))


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


SERVED = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /tokenizer_info, "
          "POST /tokenize, POST /detokenize, GET /health, GET /metrics")


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = route_path(request.scope)
    message, code = str(exc.detail), None
    if exc.status_code == 404:
        bare = path.rstrip("/")
        hint = f" (did you mean {bare}?)" if bare != path and bare in ROUTES else ""
        message = f"There is no route {path}{hint}; this server serves {SERVED}."
        code = "not_found"
    elif exc.status_code == 405:
        allowed = ", ".join(sorted(m.strip() for m in (exc.headers or {}).get("Allow", "")
                                   .split(",") if m.strip()))  # Starlette's order varies
        message = (f"{request.method} is not allowed on {path}"
                   + (f"; use {allowed}." if allowed else "."))
        code = "method_not_allowed"
    return JSONResponse(error_body(message, code=code), exc.status_code, headers=exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises `exc` after this response, so the server logs the traceback; the
    # client gets a fixed message.
    if isinstance(exc, SpecEdgeError):
        log.error("request failed: %s", exc)
    return JSONResponse(error_body("Internal server error.", kind="server_error"), 500)
